"""Size classes: the chunk size an arena request gets, and the hit path's table of freed
chunks by request size."""

from __future__ import annotations

from .arena_config import SIZE_MAX
from .arena_parking import PARK_MAX
from .bfc import Chunk

__all__ = ["SizeClasses"]

# The hit path finds a small request's size class by its size >> 8 (classes are whole
# multiples of the 256-byte unit); the table where hits are off.
_TABLE_SHIFT = 8
_NO_TABLE = (None,) * (PARK_MAX >> _TABLE_SHIFT)

# Size classes: above 16 units (4 KiB for 256-byte units) a request rounds up to one of
# 8 classes per power of two (at most 12.5% more), so freed chunks of nearby sizes are
# interchangeable and a recurring size is a list lookup (PyTorch's roundup_power2_divisions).
_CLASS_BITS = 3
_CLASS_SHIFT = _CLASS_BITS + 1
# Above the fast path's sizes (PARK_MAX) classes are finer, 64 per power of two (at most
# 1.6% more): big chunks are not kept by class (a cached one serves any request it fits
# closely), so coarse classes would only waste memory.
_FINE_SHIFT = 6 + 1


class SizeClasses:
    """The size classes of an arena whose chunks are multiples of ``unit`` bytes."""

    __slots__ = ("class_from", "unit")

    def __init__(self, unit: int) -> None:
        self.unit = unit
        # Size classes need a power-of-two unit; otherwise every size is its own class.
        self.class_from = unit << (_CLASS_BITS + 1) if unit & (unit - 1) == 0 else SIZE_MAX

    def of(self, nbytes: int) -> int:
        """The chunk size a request of ``nbytes`` (> 0) gets (as `ArenaAllocator.alloc`
        inlines it)."""
        if nbytes > self.class_from:
            bits = (nbytes - 1).bit_length()
            step = 1 << (bits - (_FINE_SHIFT if nbytes > PARK_MAX else _CLASS_SHIFT))
            return (nbytes + step - 1) & -step
        unit = self.unit
        return (nbytes + unit - 1) // unit * unit

    def table(self, homes: dict[int, list[Chunk]]) -> list[list[Chunk] | None]:
        """The hit path's table: entry i is the list of freed chunks (in ``homes``, by size
        class; made where missing) of the size class of every request of
        ``(i << 8, (i + 1) << 8]`` bytes (None where those sizes are not of one class: a
        unit that is not a power of two)."""
        table: list[list[Chunk] | None] = []
        for i in range(PARK_MAX >> _TABLE_SHIFT):
            cls = self.of((i + 1) << _TABLE_SHIFT)
            if self.of((i << _TABLE_SHIFT) + 1) != cls:
                table.append(None)
                continue
            home = homes.get(cls)
            if home is None:
                home = homes[cls] = []
            table.append(home)
        return table
