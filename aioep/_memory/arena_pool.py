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

import bisect
import operator
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .._base.errors import DeviceError, EpError
from .arena_config import SIZE_MAX, ArenaConfig, ArenaExtendStrategy
from .arena_regions import RegionReturns, RegionSizer, free_handles
from .bfc import BfcCore, Chunk, Region

if TYPE_CHECKING:
    from .._streams.stream import SyncStream
    from .allocator import Allocator

__all__ = ["LARGE", "MAX_PARKED", "PARK_MAX", "SMALL", "StreamPool", "idle", "usable"]

_BACKPEDAL = 0.9  # on a base-allocator failure, retry an extension this much smaller
_RESIZE_MIN = 1 << 20  # see StreamPool.find: never resize a region for less dead space
# Freed chunks kept per stream and size class (cached large ones: per power of two);
# more go back to the core.
MAX_PARKED = 16
# A cached large chunk serves a request of ``rounded`` bytes when it is at least that and
# less than ``rounded + (rounded >> CACHE_SHIFT)``, 1.5x (taken whole: see take_cached).
CACHE_SHIFT = 1
# Only chunks up to this size are parked (PyTorch's small-pool cutoff): small sizes repeat
# often and cost little to hold; larger ones go back to the core at once, so they merge
# and big requests find room.
PARK_MAX = 1 << 20
SMALL, LARGE = 0, 1  # the pools (index into StreamPool.cores)
_bisect_left = bisect.bisect_left
_KEY = operator.attrgetter("key")  # size << 64 | ptr, set when the chunk is handed out


def idle(stream: SyncStream) -> bool:
    """True when ``stream`` has completed all work enqueued so far (or is closed)."""
    return stream._closed or stream._impl.query() is True


def _tail_passed(stream: SyncStream, sync_id: int) -> bool:
    """True when a notification ``stream`` recorded after point ``sync_id`` is done."""
    tail = stream._tail
    return tail is not None and tail._sync_table.get(stream._uid, 0) > sync_id and tail.done()


