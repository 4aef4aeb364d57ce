"""The pinned staging chunks of one stager (`ChunkPool`)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ._pool import Block, CachingPool

if TYPE_CHECKING:
    from ._stream import CudaStream

__all__ = ["Chunk", "ChunkPool", "bytes_at"]


def bytes_at(addr: int, n: int) -> npt.NDArray[np.uint8]:
    """A uint8 view of ``n`` bytes of host memory at ``addr`` (the caller keeps it alive)."""
    if n <= 0:
        return np.empty(0, np.uint8)
    view: npt.NDArray[np.uint8] = np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(addr))
    return view


class Chunk:
    """One pinned staging chunk: a block of the device's pinned pool and a byte view of it."""

    __slots__ = ("block", "view")

    def __init__(self, block: Block) -> None:
        self.block = block
        self.view = bytes_at(block.ptr, block.size)


class ChunkPool:
    """At most ``cap`` chunks of ``chunk_bytes`` from a device's pinned pool, made on demand
    one at a time (the pinned pool checks its limit before it allocates), reused while the
    stager lives, given back to the pinned pool at its close.

    The stager's ``cond`` guards it: `take`, `may_make`, `unmade` and `held_bytes` expect
    that lock held; `make` runs without it (it allocates); `made`, `give` and `close` take
    it (`give` wakes a worker waiting for a chunk).
    """

    def __init__(
        self, pinned: CachingPool, chunk_bytes: int, cap: int, cond: threading.Condition
    ) -> None:
        self._pinned = pinned
        self._chunk_bytes = chunk_bytes
        self._cap = cap
        self._cond = cond
        self._chunks: list[Chunk] = []
        self._free: list[Chunk] = []
        self._making = 0
        self.peak_bytes = 0
        """Most pinned staging memory held at once so far (bytes)."""

    @property
    def held_bytes(self) -> int:
        """Pinned staging memory held now (bytes). Call with the lock held."""
        return sum(c.block.size for c in self._chunks)

    def take(self) -> Chunk | None:
        """A free chunk, or None."""
        return self._free.pop() if self._free else None

    def may_make(self) -> bool:
        """Whether a new chunk may be made now (then `make` it, off the lock): none is being
        made and the pool is under its cap."""
        if self._making or len(self._chunks) >= self._cap:
            return False
        self._making += 1
        return True

    def make(self) -> Chunk:
        """Allocate the chunk `may_make` allowed (then call `made`, or `unmade` if this
        raises `aioep.DeviceError`)."""
        return Chunk(self._pinned.take(self._chunk_bytes))

    def made(self, chunk: Chunk) -> None:
        """A chunk `make` allocated: held from now on (and in use by its caller)."""
        with self._cond:
            self._making -= 1
            self._chunks.append(chunk)
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def unmade(self) -> bool:
        """`make` failed (the pinned pool is at its limit). True when the pool holds or is
        making other chunks: its cap shrinks to them and the caller waits for one; False
        when it has none (the caller fails)."""
        self._making -= 1
        if not self._chunks and not self._making:
            return False
        self._cap = max(1, len(self._chunks) + self._making)
        return True

    def give(self, chunk: Chunk) -> None:
        """The chunk is free again (its copies are done)."""
        with self._cond:
            self._free.append(chunk)
            self._cond.notify()

    def close(self, after: Iterable[CudaStream]) -> None:
        """Give every chunk back to the pinned pool, which reuses it only after the work
        queued so far on the ``after`` streams (none: at once)."""
        with self._cond:
            chunks, self._chunks, self._free = self._chunks, [], []
        streams = tuple(after)
        for chunk in chunks:
            self._pinned.give(chunk.block, streams)
