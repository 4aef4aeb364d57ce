"""Device memory (stream-ordered ``cuMemAllocAsync`` or plain ``cuMemAlloc``) and pinned host
memory (``cuMemHostAlloc``)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from aioep import Buffer, DeviceError
from aioep.abc import Allocator

from ._driver import call_nogil, check, ctx_current, driver, error_name
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


class CudaDeviceAllocator(Allocator):
    """GPU memory of one device.

    ``mode="async"``: ``cuMemAllocAsync``/``cuMemFreeAsync`` on the device's
    default memory pool, ordered on the buffer's stream when it is a CUDA
    stream of this device (else on a helper stream, synchronized once so the
    memory is usable from any stream). ``mode="sync"``: ``cuMemAlloc``/``cuMemFree``.
    """

    def __init__(self, device: CudaDevice, mode: str = "async") -> None:
        super().__init__(device.default_info)
        self.device = device
        self.mode = mode if device.memory_pools else "sync"
        self._live: dict[int, int] = {}
        self._live_lock = threading.Lock()

    def _own_stream(self, stream: SyncStream | None) -> CudaStream | None:
        impl = getattr(stream, "impl", None)
        if (
            isinstance(impl, CudaStream)
            and impl.device is self.device
            and not impl.closed
            and not getattr(stream, "closed", False)
        ):
            return impl
        return None

    def _allocate(self, nbytes: int, stream: SyncStream | None) -> int:
        drv = driver()
        dev = self.device
        with ctx_current(dev.ctx):
            if self.mode == "sync":
                err, ptr = drv.cuMemAlloc(nbytes)
                if err != drv.CUresult.CUDA_SUCCESS:
                    raise _oom(dev, "cuMemAlloc", nbytes, err)
            else:
                own = self._own_stream(stream)
                if own is not None:
                    with own.lock:
                        err, ptr = drv.cuMemAllocAsync(nbytes, own.cu)
                        own.enqueued()
                else:
                    helper = dev.helper_stream()
                    err, ptr = drv.cuMemAllocAsync(nbytes, helper)
                    if err == drv.CUresult.CUDA_SUCCESS:
                        # Usable from any stream: the allocation must have happened.
                        sync = call_nogil("cuStreamSynchronize", int(helper))
                        check(sync, "cuStreamSynchronize")
                if err != drv.CUresult.CUDA_SUCCESS:
                    raise _oom(dev, "cuMemAllocAsync", nbytes, err)
        addr = int(ptr)
        with self._live_lock:
            self._live[addr] = nbytes
        return addr

    def _free(self, ptr: int, nbytes: int, stream: SyncStream | None) -> None:
        drv = driver()
        with self._live_lock:
            self._live.pop(ptr, None)
        if self.mode == "sync":
            # cuMemFree synchronises the device: never on this thread (see _free.py).
            self.device.free_later(lambda: _free_device(self.device, ptr))
            return
        try:
            with ctx_current(self.device.ctx):
                own = self._own_stream(stream)
                if own is not None:
                    with own.lock:
                        if not own.closed:
                            drv.cuMemFreeAsync(ptr, own.cu)
                            own.enqueued()
                            return
                # The core frees a buffer only after the device work it knows of is done.
                drv.cuMemFreeAsync(ptr, self.device.helper_stream())
        except Exception:  # called from finalizers: never raise
            pass

    def __repr__(self) -> str:
        return f"<CudaDeviceAllocator {self.mode} device={self.device.ordinal} live={self.live_buffers}>"


def _free_device(device: CudaDevice, ptr: int) -> None:
    with ctx_current(device.ctx):
        call_nogil("cuMemFree_v2", ptr)


def _free_host(device: CudaDevice, ptr: int) -> None:
    with ctx_current(device.ctx):
        call_nogil("cuMemFreeHost", ptr)


class _PinnedBlock:
    """Owns one ``cuMemHostAlloc`` block and frees it when the last reference goes.

    The buffer and every numpy view of it hold the block, so an explicit
    ``buffer.free()`` never unmaps memory a view can still read. ``cuMemFreeHost``
    synchronises the device, so it runs on the factory's free thread, not on the
    thread that drops the last reference (the event loop, the dispatcher).
    """

    __slots__ = ("device", "ptr")

    def __init__(self, ptr: int, device: CudaDevice) -> None:
        self.ptr = ptr
        self.device = device

    def __del__(self) -> None:
        try:
            device, ptr = self.device, self.ptr
            device.free_later(lambda: _free_host(device, ptr))
        except Exception:  # a finalizer: never raise
            pass


class CudaPinnedAllocator(Allocator):
    """Page-locked host memory (``cuMemHostAlloc``, portable and device-mapped)."""

    def __init__(self, device: CudaDevice) -> None:
        super().__init__(device.pinned_info)
        self.device = device
        self._blocks: dict[int, _PinnedBlock] = {}
        self._blocks_lock = threading.Lock()

    def _allocate(self, nbytes: int, stream: SyncStream | None) -> int:
        drv = driver()
        flags = drv.CU_MEMHOSTALLOC_PORTABLE | drv.CU_MEMHOSTALLOC_DEVICEMAP
        with ctx_current(self.device.ctx):
            err, ptr = drv.cuMemHostAlloc(nbytes, flags)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise DeviceError(
                f"CUDA pinned allocator (device {self.device.ordinal}): cuMemHostAlloc of "
                f"{nbytes} bytes failed with {error_name(err)}"
            )
        with self._blocks_lock:
            self._blocks[int(ptr)] = _PinnedBlock(int(ptr), self.device)
        return int(ptr)

    def alloc(self, nbytes: int, *, stream: SyncStream | None = None) -> Buffer:
        buffer = super().alloc(nbytes, stream=stream)
        with self._blocks_lock:
            buffer._owner = self._blocks.get(buffer.ptr)
        return buffer

    def _free(self, ptr: int, nbytes: int, stream: SyncStream | None) -> None:
        # The memory goes back to the driver when the block's last holder (the buffer or a
        # numpy view of it) is gone.
        with self._blocks_lock:
            self._blocks.pop(ptr, None)
