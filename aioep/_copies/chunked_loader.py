"""The built-in external data loader: chunked reads through a ring of host-accessible
staging buffers, double-buffered against the copies to the device."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from .._base.errors import EpError, InUseError, InvalidArgument
from .._base.types import HOST_MEMORY_DEVICE, MemoryDevice, MemoryInfo, MemoryType
from .._plugin.loader import ExternalDataLoader
from .._plugin.tensor import Tensor

if TYPE_CHECKING:
    from .._plugin.allocator import Allocator
    from .._plugin.device import EpDevice
    from .._plugin.stream import SyncStream
    from .._plugin.transfer import TensorLike
    from .future import CopyFuture

__all__ = ["DEFAULT_CHUNK_BYTES", "ChunkedExternalDataLoader", "LoaderHost"]

DEFAULT_CHUNK_BYTES = 16 << 20
"""The built-in loader's read size (and staging buffer size): 16 MiB."""
_O_BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation


def _open(path: str, offset: int, length: int) -> int:
    fd = os.open(path, os.O_RDONLY | _O_BINARY | getattr(os, "O_CLOEXEC", 0))
    if hasattr(os, "posix_fadvise"):
        try:  # a hint for cold reads (larger readahead); harmless if refused
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass
    return fd


def _read_exact(fd: int, view: npt.NDArray[np.uint8], position: int, path: str) -> None:
    """Fill ``view`` with the bytes at ``position`` of the open file (no copy through Python)."""
    want = view.nbytes
    mv = view.data.cast("B")
    got = 0
    while got < want:
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [mv[got:]], position + got)
        else:  # pragma: no cover - Windows
            os.lseek(fd, position + got, os.SEEK_SET)
            n = os.readv(fd, [mv[got:]])
        if n == 0:
            raise EpError(
                f"external data file {path!r} ended at byte {position + got} while reading "
                f"{want} bytes at {position}: the file was truncated after validation"
            )
        got += n


class LoaderHost(Protocol):
    """What the built-in loader needs of its environment (`aioep.Environment` satisfies
    it): the devices (for their host-accessible staging memory), shared allocators and
    tensors to stage in, whether a data transfer copies between two memories, and copies."""

    def ep_devices(self) -> list[EpDevice]:
        """Every EP device, in registration order."""
        ...

    def get_shared_allocator(self, memory_info: MemoryInfo) -> Allocator | None:
        """The shared allocator for that memory, or None."""
        ...

    def empty(
        self, shape: Sequence[int] | int, dtype: npt.DTypeLike, memory_info: MemoryInfo | None
    ) -> Tensor:
        """An uninitialised tensor from the shared allocator of ``memory_info``."""
        ...

    def can_copy(self, src: MemoryDevice, dst: MemoryDevice) -> bool:
        """Whether a registered data transfer copies from ``src`` to ``dst`` memory."""
        ...

    def copy_tensors(
        self, src: Sequence[TensorLike], dst: Sequence[TensorLike], stream: SyncStream | None
    ) -> CopyFuture:
        """Copy each ``src[i]`` into ``dst[i]``."""
        ...


