"""Sim device memory: a private address space per device (the allocators are in ``_allocator``).

Device (DEFAULT) memory is not host memory as far as the rest of the program
knows: an allocation gets an address in the device's own address space, far
from any host pointer, and the bytes live in a numpy array that only the sim
holds, found again by address. Data moves in and out only through the sim's
data transfer, so ``Tensor.numpy()`` on it fails like it would on a GPU.
Addresses are never reused, so a copy that touches freed memory is caught as
an illegal address instead of silently reading someone else's data. As on a GPU
with unified addressing, every device of every sim factory in the process has its
own range of addresses: a pointer into one environment's sim memory never resolves
in another's.
"""

from __future__ import annotations

import bisect
import itertools
import threading

import numpy as np
import numpy.typing as npt

from aioep import DeviceError

__all__ = ["DEVICE_ALIGNMENT", "DeviceMemory"]

DEVICE_ALIGNMENT = 256  # what cudaMalloc guarantees
_ADDRESS_SPACE_BITS = 44  # 16 TiB of address space per device
# Address ranges, one per DeviceMemory in the process: 1 to 2**19 - 1, so that every address
# fits a signed 64-bit int (what DLPack's int64 fields and many consumers assume). Numbers
# come round again only after half a million sim devices.
_RANGES = 1 << (63 - _ADDRESS_SPACE_BITS)
_next_range = itertools.count()


class DeviceMemory:
    """One device's address space: allocations by address, with a byte limit."""

    def __init__(self, device_id: int, limit: int) -> None:
        self.device_id = device_id
        self.limit = limit
        self.base = (next(_next_range) % (_RANGES - 1) + 1) << _ADDRESS_SPACE_BITS
        self._next = self.base
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted: addresses only grow
        self._blocks: dict[
            int, tuple[npt.NDArray[np.uint8], int]
        ] = {}  # start -> (block, host addr)
        self.in_use = 0
        self.peak = 0
        # The allocation resolve() found last: (start, end, block, host address). Set and
        # cleared under the lock, read without it (a free clears it before it returns).
        self._last: tuple[int, int, npt.NDArray[np.uint8], int] | None = None

    def allocate(self, nbytes: int) -> int:
        """Reserve ``nbytes`` and return its device address.

        Raises:
            DeviceError: out of memory (the message names requested, limit and in-use bytes).
        """
        with self._lock:
            if self.in_use + nbytes > self.limit:
                raise DeviceError(
                    f"sim device {self.device_id}: out of memory allocating {nbytes} bytes "
                    f"(limit {self.limit} bytes, {self.in_use} in use, "
                    f"{self.limit - self.in_use} free)"
                )
            ptr = self._next
            end = ptr + nbytes
            if end >= self.base + (1 << _ADDRESS_SPACE_BITS):
                raise DeviceError(f"sim device {self.device_id}: address space exhausted")
            self._next = (end + DEVICE_ALIGNMENT - 1) & ~(DEVICE_ALIGNMENT - 1)
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
        # Outside the lock: numpy may take a while for big blocks. Uninitialised, as on a GPU.
        try:
            block = np.empty(nbytes, dtype=np.uint8)
        except MemoryError as exc:
            with self._lock:
                self.in_use -= nbytes
            raise DeviceError(
                f"sim device {self.device_id}: out of memory allocating {nbytes} bytes "
                "(the host could not back the allocation)"
            ) from exc
        with self._lock:
            self._starts.append(ptr)  # addresses grow, so the list stays sorted
            self._blocks[ptr] = (block, int(block.ctypes.data))
        return ptr

    def free(self, ptr: int) -> None:
        """Release the allocation that starts at ``ptr``."""
        with self._lock:
            self._last = None
            entry = self._blocks.pop(ptr, None)
            if entry is None:
                raise DeviceError(f"sim device {self.device_id}: free of unknown address {ptr:#x}")
            i = bisect.bisect_left(self._starts, ptr)
            del self._starts[i]
            self.in_use -= entry[0].nbytes

    def resolve(self, ptr: int, nbytes: int) -> tuple[npt.NDArray[np.uint8], int]:
        """The backing block of ``nbytes`` at device address ``ptr`` and the host address of ``ptr``.

        Hold the block while using the address: it keeps the memory alive even if
        the buffer is freed meanwhile.

        Raises:
            DeviceError: the range is not inside one live allocation (an illegal address).
        """
        last = self._last  # the common case: the allocation of the last copy, still live
        if last is not None and last[0] <= ptr and ptr + nbytes <= last[1]:
            return last[2], last[3] + (ptr - last[0])
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i >= 0:
                start = self._starts[i]
                block, addr = self._blocks[start]
                if ptr - start + nbytes <= block.nbytes:
                    self._last = (start, start + block.nbytes, block, addr)
                    return block, addr + (ptr - start)
        raise DeviceError(
            f"sim device {self.device_id}: illegal address: {nbytes} bytes at {ptr:#x} are not "
            "inside one live allocation (freed, or out of bounds)"
        )

    def view(self, ptr: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """A writable uint8 numpy view of device memory, for backend code (kernels, loaders).

        The view keeps the backing block alive. A zero-byte range is valid at any address.

        Raises:
            DeviceError: the range is not inside one live allocation (an illegal address).
        """
        if nbytes == 0:
            # A zero-size range touches no memory (a zero-size tensor's buffer has address 0).
            return np.empty(0, dtype=np.uint8)
        block, addr = self.resolve(ptr, nbytes)
        offset = addr - int(block.ctypes.data)
        return block[offset : offset + nbytes]

    @property
    def live_allocations(self) -> int:
        """Number of allocations not yet freed."""
        return len(self._blocks)
