"""The arena's stream-aware pool: the stream rule, parked chunks and growth over the BFC
core (no locks: the arena calls it under its lock)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._base.errors import DeviceError, EpError
from .arena_config import SIZE_MAX, ArenaConfig, ArenaExtendStrategy
from .arena_regions import RegionReturns, RegionSizer, free_handles
from .bfc import Chunk, Region

if TYPE_CHECKING:
    from .._streams.stream import SyncStream
    from .allocator import Allocator

__all__ = ["StreamPool", "idle", "usable"]

_BACKPEDAL = 0.9  # on a base-allocator failure, retry an extension this much smaller
_RESIZE_MIN = 1 << 20  # see StreamPool.find: never resize a region for less dead space
MAX_PARKED = 16  # freed chunks kept per stream and size class; more go back to the core
# Only chunks up to this size are parked (PyTorch's small-pool cutoff): small sizes repeat
# often and cost little to hold; larger ones go back to the core at once, so they merge
# and big requests find room without first flushing the fast path.
PARK_MAX = 1 << 20


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
    """Free memory for streams: the BFC core's chunks tagged with the stream that freed
    them, a fast path of parked chunks in front of it, and regions from ``base``.

    A chunk's ``tag`` is the stream it was allocated on while in use, and after the free
    the stream that may still use it (``None`` once that work is done); its ``mark`` is
    that stream's sync id at the free.

    The fast path: a freed chunk is parked in ``fast[size class][tag]``, a short list
    (highest address first) that the next request of that class on the same stream
    pops without walking bins; ``None``'s list serves every stream, and a request on
    another stream takes a parked chunk only where the stream rule allows it. Among the
    chunks a request may take, it gets the lowest address, as best fit would pick.
    Parked chunks are in use as far as the core knows; they go back to it on pressure
    (before the arena would extend, on ``shrink()`` and close) and whenever a caller
    looks at the chunks.
    """

    def __init__(
        self, base: Allocator, config: ArenaConfig, unit: int, returns: RegionReturns
    ) -> None:
        self.base = base
        self.name = base.memory_info.name
        self.limit = config.limit
        self.unit = unit
        self.core = core = returns.core
        self.sizer = RegionSizer(config, unit, self.limit)
        self.returns = returns
        assert core.unit == unit
        self.fast: dict[int, dict[SyncStream | None, list[Chunk]]] = {}
        self.max_reserved = 0
        self.shrinkages = 0
        self.tagged = False  # set once a stream allocates: free chunks may carry tags
        self.exact = config.extend_strategy is ArenaExtendStrategy.SAME_AS_REQUESTED

    # -- taking ------------------------------------------------------------------------------
    def take(self, nbytes: int, rounded: int, stream: SyncStream | None, in_use: int) -> Chunk:
        """A chunk of class ``rounded`` for ``stream`` when its own parked list is empty:
        an untagged parked one, another stream's that the rule allows, the core's best
        fit, or a new region.

        Raises:
            DeviceError: out of memory (``in_use`` goes in the message).
        """
        if stream is not None:
            self.tagged = True
        per = self.fast.get(rounded)
        if per:
            chunk = self._take_parked(per, stream)
            if chunk is not None:
                return chunk
        chunk = self.find(rounded, stream)
        if chunk is None:
            chunk = self.grow_and_find(nbytes, rounded, stream, in_use)
        return chunk

    @staticmethod
    def _take_parked(
        per: dict[SyncStream | None, list[Chunk]], stream: SyncStream | None
    ) -> Chunk | None:
        # The lowest usable address among the parked chunks of one class.
        best: Chunk | None = None
        best_owner: SyncStream | None = None
        cache: dict[int, bool] = {}
        for owner, parked in per.items():
            if not parked:
                continue
            if owner is None or owner is stream:
                chunk = parked[-1]  # the list's lowest address, and every one is usable
                if best is None or chunk.ptr < best.ptr:
                    best, best_owner = chunk, owner
                continue
            for chunk in parked:
                if (best is None or chunk.ptr < best.ptr) and usable(chunk, stream, cache):
                    best, best_owner = chunk, owner
        if best is None:
            return None
        parked = per[best_owner]
        parked.remove(best)
        if not parked and best_owner is not None:
            del per[best_owner]  # streams come and go: no empty lists for them
        return best

    def find(self, rounded: int, stream: SyncStream | None) -> Chunk | None:
        """The core's best-fitting chunk that ``stream`` may use, or None.

        Under ``SAME_AS_REQUESTED``, when that chunk came from a wholly free region at
        most twice the request that would leave at least max(1 MiB, 1/8 of the request)
        unused, the region is given back and replaced by one of the request's size:
        reserved memory only goes down, and the region is not kept half dead.
        """
        if self.tagged:
            cache: dict[int, bool] = {}
            chunk = self.core.alloc(rounded, stream, lambda c: usable(c, stream, cache))
        else:  # no stream has allocated yet: every free chunk is untagged
            chunk = self.core.alloc(rounded)
        if chunk is not None and self.exact and chunk.prev is None:
            size = chunk.region.size
            rest = chunk.next
            if (
                size - rounded >= max(_RESIZE_MIN, rounded >> 3)
                and size <= 2 * rounded
                and (rest is None or (not rest.in_use and rest.next is None))
                and chunk.tag is None  # nobody may still use it: it can go back to the base
            ):
                return self._resize_region(chunk, rounded)
        return chunk

    def _resize_region(self, chunk: Chunk, rounded: int) -> Chunk | None:
        region = chunk.region
        self.core.free(chunk)
        self.core.remove_region(region)
        self.shrinkages += 1
        free_handles([region])
        try:
            self.new_region(rounded, dedicated=False)
        except DeviceError:
            return None  # the caller extends (or reports the failure) as for any miss
        return self.core.alloc(rounded)  # the new region fits it exactly

    def grow_and_find(
        self, nbytes: int, rounded: int, stream: SyncStream | None, in_use: int
    ) -> Chunk:
        """A chunk after freeing parked chunks, untagging passed ones, and else extending.

        Raises:
            DeviceError: out of memory (``in_use`` goes in the message).
        """
        if self.fast and self.flush_run(rounded):
            chunk = self.find(rounded, stream)
            if chunk is not None:
                return chunk
        flushed = self.flush()
        if self.reset_passed_streams() or flushed:
            chunk = self.find(rounded, stream)
            if chunk is not None:
                return chunk
        # Wholly free regions did not fit the request (regions never coalesce with each
        # other): give them back before extending, so the new region does not add to them.
        if self.returns.polled:
            self.returns.give_back_polled()
        gone = self.take_free_regions()
        if gone:
            self.shrinkages += len(gone)
            free_handles(gone)
        self.extend(nbytes, rounded, in_use)
        chunk = self.find(rounded, stream)
        if chunk is None:  # pragma: no cover - a fresh region always fits
            raise DeviceError(f"arena {self.name!r}: no chunk after extending")
        return chunk

    def extend(self, nbytes: int, rounded: int, in_use: int) -> None:
        """Add a region that fits ``rounded`` bytes, under the limit."""
        available = (self.limit - self.core.reserved) // self.unit * self.unit
        if rounded > available:
            why = f"only {available} bytes are left under the limit"
            raise self.oom(nbytes, rounded, why, in_use)
        size = self.sizer.size_for(rounded, available, self.core.reserved - self.core.in_use)
        while True:
            try:
                self.new_region(size, dedicated=False)
                return
            except DeviceError as exc:
                smaller = self.core.round(int(size * _BACKPEDAL))
                if smaller < rounded or smaller < 8192 or smaller >= size:
                    why = f"the base allocator failed: {exc}"
                    raise self.oom(nbytes, rounded, why, in_use) from exc
                size = smaller

    def new_region(self, size: int, *, dedicated: bool) -> Region:
        """A region of ``size`` bytes from the base allocator, added to the core.

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
        region = self.core.add_region(buffer.ptr, size, buffer, dedicated=dedicated)
        if self.core.reserved > self.max_reserved:
            self.max_reserved = self.core.reserved
        if not dedicated:
            self.sizer.extensions += 1
        return region

    def oom(self, nbytes: int, rounded: int, why: str, in_use: int) -> DeviceError:
        """The out-of-memory error for a request, naming the limit and the bytes in use."""
        limit = "no limit" if self.limit == SIZE_MAX else f"limit {self.limit} bytes"
        return DeviceError(
            f"arena {self.name!r}: out of memory allocating {nbytes} bytes "
            f"(rounded to {rounded}): {why}; {limit}, {in_use} bytes in use, "
            f"{self.core.reserved} reserved, largest free block {self.core.largest_free()} bytes"
        )

    # -- giving back -------------------------------------------------------------------------
    def put_back(self, chunk: Chunk, *, closed: bool) -> Region | None:
        """Take back a chunk whose buffer was freed: park it, or free it in the core.

        Returns a region that is now wholly free and that no stream uses, removed from
        the core, for the caller to give back (outside its lock).
        """
        stream: SyncStream | None = chunk.tag  # type: ignore[assignment]
        if stream is not None:
            # The point in the stream's order after the work that used this chunk.
            chunk.mark = stream._sync_id
            if idle(stream):
                chunk.tag = stream = None  # that work is done: anyone may take it
        region = chunk.region
        if not region.dedicated and not closed:
            if chunk.cls > PARK_MAX or not self.park(chunk, stream):
                self.core.free(chunk, chunk.tag, chunk.mark)
            return None  # the region stays, free or not, until pressure or shrink()
        merged = self.core.free(chunk, chunk.tag, chunk.mark)
        if not region.wholly_free:
            return None
        if merged.tag is None:
            self.core.remove_region(region)
            return region
        self.returns.watch.append(region)  # freed while its stream may still use it
        return None

    def park(self, chunk: Chunk, tag: SyncStream | None) -> bool:
        """Park a freed chunk in its class's list for ``tag``; False when that list is full."""
        per = self.fast.get(chunk.cls)
        if per is None:
            self.fast[chunk.cls] = {tag: [chunk]}
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
        largest free one; the other parked chunks stay for their sizes.
        """
        parked = {id(c) for per in self.fast.values() for c in per.get(None, ())}
        if not parked:
            return False
        best: list[Chunk] = []
        best_size = 0
        for region in self.core.regions:
            if region.dedicated:
                continue
            run: list[Chunk] = []
            size = 0
            c: Chunk | None = region.head
            while True:
                if c is not None and c.tag is None and (not c.in_use or id(c) in parked):
                    run.append(c)
                    size += c.size
                else:
                    if size >= rounded and (not best or size < best_size):
                        best, best_size = run, size
                    if c is None:
                        break
                    run, size = [], 0
                c = c.next
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
        to_free = [c for c in best[lo : hi + 1] if c.in_use]
        for chunk in to_free:
            self.fast[chunk.cls][None].remove(chunk)
            self.core.free(chunk, None, chunk.mark)
        return bool(to_free)

    def flush(self) -> int:
        """Free every parked chunk in the core, where it merges; returns how many."""
        fast = self.fast
        if not fast:
            return 0
        parked = [c for per in fast.values() for chunks in per.values() for c in chunks]
        fast.clear()
        free = self.core.free
        for chunk in parked:
            free(chunk, chunk.tag, chunk.mark)
        return len(parked)

    def reset_passed_streams(self) -> int:
        """Untag free chunks whose stream has passed their point; returns how many."""
        self.flush()
        cache: dict[int, bool] = {}
        passed = [
            chunk
            for chunk in self.core.free_chunks()
            if chunk.tag is not None and usable(chunk, None, cache)
        ]
        for chunk in passed:
            # An earlier one in this loop may have merged this chunk into a neighbour.
            self.core.retag(chunk)
        return len(passed)

    def release_stream(self, stream: SyncStream) -> None:
        """Untag every free chunk of ``stream`` (ORT's ``ReleaseStreamBuffers``)."""
        self.flush()
        for chunk in self.core.free_chunks():
            if chunk.tag is stream:
                self.core.retag(chunk)

    def take_free_regions(self) -> list[Region]:
        """Remove wholly free regions that no stream may still use from the core."""
        self.flush()
        gone = [r for r in self.core.free_regions() if not r.dedicated]
        for region in gone:
            self.core.remove_region(region)
        return gone
