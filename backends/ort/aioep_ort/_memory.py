"""Device memory through ORT: buffers backed by OrtValues, and the address map that lets the
data transfer find the OrtValues behind any tensor (views and arena sub-allocations included).

Two kinds of device pointer exist. Most EPs hand out real addresses
(``OrtValue.data_ptr()``); WebGPU hands out opaque ``WGPUBuffer`` handles, for
which ``ptr + offset`` means nothing and distinct buffers' handle ranges
overlap. For handles, aioep gives each buffer a private *virtual* address range
(never reused) so that offsets, views and the core's overlap checks stay exact,
and backs the buffer with several OrtValues of ``segment_bytes`` each: copies
then run at most a few segments per call and release the GIL between calls (ORT's
binding holds it for a whole ``copy_tensors`` call). The segment size is chosen
per allocation: ``chunk_bytes`` where set, otherwise what the transfer's pacer
measured a ``chunk_ms`` call to move (1-16 MiB; 8 MiB before any copy).

ORT calls that use or release device memory hold the library's
``Registration.device_lock`` (ORT's WebGPU EP crashes when a buffer is released on one
thread while a copy or run uses the device on another). So that the event loop never
waits for that lock: a buffer with opaque handles is virtual at first, and its
OrtValues are created on first use, under the lock, in the worker thread that copies
or runs; a buffer with real addresses is allocated at once, without the lock; and a
buffer whose lock is busy when it is freed is released by a background thread.
"""

from __future__ import annotations

import bisect
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from aioep import DeviceError, InvalidArgument, MemoryInfo, MemoryType
from aioep.abc import Allocator

from ._ort import ort, translate
from ._registry import Registration

if TYPE_CHECKING:
    from aioep import Buffer, SyncStream, Tensor

__all__ = ["AddressMap", "Block", "OrtAllocator"]

_VIRTUAL_BASE = 0x7E00_0000_0000
_PAGE = 1 << 16
_virtual_lock = threading.Lock()
_virtual_top = [_VIRTUAL_BASE]


def _virtual_range(nbytes: int) -> int:
    # Never reused, with a guard gap, so stale pointers never alias new buffers.
    with _virtual_lock:
        start = _virtual_top[0]
        _virtual_top[0] += (nbytes + 2 * _PAGE - 1) // _PAGE * _PAGE
        return start


@dataclass
class Block:
    """One allocation: its address range and the OrtValues that hold the memory."""

    start: int
    nbytes: int
    segment_bytes: int
    values: list[Any]
    """One OrtValue per segment; ``None`` for a segment not created yet (opaque memory)."""
    ort_memory_info: Any
    registration: Registration
    opaque: bool
    """Device pointers are handles (WebGPU): ``start`` is a virtual address."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Serialises read-modify-write of partly covered segments."""

    @property
    def device_lock(self) -> threading.RLock:
        """The library's lock for ORT calls on its devices."""
        return self.registration.device_lock

    def size(self, index: int) -> int:
        """The size in bytes of segment ``index``."""
        return min(self.segment_bytes, self.nbytes - index * self.segment_bytes)

    def segment(self, index: int) -> tuple[Any, int]:
        """The OrtValue of segment ``index`` (created now if it was not yet) and its size."""
        size = self.size(index)
        value = self.values[index]
        if value is None:
            with self.device_lock:
                value = self.values[index]
                if value is None:
                    value = self.values[index] = _new_value(
                        self.registration, self.ort_memory_info, size
                    )
        return value, size

    def release(self) -> None:
        """Give the OrtValues back to ORT: now if the device lock is free, else from the
        releaser thread (never blocking the caller, which may be the event loop)."""
        if self.device_lock.acquire(blocking=False):
            try:
                self._drop()
            finally:
                self.device_lock.release()
        else:
            release_in_background(self.device_lock, self._drop)

    def _drop(self) -> None:
        made = sum(v is not None for v in self.values)
        self.values.clear()  # the last references: ORT releases the memory here
        for _ in range(made):
            self.registration.value_released()


def _new_value(registration: Registration, ort_memory_info: Any, nbytes: int) -> Any:
    """A uint8 OrtValue of ``nbytes`` in ``ort_memory_info``, counted on ``registration``
    (call with the device lock held where the memory is opaque)."""
    if ort_memory_info is None:
        raise DeviceError(f"ORT library {registration.name!r} was unregistered")
    registration.value_created()
    try:
        return ort().OrtValue.ortvalue_from_shape_and_type(
            (nbytes,), np.uint8, memory_info=ort_memory_info
        )
    except Exception as exc:
        registration.value_released()
        raise translate(exc, f"allocating {nbytes} bytes through ORT") from exc


@functools.cache
def _releaser() -> ThreadPoolExecutor:
    # One thread: releases wait for the device lock there, in the order they were freed.
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="aioep-ort-release")


def release_in_background(lock: threading.RLock, drop: Callable[[], None]) -> None:
    """Call ``drop`` (which releases ORT objects) with ``lock`` held, in the releaser thread."""

    def run() -> None:
        with lock:
            drop()

    _releaser().submit(run)


