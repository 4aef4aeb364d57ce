"""The arena's stream-aware pools: the stream rule, parked chunks and growth over two BFC
cores (no locks: the arena calls it under its lock).

Small requests (size classes up to ``PARK_MAX``) and large ones live in separate
regions, each pool a BFC core of its own (PyTorch's small and large pools): freed
small chunks are parked for quick reuse, and parked chunks never sit in the way of
a large request, so a large request never has to look for parked chunks to merge.
A pool borrows from the other one only where growing would not do (a large request
takes a free chunk of a small region before the arena extends; a small request
takes one of a large region when the arena cannot extend).

Freed large chunks of host requests are *cached* as they are (no merge), and a
later host request takes the smallest cached chunk it fits closely, whole (no split):
a pair of a large allocation and its release touches no bin. Cached chunks go back
to their core, where they merge, before the arena grows (ORT reuses freed memory
first), unless that keeps evicting more than the large pool holds while little of the
arena is in use: then the cache's working set does not fit, and the pool grows.

The lists hits pop and releases push to (the host lists of ``parked`` and the
``cached`` lists) are changed by the arena's lock-free paths too (see the arena's
module docstring): code here changes them only by single list operations and
copes with a chunk another thread took first.

The miss path never walks the chunks: best fit is a ``bisect`` per bin, the free
chunks a stream may still use are indexed by stream in each core (``BfcCore.tagged``),
and the search for parked chunks in a request's way starts from the parked chunks
(at most ``MAX_PARKED`` per size class and stream), not from the regions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from .._base.errors import DeviceError, EpError
from .arena_config import SIZE_MAX, ArenaConfig, ArenaExtendStrategy
from .arena_parking import PARK_MAX, ParkedChunks, idle, usable
from .arena_regions import RegionReturns, RegionSizer, free_handles
from .bfc import BfcCore, Chunk, Region

if TYPE_CHECKING:
    from .._plugin.allocator import Allocator
    from .._plugin.stream import SyncStream

__all__ = ["LARGE", "SMALL", "StreamPool"]

_BACKPEDAL = 0.9  # on a base-allocator failure, retry an extension this much smaller
_RESIZE_MIN = 1 << 20  # see StreamPool.find: never resize a region for less dead space
SMALL, LARGE = 0, 1  # the pools (index into StreamPool.cores)


class StreamPool:
    """Free memory for streams: two BFC cores (small and large requests) whose free chunks
    are tagged with the stream that freed them, a fast path of parked chunks in front of
    the small one, and regions from ``base``.

    A chunk's ``tag`` is the stream it was allocated on while in use, and after the free
    the stream that may still use it (``None`` once that work is done); its ``mark`` is
    that stream's sync id at the free. Its ``cls`` is the size class it was handed out
    for when it may be parked, 0 when it may not, -1 for a reserved region's chunk.

    The fast path: a freed small chunk is parked in a short list per size class that
    the next request of that class pops without looking at bins: ``parked[size
    class]`` for chunks nobody may still be using (smallest, then lowest address first,
    so ``pop(0)`` gives the one best fit would pick; the chunk's ``home``), which serve
    every request, and ``stream_parked[size class][stream]`` for chunks a stream freed
    before it passed the work that used them (highest address first, so ``pop()``
    gives the lowest), which serve that stream, and another one only where the stream
    rule allows it. When a request's own list is empty, it gets the lowest address
    among the parked chunks it may take, as best fit would pick. Freed large chunks of
    host requests wait in ``cached`` (see the module docstring). Parked and cached
    chunks are in use as far as the core knows; they go back to it before the arena
    grows (see ``grow_and_find``), on ``shrink()`` and close, and whenever a caller
    looks at the chunks.
    """

    def __init__(
        self, base: Allocator, config: ArenaConfig, unit: int, returns: RegionReturns
    ) -> None:
        self.base = base
        self.name = base.memory_info.name
        self.limit = config.limit
        self.unit = unit
        self.small = BfcCore(unit, config.max_dead_bytes_per_chunk)
        self.large = BfcCore(unit, config.max_dead_bytes_per_chunk)
        self.cores = (self.small, self.large)
        self.sizer = RegionSizer(config, unit, self.limit, len(self.cores))
        self.returns = returns
        self.parking = parking = ParkedChunks()
        # The parking's lists and its lock-free calls, as the arena and hits use them.
        self.parked = parking.parked
        self.cached = parking.cached
        self.stream_parked = parking.stream_parked
        self.take_cached = parking.take_cached
        self.flush = parking.flush
        self.flush_cached = parking.flush_cached
        self.max_reserved = 0
        self.shrinkages = 0
        self.tagged = False  # set once a stream allocates: free chunks may carry tags
        self.exact = config.extend_strategy is ArenaExtendStrategy.SAME_AS_REQUESTED
        # Under SAME_AS_REQUESTED regions fit their requests, and freed large chunks go
        # back to the core at once (see find's resizing): none is cached.
        self.cache_large = not self.exact

    # -- the cores together -------------------------------------------------------------------
    @property
    def reserved(self) -> int:
        """Bytes of every region."""
        return self.small.reserved + self.large.reserved

    def regions(self) -> list[Region]:
        """Every region of both pools."""
        return self.small.regions + self.large.regions

    def largest_free(self) -> int:
        """The largest free chunk of either pool (0 when none)."""
        return max(self.small.largest_free(), self.large.largest_free())

    def walk(self) -> Iterator[Chunk]:
        """Every chunk of every region, in address order."""
        for region in sorted(self.regions(), key=lambda r: r.ptr):
            c: Chunk | None = region.head
            while c is not None:
                yield c
                c = c.next

    # -- taking ------------------------------------------------------------------------------
    def take(self, nbytes: int, rounded: int, stream: SyncStream | None, in_use: int) -> Chunk:
        """A chunk of class ``rounded`` for ``stream`` when its own parked list is empty:
        an untagged parked one, another stream's that the rule allows, the pool's best
        fit, or a new region; its ``cls`` set.

        Raises:
            DeviceError: out of memory (``in_use`` goes in the message).
        """
        if stream is not None:
            self.tagged = True
        if rounded <= PARK_MAX:
            chunk = self.parking.take_parked(rounded, stream)
            if chunk is not None:
                return chunk
            chunk = self.find(self.small, rounded, stream)
            if chunk is None:
                chunk = self.grow_and_find(nbytes, rounded, stream, in_use, SMALL)
        else:
            chunk = self.find(self.large, rounded, stream) or self.find(self.small, rounded, stream)
            if chunk is None:
                chunk = self.grow_and_find(nbytes, rounded, stream, in_use, LARGE)
        # Only small chunks of the small pool are parked when freed.
        chunk.cls = rounded if rounded <= PARK_MAX and chunk.region.core is self.small else 0
        return chunk

    def find(self, core: BfcCore, rounded: int, stream: SyncStream | None) -> Chunk | None:
        """``core``'s best-fitting chunk that ``stream`` may use, or None.

        Under ``SAME_AS_REQUESTED``, when that chunk came from a wholly free region at
        most twice the request that would leave at least max(1 MiB, 1/8 of the request)
        unused, the region is given back and replaced by one of the request's size:
        reserved memory only goes down, and the region is not kept half dead.
        """
        if self.tagged:
            cache: dict[int, bool] = {}
            chunk = core.alloc(rounded, stream, lambda c: usable(c, stream, cache))
        else:  # no stream has allocated yet: every free chunk is untagged
            chunk = core.alloc(rounded)
        if chunk is not None and self.exact and chunk.prev is None:
            size = chunk.region.size
            rest = chunk.next
            if (
                size - rounded >= max(_RESIZE_MIN, rounded >> 3)
                and size <= 2 * rounded
                and (rest is None or (not rest.in_use and rest.next is None))
                and chunk.tag is None  # nobody may still use it: it can go back to the base
            ):
                return self._resize_region(core, chunk, rounded)
        return chunk

    def _resize_region(self, core: BfcCore, chunk: Chunk, rounded: int) -> Chunk | None:
        region = chunk.region
        core.free(chunk)
        core.remove_region(region)
        self.shrinkages += 1
        free_handles([region])
        pool = self.cores.index(core)
        try:
            self.new_region(rounded, dedicated=False, pool=pool)
        except DeviceError:
            return None  # the caller extends (or reports the failure) as for any miss
        return core.alloc(rounded)  # the new region fits it exactly

    def _find_anywhere(self, rounded: int, stream: SyncStream | None, pool: int) -> Chunk | None:
        # The request's own pool first, then the other one (a large request already may).
        chunk = self.find(self.cores[pool], rounded, stream)
        if chunk is None and pool == LARGE:
            chunk = self.find(self.small, rounded, stream)
        return chunk

    def grow_and_find(
        self, nbytes: int, rounded: int, stream: SyncStream | None, in_use: int, pool: int
    ) -> Chunk:
        """A chunk once the parked chunks in the way go back (see below) or streams that
        passed their frees are untagged, else from a new region of ``pool``, else (the
        arena cannot grow) after every parked chunk goes back, and from the other pool.

        Raises:
            DeviceError: out of memory (``in_use`` goes in the message).
        """
        # Cached large chunks go back (and merge) before the arena grows, unless that keeps
        # evicting (twice the large pool since it last grew) while under a quarter of the
        # arena is in use: then the cache's working set does not fit, and the pool grows
        # (as for parked chunks, below; a busy arena never grows for its cache).
        thrashing = (
            self.parking.evicted_large > 2 * self.large.reserved and in_use * 4 <= self.reserved
        )
        if not thrashing and self.flush_cached():
            chunk = self._find_anywhere(rounded, stream, pool)
            if chunk is not None:
                return chunk
        # Parked chunks in the way go back before the arena grows (ORT reuses freed memory
        # first), unless that keeps evicting more than the small pool holds: then the fast
        # path's working set does not fit, and the pool grows instead (amortized: each
        # growth follows at most the pool's size in evictions, and the pool doubles).
        if (
            self.parked
            and self.parking.evicted < self.small.reserved
            and self.parking.flush_run(rounded)
        ):
            chunk = self._find_anywhere(rounded, stream, pool)
            if chunk is not None:
                return chunk
        if self.reset_passed_streams():
            chunk = self._find_anywhere(rounded, stream, pool)
            if chunk is not None:
                return chunk
        # Wholly free regions did not fit the request (regions never coalesce with each
        # other): give them back before extending, so the new region does not add to them.
        if self.returns.polled:
            self.returns.give_back_polled()
        self._give_back_free_regions(self.cores if pool == LARGE else (self.small,))
        try:
            self.extend(nbytes, rounded, in_use, pool)
        except DeviceError:
            chunk = self._reclaim(nbytes, rounded, stream, in_use, pool)
            if chunk is None:
                raise
            return chunk
        chunk = self.find(self.cores[pool], rounded, stream)
        if chunk is None:  # pragma: no cover - a fresh region always fits
            raise DeviceError(f"arena {self.name!r}: no chunk after extending")
        return chunk

    def _reclaim(
        self, nbytes: int, rounded: int, stream: SyncStream | None, in_use: int, pool: int
    ) -> Chunk | None:
        """Under pressure (the arena cannot extend): the parked chunks in the way of the
        request go back, then every parked chunk, then the other pool is tried and the
        regions that became wholly free go back for one more extension."""
        if self.parked and self.parking.flush_run(rounded):
            chunk = self.find(self.small, rounded, stream)
            if chunk is not None:
                return chunk
        if self.flush():
            chunk = self.find(self.small, rounded, stream)
            if chunk is not None:
                return chunk
        chunk = self.find(self.cores[1 - pool], rounded, stream)
        if chunk is not None:
            return chunk
        if self._give_back_free_regions(self.cores):
            try:
                self.extend(nbytes, rounded, in_use, pool)
            except DeviceError:
                return None
            return self.find(self.cores[pool], rounded, stream)
        return None

    def _give_back_free_regions(self, cores: tuple[BfcCore, ...]) -> int:
        gone = [r for core in cores for r in core.free_regions() if not r.dedicated]
        for region in gone:
            region.core.remove_region(region)  # type: ignore[union-attr]
        if gone:
            self.shrinkages += len(gone)
            free_handles(gone)
        return len(gone)

    def extend(self, nbytes: int, rounded: int, in_use: int, pool: int) -> None:
        """Add a region of ``pool`` that fits ``rounded`` bytes, under the limit."""
        available = (self.limit - self.reserved) // self.unit * self.unit
        if rounded > available:
            why = f"only {available} bytes are left under the limit"
            raise self.oom(nbytes, rounded, why, in_use)
        core = self.cores[pool]
        size = self.sizer.size_for(pool, rounded, available, core.reserved - core.in_use)
        while True:
            try:
                self.new_region(size, dedicated=False, pool=pool)
                return
            except DeviceError as exc:
                smaller = core.round(int(size * _BACKPEDAL))
                if smaller < rounded or smaller < 8192 or smaller >= size:
                    why = f"the base allocator failed: {exc}"
                    raise self.oom(nbytes, rounded, why, in_use) from exc
                size = smaller

    def new_region(self, size: int, *, dedicated: bool, pool: int = LARGE) -> Region:
        """A region of ``size`` bytes from the base allocator, added to ``pool``'s core.

        Raises:
            DeviceError: the base allocator failed.
        """
        try:
            buffer = self.base.alloc(size)
        except EpError as exc:
            if isinstance(exc, DeviceError):
                raise
            raise DeviceError(
                f"arena {self.name!r}: base allocator failed for {size} bytes: {exc}"
            ) from exc
        except MemoryError as exc:
            raise DeviceError(
                f"arena {self.name!r}: base allocator out of memory for {size} bytes"
            ) from exc
        region = self.cores[pool].add_region(buffer.ptr, size, buffer, dedicated=dedicated)
        if pool == SMALL:
            self.parking.evicted = 0
        else:
            self.parking.evicted_large = 0
        reserved = self.reserved
        if reserved > self.max_reserved:
            self.max_reserved = reserved
        if not dedicated:
            self.sizer.extensions += 1
        return region

    def oom(self, nbytes: int, rounded: int, why: str, in_use: int) -> DeviceError:
        """The out-of-memory error for a request, naming the limit and the bytes in use."""
        limit = "no limit" if self.limit == SIZE_MAX else f"limit {self.limit} bytes"
        return DeviceError(
            f"arena {self.name!r}: out of memory allocating {nbytes} bytes "
            f"(rounded to {rounded}): {why}; {limit}, {in_use} bytes in use, "
            f"{self.reserved} reserved, largest free block {self.largest_free()} bytes"
        )

    # -- giving back -------------------------------------------------------------------------
    def put_back(self, chunk: Chunk, *, closed: bool) -> Region | None:
        """Take back a chunk whose buffer was released: park it, or free it in its core.

        Returns a region that is now wholly free and that no stream uses, removed from
        its core, for the caller to give back (outside its lock).
        """
        stream: SyncStream | None = chunk.tag  # type: ignore[assignment]
        # A tagged chunk's mark is its stream's point at the release (set by the release).
        if stream is not None and idle(stream):
            chunk.tag = stream = None  # that work is done: anyone may take it
        region = chunk.region
        core: BfcCore = region.core  # type: ignore[assignment]
        if not region.dedicated and not closed:
            if not chunk.cls or not self.parking.park(chunk, stream):
                core.free(chunk, chunk.tag, chunk.mark)
            return None  # the region stays, free or not, until pressure or shrink()
        merged = core.free(chunk, chunk.tag, chunk.mark)
        if not region.wholly_free:
            return None
        if merged.tag is None:
            core.remove_region(region)
            return region
        self.returns.watch.append(region)  # freed while its stream may still use it
        return None

    def reset_passed_streams(self) -> int:
        """Untag the free and parked chunks whose stream has passed their point; returns
        how many. Looks only at chunks a stream may still use (indexed by stream)."""
        cache: dict[int, bool] = {}
        passed = self.parking.untag_passed(cache)
        for core in self.cores:
            if not core.tagged:
                continue
            for tag in list(core.tagged):
                for chunk in core.tagged_chunks(tag):
                    # An earlier one in this loop may have merged this chunk into a neighbour.
                    if usable(chunk, None, cache) and core.retag(chunk) is not None:
                        passed += 1
        return passed

    def release_stream(self, stream: SyncStream) -> None:
        """Untag every free and parked chunk of ``stream`` (ORT's ``ReleaseStreamBuffers``)."""
        self.parking.drop_stream(stream)
        for core in self.cores:
            for chunk in core.tagged_chunks(stream):
                core.retag(chunk)

    def take_free_regions(self) -> list[Region]:
        """Remove wholly free regions that no stream may still use from the cores (parked
        chunks go back first)."""
        self.flush()
        gone = [r for core in self.cores for r in core.free_regions() if not r.dedicated]
        for region in gone:
            region.core.remove_region(region)  # type: ignore[union-attr]
        return gone