def usable(chunk: Chunk, stream: SyncStream | None, cache: dict[int, bool]) -> bool:
    """The stream rule: may a request on ``stream`` take this free chunk? (``cache`` holds
    each owner's idleness for one search.)"""
    owner: SyncStream | None = chunk.tag  # type: ignore[assignment]
    if owner is None or owner is stream:
        return True
    if stream is not None and stream._sync_clock.get(owner._uid, 0) > chunk.mark:
        return True  # stream waited on a notification owner recorded after the free
    key = owner._uid
    done = cache.get(key)
    if done is None:
        done = cache[key] = idle(owner)
    return done or _tail_passed(owner, chunk.mark)


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
        self.parked: dict[int, list[Chunk]] = {}
        # Freed large host chunks kept as they are, by octave (size.bit_length()).
        self.cached: list[list[Chunk]] = [[] for _ in range(65)]
        self.stream_parked: dict[int, dict[SyncStream, list[Chunk]]] = {}
        self.max_reserved = 0
        self.shrinkages = 0
        self.tagged = False  # set once a stream allocates: free chunks may carry tags
        # Bytes of parked chunks given back to make room (see grow_and_find) since the
        # small pool last grew: once they pass the pool's size, the pool thrashes (the
        # fast path's working set does not fit in it), and it grows instead.
        self.evicted = 0
        # Requested bytes of released host chunks taken back from their lists (the arena
        # counts a released chunk's requested bytes until then: see ArenaAllocator.alloc).
        self.dropped_req = 0
        self.evicted_large = 0  # bytes of cached large chunks given back since it last grew
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
    def take_cached(self, rounded: int) -> Chunk | None:
        """The smallest cached large chunk that serves a request of ``rounded`` bytes (at
        least that, less than ``rounded + (rounded >> CACHE_SHIFT)``: as ORT's BFC takes
        a free chunk whole when the rest would be small), taken out of its list; None when
        there is none. Needs no lock (hits call it): each list is kept smallest first,
        and a chunk another thread takes first is not returned."""
        cached = self.cached
        b = rounded.bit_length()
        lowest = rounded << 64
        for chunks in cached[b : b + 2]:  # a slice: sizes near 2**64 have no next list
            i = _bisect_left(chunks, lowest, key=_KEY)
            try:
                chunk = chunks[i]
            except IndexError:
                continue  # none that large here (or another thread took it)
            size = chunk.size
            if size < rounded:  # the list changed under the search (another thread)
                return None
            if size >= rounded + (rounded >> CACHE_SHIFT):
                return None  # the smallest that fits wastes too much; the next list's more
            try:
                chunks.remove(chunk)
            except ValueError:  # another thread took it
                return None
            return chunk
        return None

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
            chunk = self._take_parked(rounded, stream)
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

    def _take_parked(self, rounded: int, stream: SyncStream | None) -> Chunk | None:
        """The lowest address among the parked chunks of class ``rounded`` that ``stream``
        may take, taken out of its list; None when there is none."""
        for _ in range(4):  # a hit may take the chosen chunk first: then look again
            best: Chunk | None = None
            best_list: list[Chunk] | None = None
            host = self.parked.get(rounded)
            if host:
                for chunk in host[:]:  # every one is usable; hits may pop meanwhile
                    if best is None or chunk.ptr < best.ptr:
                        best, best_list = chunk, host
            per = self.stream_parked.get(rounded)
            if per:
                cache: dict[int, bool] = {}
                for owner, parked in per.items():
                    if owner is stream:
                        chunk = parked[-1]
                        if best is None or chunk.ptr < best.ptr:
                            best, best_list = chunk, parked
                        continue
                    for chunk in parked:
                        if (best is None or chunk.ptr < best.ptr) and usable(chunk, stream, cache):
                            best, best_list = chunk, parked
            if best is None or best_list is None:
                return None
            try:
                best_list.remove(best)
            except ValueError:
                continue  # a hit (on the host list, without the lock) took it
            if not best_list and per and best_list is not host:
                for owner, parked in list(per.items()):
                    if not parked:
                        del per[owner]  # streams come and go: no empty lists for them
                if not per:
                    del self.stream_parked[rounded]
            return best
        return None

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
        thrashing = self.evicted_large > 2 * self.large.reserved and in_use * 4 <= self.reserved
        if not thrashing and self.flush_cached():
            chunk = self._find_anywhere(rounded, stream, pool)
            if chunk is not None:
                return chunk
        # Parked chunks in the way go back before the arena grows (ORT reuses freed memory
        # first), unless that keeps evicting more than the small pool holds: then the fast
        # path's working set does not fit, and the pool grows instead (amortized: each
        # growth follows at most the pool's size in evictions, and the pool doubles).
        if self.parked and self.evicted < self.small.reserved and self.flush_run(rounded):
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
        if self.parked and self.flush_run(rounded):
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
            self.evicted = 0
        else:
            self.evicted_large = 0
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
            if not chunk.cls or not self.park(chunk, stream):
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

    def park(self, chunk: Chunk, tag: SyncStream | None) -> bool:
        """Park a freed chunk in its class's list for ``tag``; False when that list is full.

        A host list (``tag`` None) is the chunk's ``home``, where hits pop and releases
        insert without the lock: smallest, then lowest address first (``pop(0)``). A
        stream's list is kept highest address first, so ``pop()`` gives the lowest.
        """
        if tag is None:
            home = self.parked.get(chunk.cls)
            if home is None:
                home = self.parked[chunk.cls] = []
            if len(home) >= MAX_PARKED:
                return False
            chunk.home = home
            bisect.insort(home, chunk, key=_KEY)  # smallest, lowest address first
            return True
        per = self.stream_parked.get(chunk.cls)
        if per is None:
            self.stream_parked[chunk.cls] = {tag: [chunk]}
            return True
        parked = per.get(tag)
        if parked is None:
            per[tag] = [chunk]
            return True
        n = len(parked)
        if n >= MAX_PARKED:
            return False
        if not n or parked[-1].ptr > chunk.ptr:
            parked.append(chunk)
        else:  # keep the list highest address first, so pop() gives the lowest
            i = 0
            ptr = chunk.ptr
            while parked[i].ptr > ptr:
                i += 1
            parked.insert(i, chunk)
        return True

    def flush_run(self, rounded: int) -> bool:
        """Free just the parked chunks in the way of a request, and returns whether it did.

        It takes the smallest run of untagged free and parked chunks that would hold
        ``rounded`` bytes once merged, and within it the fewest chunks around its
        largest free one; the other parked chunks stay for their sizes. Runs are found
        from the parked chunks (each run looked at once), never by walking the regions.
        """
        parked = {id(c) for chunks in self.parked.values() for c in chunks[:]}
        if not parked:
            return False

        def in_run(c: Chunk | None) -> bool:
            return c is not None and c.tag is None and (not c.in_use or id(c) in parked)

        seen: set[int] = set()
        best: list[Chunk] = []
        best_size = 0
        for chunks in self.parked.values():
            for start in chunks[:]:
                if id(start) in seen:
                    continue
                while in_run(start.prev):
                    start = start.prev  # type: ignore[assignment]
                run: list[Chunk] = []
                size = 0
                c: Chunk | None = start
                while in_run(c):
                    assert c is not None
                    run.append(c)
                    seen.add(id(c))
                    size += c.size
                    c = c.next
                if size >= rounded and (not best or size < best_size):
                    best, best_size = run, size
        if not best:
            return False
        # Grow a window from the run's largest free chunk, the bigger neighbour first.
        free = [c for c in best if not c.in_use]
        lo = hi = best.index(max(free, key=lambda c: c.size)) if free else 0
        size = best[lo].size
        while size < rounded:
            left = best[lo - 1].size if lo > 0 else -1
            right = best[hi + 1].size if hi + 1 < len(best) else -1
            if left >= right:
                lo -= 1
                size += left
            else:
                hi += 1
                size += right
        freed = False
        for chunk in best[lo : hi + 1]:
            if not chunk.in_use:
                continue
            try:
                self.parked[chunk.cls].remove(chunk)
            except ValueError:
                continue  # a hit (without the lock) took it meanwhile: it stays in use
            self.evicted += chunk.size
            self.dropped_req += chunk.req
            chunk.req = 0
            chunk.region.core.free(chunk, None, chunk.mark)  # type: ignore[union-attr]
            freed = True
        return freed

    def flush(self) -> int:
        """Free every parked and cached chunk in its core, where it merges; returns how
        many."""
        count = 0
        for home in self.parked.values():  # the lists stay: they are the chunks' homes
            while home:
                try:
                    chunk = home.pop()
                except IndexError:  # a hit took the last one
                    break
                self.dropped_req += chunk.req
                chunk.req = 0
                chunk.region.core.free(chunk, None, chunk.mark)  # type: ignore[union-attr]
                count += 1
        count += self.flush_cached()
        parked = [
            c for per in self.stream_parked.values() for chunks in per.values() for c in chunks
        ]
        self.stream_parked.clear()
        for chunk in parked:
            chunk.region.core.free(chunk, chunk.tag, chunk.mark)  # type: ignore[union-attr]
        return count + len(parked)

    def flush_cached(self, core: BfcCore | None = None) -> int:
        """Free every cached large chunk (of ``core``'s regions, or of both cores) in its
        core, where it merges; returns how many."""
        count = 0
        for chunks in self.cached:
            if core is not None:
                for chunk in chunks[:]:
                    if chunk.region.core is core:
                        try:
                            chunks.remove(chunk)
                        except ValueError:  # a hit took it
                            continue
                        count += self._uncache(chunk)
                continue
            while chunks:
                try:
                    chunk = chunks.pop()
                except IndexError:  # a hit took the last one
                    break
                count += self._uncache(chunk)
        return count

    def _uncache(self, chunk: Chunk) -> int:
        self.dropped_req += chunk.req
        chunk.req = 0
        self.evicted_large += chunk.size
        chunk.region.core.free(chunk, None, chunk.mark)  # type: ignore[union-attr]
        return 1

    def reset_passed_streams(self) -> int:
        """Untag the free and parked chunks whose stream has passed their point; returns
        how many. Looks only at chunks a stream may still use (indexed by stream)."""
        cache: dict[int, bool] = {}
        passed = 0
        for cls, per in list(self.stream_parked.items()):
            for owner in list(per):
                keep = []
                for chunk in per[owner]:
                    if usable(chunk, None, cache):
                        chunk.region.core.free(chunk, None, chunk.mark)  # type: ignore[union-attr]
                        passed += 1
                    else:
                        keep.append(chunk)
                if keep:
                    per[owner] = keep
                else:
                    del per[owner]
            if not per:
                del self.stream_parked[cls]
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
        for cls, per in list(self.stream_parked.items()):
            for chunk in per.pop(stream, ()):
                chunk.region.core.free(chunk, None, chunk.mark)  # type: ignore[union-attr]
            if not per:
                del self.stream_parked[cls]
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
