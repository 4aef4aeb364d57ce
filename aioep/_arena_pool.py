"""The arena's stream-aware pool: the stream rule, parked chunks and growth over the BFC
core (no locks: the arena calls it under its lock)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._arena_config import SIZE_MAX, ArenaConfig
from ._arena_regions import RegionReturns, RegionSizer, free_handles
from ._bfc import Chunk, Region
from ._errors import DeviceError, EpError

if TYPE_CHECKING:
    from ._allocator import Allocator
    from ._stream import SyncStream

__all__ = ["StreamPool", "idle", "usable"]

_BACKPEDAL = 0.9  # on a base-allocator failure, retry an extension this much smaller
MAX_PARKED = 64  # freed chunks parked before they go back to the core


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
    them, chunks parked by size class in front of it, and regions from ``base``.

    A chunk's ``tag`` is the stream it was allocated on while in use, and after the free
    the stream that may still use it (``None`` once that work is done); its ``mark`` is
    that stream's sync id at the free. Parked chunks are in use as far as the core knows.
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
        # Freed chunks parked by size class before they go back to the core, like
        # malloc's fast bins: an alloc/free cycle of one size then costs a list append
        # and pop. They go back before the arena would extend, and whenever a caller
        # looks at the chunks.
        self.quick: dict[int, list[Chunk]] = {}
        self.quick_count = 0
        self.max_reserved = 0
        self.shrinkages = 0

    # -- taking ------------------------------------------------------------------------------
    def take_parked(self, parked: list[Chunk], stream: SyncStream | None) -> Chunk | None:
        """The parked chunk of the lowest address ``stream`` may use (as best fit would
        pick), or None."""
        best = -1
        cache: dict[int, bool] = {}
        for i, chunk in enumerate(parked):
            owner = chunk.tag
            if (owner is None or owner is stream or usable(chunk, stream, cache)) and (
                best < 0 or chunk.ptr < parked[best].ptr
            ):
                best = i
        if best < 0:
            return None
        self.quick_count -= 1
        return parked.pop(best)

    def find(self, rounded: int, stream: SyncStream | None) -> Chunk | None:
        """The core's best-fitting chunk that ``stream`` may use, or None."""
        cache: dict[int, bool] = {}
        return self.core.alloc(rounded, stream, lambda chunk: usable(chunk, stream, cache))

    def grow_and_find(
        self, nbytes: int, rounded: int, stream: SyncStream | None, in_use: int
    ) -> Chunk:
        """A chunk after freeing parked chunks, untagging passed ones, and else extending.

        Raises:
            DeviceError: out of memory (``in_use`` goes in the message).
        """
        flushed = self.quick_count
        self.flush()
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
        size = self.sizer.size_for(rounded, available)
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
                chunk.tag = None  # that work is done: anyone may take it
        region = chunk.region
        if not region.dedicated and not closed:
            parked = self.quick.get(chunk.cls)
            if parked is None:
                self.quick[chunk.cls] = [chunk]
            else:
                parked.append(chunk)
            self.quick_count += 1
            if self.quick_count > MAX_PARKED:
                self.flush()
            return None
        merged = self.core.free(chunk, chunk.tag, chunk.mark)
        if not region.wholly_free:
            return None
        if merged.tag is None:
            self.core.remove_region(region)
            return region
        self.returns.watch.append(region)  # freed while its stream may still use it
        return None

    def flush(self) -> None:
        """Free every parked chunk in the core, where it merges."""
        if not self.quick_count:
            return
        parked = [c for chunks in self.quick.values() for c in chunks]
        self.quick.clear()
        self.quick_count = 0
        free = self.core.free
        for chunk in parked:
            free(chunk, chunk.tag, chunk.mark)

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