class ChunkedExternalDataLoader(ExternalDataLoader):
    """The loader used when a device's factory offers none.

    Reads the file in ``chunk_bytes`` pieces into a ring of ``staging_buffers``
    host-accessible buffers (the device's HOST_ACCESSIBLE memory when it has one,
    else host memory) and copies each piece to the destination with
    [`Environment.copy_tensors`][aioep.Environment.copy_tensors], on ``stream`` when given. Reading
    chunk n+1 overlaps copying chunk n, and host memory stays bounded by the ring whatever
    the tensor's size. Host-accessible destinations are read into directly.
    Reads run in worker threads, off the event loop.

    One loader serves one load at a time (concurrent calls take turns). Call
    [`close`][aioep.abc.ChunkedExternalDataLoader.close] to free the staging buffers.
    """

    def __init__(
        self,
        env: LoaderHost,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        staging_buffers: int = 2,
    ) -> None:
        for what, value in (("chunk_bytes", chunk_bytes), ("staging_buffers", staging_buffers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(
                    f"ChunkedExternalDataLoader: {what} must be an int >= 1, got {value!r}"
                )
        self._env = env
        self.chunk_bytes = chunk_bytes
        self.staging_buffers = staging_buffers
        self._rings: dict[MemoryDevice, list[Tensor]] = {}
        self._lock: anyio.Lock | None = None
        self._closed = False

    def can_load(self, memory_info: MemoryInfo) -> bool:
        if memory_info.device.is_host_accessible:
            return True
        staging = self._staging_info(memory_info.device)
        source = staging.device if staging is not None else HOST_MEMORY_DEVICE
        return self._env.can_copy(source, memory_info.device)

    async def load_tensor(
        self,
        path: str | os.PathLike[str],
        offset: int,
        length: int,
        tensor: Tensor,
        *,
        stream: SyncStream | None = None,
        on_progress: Callable[[int], object] | None = None,
    ) -> None:
        """Read ``length`` bytes at ``offset`` of ``path`` into ``tensor``.

        ``on_progress(nbytes)`` is called on the event loop as each chunk lands
        in the destination. On failure or cancellation the copies already
        enqueued are awaited (shielded) before returning, so no staging buffer
        is still in use; the destination then holds partial data.
        """
        if self._closed:
            raise InvalidArgument(f"{self!r} is closed")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise InvalidArgument(f"load_tensor: offset must be an int >= 0, got {offset!r}")
        if length != tensor.nbytes:
            raise InvalidArgument(
                f"load_tensor: length {length!r} differs from the size of {tensor!r} "
                f"({tensor.nbytes} bytes)"
            )
        if tensor.buffer.readonly or tensor.buffer.freed:
            raise InvalidArgument(f"load_tensor: {tensor!r} is read-only or freed")
        if length == 0:
            return
        filename = os.fspath(path)
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            fd = await anyio.to_thread.run_sync(_open, filename, offset, length)
            try:
                if tensor.is_host_accessible:
                    await self._read_direct(fd, filename, offset, length, tensor, on_progress)
                else:
                    await self._read_staged(
                        fd, filename, offset, length, tensor, stream, on_progress
                    )
            finally:
                os.close(fd)

    async def _read_direct(
        self,
        fd: int,
        path: str,
        offset: int,
        length: int,
        tensor: Tensor,
        on_progress: Callable[[int], object] | None,
    ) -> None:
        flat = tensor.numpy().reshape(-1).view(np.uint8)
        for start in range(0, length, self.chunk_bytes):
            n = min(self.chunk_bytes, length - start)
            await anyio.to_thread.run_sync(
                _read_exact, fd, flat[start : start + n], offset + start, path
            )
            if on_progress is not None:
                on_progress(n)

    async def _read_staged(
        self,
        fd: int,
        path: str,
        offset: int,
        length: int,
        tensor: Tensor,
        stream: SyncStream | None,
        on_progress: Callable[[int], object] | None,
    ) -> None:
        ring = self._ring(tensor.device)
        pending: list[CopyFuture | None] = [None] * len(ring)
        sizes = [0] * len(ring)
        order: list[int] = []  # slots in the order their copies were issued
        try:
            for i, start in enumerate(range(0, length, self.chunk_bytes)):
                slot = i % len(ring)
                future = pending[slot]
                if future is not None:  # the copy out of this staging buffer must finish first
                    await future
                    pending[slot] = None
                    order.remove(slot)
                    if on_progress is not None:
                        on_progress(sizes[slot])
                n = min(self.chunk_bytes, length - start)
                stage = ring[slot]
                await anyio.to_thread.run_sync(
                    _read_exact, fd, stage.numpy()[:n], offset + start, path
                )
                src = Tensor(stage.buffer, (n,), np.uint8, byte_offset=stage.byte_offset)
                dst = Tensor(tensor.buffer, (n,), np.uint8, byte_offset=tensor.byte_offset + start)
                pending[slot] = self._env.copy_tensors([src], [dst], stream)
                sizes[slot] = n
                order.append(slot)
            for slot in list(order):
                future = pending[slot]
                assert future is not None
                await future
                pending[slot] = None
                order.remove(slot)
                if on_progress is not None:
                    on_progress(sizes[slot])
        finally:
            # On failure or cancellation, wait for the copies still reading the staging
            # buffers: the device work runs its course, and the ring stays reusable.
            leftovers = [f for f in pending if f is not None]
            if leftovers:
                with anyio.CancelScope(shield=True):
                    for future in leftovers:
                        try:
                            await future
                        except Exception:
                            pass

    def _staging_info(self, device: MemoryDevice) -> MemoryInfo | None:
        for ep_device in self._env.ep_devices():
            if any(info.device == device for info in ep_device.memory_infos):
                return ep_device.memory_info(MemoryType.HOST_ACCESSIBLE)
        return None

    def _ring(self, device: MemoryDevice) -> list[Tensor]:
        ring = self._rings.get(device)
        if ring is None:
            info = self._staging_info(device)
            allocator = None if info is None else self._env.get_shared_allocator(info)
            staging_info = info if allocator is not None else None
            ring = [
                self._env.empty((self.chunk_bytes,), np.uint8, staging_info)
                for _ in range(self.staging_buffers)
            ]
            self._rings[device] = ring
        return ring

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging memory held now."""
        return sum(t.nbytes for ring in self._rings.values() for t in ring)

    def close(self) -> None:
        """Free the staging buffers; idempotent."""
        self._closed = True
        rings, self._rings = self._rings, {}
        for ring in rings.values():
            for t in ring:
                try:
                    t.buffer.free()
                except InUseError:  # a copy still reads it: it is freed when that copy drops it
                    pass

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return (
            f"<ChunkedExternalDataLoader chunk_bytes={self.chunk_bytes} "
            f"staging_buffers={self.staging_buffers}{state}>"
        )
