"""The arena's parked chunks: freed small chunks kept per size class (and per stream) for
quick reuse, cached large host chunks, and the stream rule that says who may take a freed
chunk (see ``arena_pool``'s docstring; no locks: the arena calls it under its lock, except
for the single list operations of its lock-free paths)."""

from __future__ import annotations

import bisect
import operator
from typing import TYPE_CHECKING

from .._plugin.stream import has_passed, has_waited_for
from .bfc import BfcCore, Chunk

if TYPE_CHECKING:
    from .._plugin.stream import SyncStream

__all__ = ["CACHE_SHIFT", "MAX_PARKED", "PARK_MAX", "ParkedChunks", "idle", "usable"]

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
_bisect_left = bisect.bisect_left
_KEY = operator.attrgetter("key")  # size << 64 | ptr, set when the chunk is handed out


def idle(stream: SyncStream) -> bool:
    """True when ``stream`` has completed all work enqueued so far (or is closed)."""
    return stream.closed or stream.impl.query() is True


def usable(chunk: Chunk, stream: SyncStream | None, cache: dict[int, bool]) -> bool:
    """The stream rule: may a request on ``stream`` take this free chunk? (``cache`` holds
    each owner's idleness for one search.)"""
    owner: SyncStream | None = chunk.tag  # type: ignore[assignment]
    if owner is None or owner is stream:
        return True
    if stream is not None and has_waited_for(stream, owner, chunk.mark):
        return True  # stream waited on a notification owner recorded after the free
    key = id(owner)  # owners are alive (chunks hold them) for the one search of the cache
    done = cache.get(key)
    if done is None:
        done = cache[key] = idle(owner)
    return done or has_passed(owner, chunk.mark)


class ParkedChunks:
    """The fast path of a `StreamPool`: ``parked[size class]`` (freed chunks nobody may
    still be using: a chunk's ``home``), ``stream_parked[size class][stream]`` (chunks a
    stream freed before it passed the work that used them) and ``cached`` (freed large host
    chunks by octave); see `StreamPool` for the order each list keeps. Parked and cached
    chunks are in use as far as their core knows."""

    def __init__(self) -> None:
        self.parked: dict[int, list[Chunk]] = {}
        # Freed large host chunks kept as they are, by octave (size.bit_length()).
        self.cached: list[list[Chunk]] = [[] for _ in range(65)]
        self.stream_parked: dict[int, dict[SyncStream, list[Chunk]]] = {}
        # Bytes of parked chunks given back to make room (see grow_and_find) since the
        # small pool last grew: once they pass the pool's size, the pool thrashes (the
        # fast path's working set does not fit in it), and it grows instead.
        self.evicted = 0
        # Requested bytes of released host chunks taken back from their lists (the arena
        # counts a released chunk's requested bytes until then: see ArenaAllocator.alloc).
        self.dropped_req = 0
        self.evicted_large = 0  # bytes of cached large chunks given back since it last grew

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

    def take_parked(self, rounded: int, stream: SyncStream | None) -> Chunk | None:
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

    def untag_passed(self, cache: dict[int, bool]) -> int:
        """Free in their cores the stream-parked chunks whose stream has passed their point
        (untagged); returns how many."""
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
        return passed

    def drop_stream(self, stream: SyncStream) -> None:
        """Free ``stream``'s parked chunks in their cores, untagged."""
        for cls, per in list(self.stream_parked.items()):
            for chunk in per.pop(stream, ()):
                chunk.region.core.free(chunk, None, chunk.mark)  # type: ignore[union-attr]
            if not per:
                del self.stream_parked[cls]
