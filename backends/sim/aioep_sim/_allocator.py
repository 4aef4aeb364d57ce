"""The sim's allocators: DEFAULT memory from a sim device's address space, and pinned host
memory the device reaches directly."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aioep.abc import Allocator, HostAllocator

if TYPE_CHECKING:
    from aioep import MemoryInfo, SyncStream

    from ._device import SimDevice

__all__ = ["PinnedAllocator", "SimAllocator"]


class SimAllocator(Allocator):
    """Allocates a sim device's DEFAULT memory (not host-accessible)."""

    def __init__(self, memory_info: MemoryInfo, device: SimDevice) -> None:
        super().__init__(memory_info)
        self.device = device

    def _allocate(self, nbytes: int, stream: SyncStream | None) -> int:
        self.device.check_alive("allocate device memory")
        return self.device.memory.allocate(nbytes)

    def _free(self, ptr: int, nbytes: int, stream: SyncStream | None) -> None:
        # Freeing works even on a lost device, so buffers can always be dropped.
        self.device.memory.free(ptr)

    def stats(self) -> dict[str, int]:
        """The base counters plus the device's limit (``Limit``) and its total ``DeviceInUse``."""
        out = super().stats()
        out["Limit"] = self.device.memory.limit
        out["DeviceInUse"] = self.device.memory.in_use
        return out


class PinnedAllocator(HostAllocator):
    """Host memory the sim device can reach directly (HOST_ACCESSIBLE, like cudaHostAlloc).

    Aligned host blocks, exactly as the core's host allocator hands them out: a
    numpy view of a buffer keeps its block alive even after an explicit free.
    """