class AddressMap:
    """Live blocks of one factory, searchable by any address inside them (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._blocks: dict[int, Block] = {}

    def add(self, block: Block) -> None:
        with self._lock:
            bisect.insort(self._starts, block.start)
            self._blocks[block.start] = block

    def pop(self, start: int) -> Block:
        with self._lock:
            block = self._blocks.pop(start)
            del self._starts[bisect.bisect_left(self._starts, start)]
            return block

    def find(self, ptr: int, nbytes: int) -> Block:
        """The block that holds ``[ptr, ptr + nbytes)``.

        Raises:
            InvalidArgument: no live block of this library holds that range.
        """
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            block = self._blocks.get(self._starts[i]) if i >= 0 else None
        if block is None or ptr + nbytes > block.start + block.nbytes:
            raise InvalidArgument(
                f"address range {ptr:#x}+{nbytes} is not live memory of this ORT library "
                "(freed, or allocated elsewhere)"
            )
        return block

    def __len__(self) -> int:
        return len(self._blocks)


class OrtAllocator(Allocator):
    """Device (or host-accessible) memory of one ORT plugin EP, as uint8 OrtValues.

    Each buffer's OrtValues live in the factory's `AddressMap` until the
    buffer is freed; they are counted on the library's `Registration`
    so the library is never unregistered from ORT while one is alive.
    """

    def __init__(
        self,
        memory_info: MemoryInfo,
        ort_memory_info: Any,
        registration: Registration,
        device_index: int,
        address_map: AddressMap,
        segment_bytes: Callable[[], int],
        *,
        device_check: bool = True,
    ) -> None:
        super().__init__(memory_info)
        self._ort_memory_info = ort_memory_info
        self._registration = registration
        self._device_index = device_index
        self._map = address_map
        self._segment_bytes = segment_bytes  # asked per allocation: the pacer adapts it
        self._device_check = device_check
        self._opaque: bool | None = None  # device pointers are handles (WebGPU)

    def _allocate(self, nbytes: int, stream: SyncStream | None) -> int:
        omi = self._ort_memory_info
        if omi is None:
            raise DeviceError(f"allocator {self.memory_info.name!r}: its library was unregistered")
        if self._device_check and self.memory_info.memory_type is MemoryType.DEFAULT:
            self._registration.check_device(self._device_index)
        reg = self._registration
        seg = self._segment_bytes()
        if self._opaque is None:
            # The first allocation finds out what the device's pointers are.
            with reg.device_lock:
                probe = _new_value(reg, omi, 1)
            self._opaque = bool(getattr(probe, "_is_webgpu_buffer", False))
            Block(0, 1, 1, [probe], omi, reg, self._opaque).release()
        if self._opaque:
            # Virtual until used: the segments' OrtValues are made by the first copy or run.
            seg = seg or nbytes
            count = -(-nbytes // seg)
            block = Block(_virtual_range(nbytes), nbytes, seg, [None] * count, omi, reg, True)
        else:
            # Real addresses: one contiguous OrtValue, made now (its address is the pointer),
            # without the device lock, which the caller (the event loop) must not wait for:
            # only WebGPU's handle-based buffers were seen to break under concurrent use.
            value = _new_value(reg, omi, nbytes)
            block = Block(int(value.data_ptr()), nbytes, nbytes, [value], omi, reg, False)
        self._map.add(block)
        return block.start

    def _free(self, ptr: int, nbytes: int, stream: SyncStream | None) -> None:
        self._map.pop(ptr).release()

    def _close(self) -> None:
        self._ort_memory_info = None

    def adopt_value(self, value: Any, nbytes: int) -> Buffer:
        """A buffer of this allocator over ``value``, an OrtValue of ``nbytes`` that ORT
        allocated in this memory (a session output): it holds the value, counts on the
        library's registration, and gives it back to ORT when the buffer is freed."""
        reg = self._registration
        reg.value_created()
        opaque = bool(getattr(value, "_is_webgpu_buffer", False))
        start = _virtual_range(nbytes) if opaque else int(value.data_ptr())
        block = Block(start, nbytes, nbytes, [value], self._ort_memory_info, reg, opaque)
        self._map.add(block)
        return self.adopt(start, nbytes)

    def ort_value(self, tensor: Tensor) -> Any:
        """The OrtValue that holds exactly ``tensor``'s bytes (for handing to ORT sessions).

        Raises:
            InvalidArgument: the tensor is a view, or spans several segments (allocate
                with ``chunk_bytes=0`` in the backend options to get one OrtValue).
        """
        block = self._map.find(tensor.data_ptr, tensor.nbytes)
        offset = tensor.data_ptr - block.start
        index, rem = divmod(offset, block.segment_bytes)
        value, size = block.segment(index)
        if rem or size != tensor.nbytes:
            raise InvalidArgument(
                f"{tensor!r} is not exactly one OrtValue (offset {offset}, {tensor.nbytes} bytes, "
                f"segments of {block.segment_bytes}); use chunk_bytes=0 for whole OrtValues"
            )
        return value
