"""The arena's regions: how big the next one is, and giving free ones back to the base
once no stream may still be using them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._plugin.notification import wait_blocking
from .arena_config import ArenaConfig, ArenaExtendStrategy
from .bfc import Region

if TYPE_CHECKING:
    from .._plugin.buffer import Buffer
    from .._plugin.notification import Notification

__all__ = ["RegionReturns", "RegionSizer"]


class RegionSizer:
    """The size of each new region under the extend strategy (ORT's ``BFCArena::Extend``),
    for each of the arena's pools.

    The arena's first region is ``initial_chunk_size_bytes`` and its second
    ``initial_growth_chunk_size_bytes``, then sizes double (ORT's sequence). Each pool
    doubles on its own: a pool that starts after the arena's first region starts at the
    growth size, so a large initial chunk is reserved once, not once per pool.
    """

    __slots__ = ("cap", "config", "extensions", "growth", "initial", "next_bytes", "unit")

    def __init__(self, config: ArenaConfig, unit: int, limit: int, pools: int = 2) -> None:
        self.config = config
        self.unit = unit
        self.cap = max(config.max_power_of_two_extend_bytes, unit)
        self.initial = self.round(min(limit, config.initial_chunk_size_bytes))
        self.growth = max(self.round(config.initial_growth_chunk_size_bytes), unit)
        self.next_bytes = [0] * pools  # per pool; 0 until the pool's first region
        self.extensions = 0  # regions added by extending (ORT's NumArenaExtensions)

    def round(self, nbytes: int) -> int:
        """``nbytes`` rounded up to the unit."""
        unit = self.unit
        return (nbytes + unit - 1) // unit * unit

    def size_for(self, pool: int, rounded: int, available: int, free: int = 0) -> int:
        """The next region's size for pool ``pool`` and a request of ``rounded`` bytes
        (``available`` > it is what the limit leaves, ``free`` the bytes free in the
        pool's regions), and the strategy's state moved on.

        Under ``NEXT_POWER_OF_TWO``, when the free bytes could hold the request but no
        free chunk does (fragmentation, not a lack of memory), the region is just the
        request: a doubled region would mostly sit idle.
        """
        if self.config.extend_strategy is ArenaExtendStrategy.SAME_AS_REQUESTED:
            return rounded
        size = self.next_bytes[pool]
        if size and free >= rounded:
            return rounded
        first_of_arena = False
        if not size:
            first_of_arena = not self.extensions
            size = self.initial if first_of_arena else self.growth
        grew = False
        while size < rounded:
            size *= 2
            grew = True
        if first_of_arena:
            following = self.growth
        elif grew:
            following = size
        else:
            following = size * 2
        self.next_bytes[pool] = max(min(following, self.cap), self.unit)
        return min(size, available)


class RegionReturns:
    """Wholly free regions whose stream may still use them, given back once it has passed.

    ``lock`` is the arena's: it guards the BFC cores and the lists here. ``given_back``
    is called (lock not held) after each region goes back.
    """

    __slots__ = ("given_back", "lock", "polled", "watch")

    def __init__(self, lock: threading.RLock, given_back: Callable[[], None]) -> None:
        self.lock = lock
        self.given_back = given_back
        self.watch: list[Region] = []  # to hand to watch_all once the lock is released
        # Regions whose stream's notifications cannot call back: checked on later calls.
        self.polled: list[tuple[Region, Notification]] = []

    def take_watch(self) -> list[Region]:
        """The regions queued for watching (lock held)."""
        watch, self.watch = self.watch, []
        return watch

    def watch_all(self, regions: list[Region], *, closed: bool) -> None:
        """Give each region back once its stream passes the work that used it (lock not held)."""
        for region in regions:
            self.release_when_stream_passes(region, closed=closed)

    def release_when_stream_passes(self, region: Region, *, closed: bool) -> None:
        """Give a free region back once its stream has passed the work that used it."""
        stream = region.head.tag
        if stream is None or stream.closed:  # type: ignore[attr-defined]
            self.give_back(region)
            return
        try:
            mark = stream.record()  # type: ignore[attr-defined]
        except Exception:
            self.give_back(region)  # the stream closed meanwhile: its work is done
            return
        if not mark.impl.add_done_callback(lambda: self.give_back(region)):
            # This backend's notifications cannot call back. Never block the freeing
            # thread (it may run the event loop): later arena calls check the mark. A
            # closed arena has no later calls: it waits (environments close off the loop).
            with self.lock:
                self.polled.append((region, mark))
            if closed:
                self.give_back_polled(wait=True)

    def give_back_polled(self, *, wait: bool = False) -> int:
        """Give back polled regions whose stream has passed them (all of them, waiting on
        the host, with ``wait``: only closing does that, off the loop in an environment).
        Returns the bytes given back."""
        freed = 0
        with self.lock:
            polled, self.polled = self.polled, []
            pending = []
            for region, mark in polled:
                if mark.done():
                    freed += self.give_back(region)
                else:
                    pending.append((region, mark))
            self.polled += pending
        for region, mark in pending if wait else ():
            wait_blocking(mark)  # blocking on purpose (closing): no event-loop warning
            with self.lock:
                if (region, mark) in self.polled:  # another thread may have taken it
                    self.polled.remove((region, mark))
            freed += self.give_back(region)
        return freed

    def give_back(self, region: Region) -> int:
        """Return a region to the base if it is still in its core and wholly free; its bytes."""
        with self.lock:
            core = region.core
            if core is None or not region.wholly_free:
                return 0
            core.remove_region(region)
        free_handles([region])
        self.given_back()
        return region.size


def free_handles(regions: list[Region]) -> int:
    """Free the base buffers of removed regions; returns their bytes."""
    freed = 0
    for region in regions:
        freed += region.size
        buffer: Buffer = region.handle  # type: ignore[assignment]
        buffer.free()
    return freed
