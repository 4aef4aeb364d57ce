"""Device memory (stream-ordered ``cuMemAllocAsync``, or ``cuMemAlloc`` blocks cached by size)
and pinned host memory (the device's pinned pool over ``cuMemHostAlloc``).

Nothing here makes a call that synchronises the device or context while an environment
runs: stream-ordered memory is freed with ``cuMemFreeAsync``; ``cuMemAlloc`` and
``cuMemHostAlloc`` blocks go back to caching pools (`._pool`) and reach the driver's
synchronising frees only at the last close, off the event loop.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from aioep import Buffer, DeviceError
from aioep.abc import Allocator

from ._driver import ctx_current, driver, error_name
from ._pool import Block, CachingPool
from ._stream import CudaStream

if TYPE_CHECKING:
    from aioep import SyncStream

    from ._device import CudaDevice

__all__ = ["CudaDeviceAllocator", "CudaPinnedAllocator"]


def _oom(device: CudaDevice, what: str, nbytes: int, err: Any) -> DeviceError:
    free, total = device.mem_info()
    free_txt = "unknown" if free < 0 else f"{free}"
    return DeviceError(
        f"CUDA device {device.ordinal} ({device.name}): {what} of {nbytes} bytes failed with "
        f"{error_name(err)}; {free_txt} bytes free of {total}"
    )


def _own_stream(device: CudaDevice, stream: SyncStream | None) -> CudaStream | None:
    impl = getattr(stream, "impl", None)
    if (
        isinstance(impl, CudaStream)
        and impl.device.shared is device.shared
        and not impl.closed
        and not getattr(stream, "closed", False)
    ):
        return impl
    return None


class CudaDeviceAllocator(Allocator):
    """GPU memory of one device.

    ``mode="async"``: ``cuMemAllocAsync``/``cuMemFreeAsync`` on the device's default memory
    pool, ordered on the buffer's stream when it is a CUDA stream of this device. Without
    one, on the device's helper stream: the host never waits for it; instead every stream
    waits on the device for the helper stream's allocations before it next copies
    (``cuStreamWaitEvent``), so the tensor is usable at once from any stream of the backend.

    ``mode="sync"``: ``cuMemAlloc`` blocks, cached by size class and reused once the work
    of the stream that freed them has completed; ``cuMemFree`` (which synchronises the
    device) runs only when the device's shared state is released at close. The cache is
    never trimmed while an environment runs: an allocation that fails reports the bytes
    cached.
    """

    def __init__(self, device: CudaDevice, mode: str = "async") -> None:
        super().__init__(device.default_info)
        self.device = device
        self.mode = mode if device.memory_pools else "sync"
        self._blocks: dict[int, Block] = {}
        self._blocks_lock = threading.RLock()

    def _allocate(self, nbytes: int, stream: SyncStream | None) -> int:
        dev = self.device
        if self.mode == "sync":
            cache: CachingPool = dev.shared.device_cache
            try:
                block = cache.take(nbytes)
            except DeviceError as exc:
                free, total = dev.mem_info()
                raise DeviceError(
                    f"CUDA device {dev.ordinal} ({dev.name}): cuMemAlloc of {nbytes} bytes "
                    f"failed ({exc}); {'unknown' if free < 0 else free} bytes free of {total}"
                ) from exc
            with self._blocks_lock:
                self._blocks[block.ptr] = block
            return block.ptr
        drv = driver()
        own = _own_stream(dev, stream)
        if own is not None:
            with own.lock, ctx_current(dev.ctx):
                err, ptr = drv.cuMemAllocAsync(nbytes, own.cu)
                if err == drv.CUresult.CUDA_SUCCESS:
                    own.enqueued()
        else:
            err, ptr = dev.shared.alloc_on_helper(nbytes)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise _oom(dev, "cuMemAllocAsync", nbytes, err)
        with dev.shared.lock:
            dev.shared.held += 1
        return int(ptr)

    def _free(self, ptr: int, nbytes: int, stream: SyncStream | None) -> None:
        try:
            dev = self.device
            own = _own_stream(dev, stream)
            if self.mode == "sync":
                with self._blocks_lock:
                    block = self._blocks.pop(ptr)
                dev.shared.device_cache.give(block, () if own is None else (own,))
                return
            drv = driver()
            try:
                with ctx_current(dev.ctx):
                    if own is not None:
                        with own.lock:
                            if not own.closed:
                                drv.cuMemFreeAsync(ptr, own.cu)
                                own.enqueued()
                                return
                    # The core frees a buffer only after the device work it knows of is done.
                    drv.cuMemFreeAsync(ptr, dev.helper_stream())
            finally:
                with dev.shared.lock:
                    dev.shared.held -= 1
                    last = not dev.shared.held
                if last:
                    dev.shared.maybe_release()
        except Exception:  # called from finalizers: never raise
            pass

    def __repr__(self) -> str:
        return f"<CudaDeviceAllocator {self.mode} device={self.device.ordinal} live={self.live_buffers}>"


class _PinnedHold:
    """Holds one block of the pinned pool; gives it back when the last holder is gone.

    The buffer and every numpy view of it hold this object, so an explicit
    ``buffer.free()`` never hands out memory a view can still read. Going back to the pool
    makes no driver call that waits: an event is recorded on the buffer's stream (if any) and
    the block is reused only once it has completed.
    """

    __slots__ = ("block", "pool", "stream")

    def __init__(self, pool: CachingPool, block: Block, stream: CudaStream | None) -> None:
        self.pool = pool
        self.block = block
        self.stream = stream

    def __del__(self) -> None:
        try:
            self.pool.give(self.block, () if self.stream is None else (self.stream,))
        except Exception:  # a finalizer: never raise
            pass


class CudaPinnedAllocator(Allocator):
    """Page-locked host memory (portable and device-mapped) from the device's pinned pool."""

    def __init__(self, device: CudaDevice) -> None:
        super().__init__(device.pinned_info)
        self.device = device
        self._holds: dict[int, _PinnedHold] = {}
        self._holds_lock = threading.RLock()

    def _allocate(self, nbytes: int, stream: SyncStream | None) -> int:
        pool = self.device.pinned
        try:
            block = pool.take(nbytes)
        except DeviceError as exc:
            raise DeviceError(
                f"CUDA pinned allocator (device {self.device.ordinal}): {nbytes} bytes: {exc}"
            ) from exc
        with self._holds_lock:
            self._holds[block.ptr] = _PinnedHold(pool, block, _own_stream(self.device, stream))
        return block.ptr

    def alloc(self, nbytes: int, *, stream: SyncStream | None = None) -> Buffer:
        buffer = super().alloc(nbytes, stream=stream)
        with self._holds_lock:
            buffer._owner = self._holds.get(buffer.ptr)
        return buffer

    def _free(self, ptr: int, nbytes: int, stream: SyncStream | None) -> None:
        # The block goes back to the pool when its last holder (the buffer or a numpy view of
        # it) is gone.
        with self._holds_lock:
            self._holds.pop(ptr, None)
