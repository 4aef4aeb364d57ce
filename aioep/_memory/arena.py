"""A stream-aware best-fit-with-coalescing (BFC) arena over any allocator (ORT's
``BFCArena`` / ``StreamAwareArena``).

Layers: the BFC core (``bfc``: bins, chunks, regions, split and merge, no streams or
locks), the stream-aware pools (``arena_pool``: a core for small requests and one for
large ones, growth; ``arena_parking``: the stream rule, parked and cached chunks), region sizing and give-back
(``arena_regions``), size classes (``arena_sizes``), the buffers and their lock-free
release (``arena_buffer``), and locking and statistics here. The arena reserves
large regions from a base allocator and the cores carve them into chunks.

Stream rule (ORT's, made a little stricter): a chunk freed by a buffer that was
allocated on stream A remembers A and A's sync id at the time of the free (the
core's tag and mark). A request on stream B may take it when B is A, when B has
since waited on a notification that A recorded after the free
(``B.wait(A.record())``), or when A has completed all its work up to that point (A
is idle or closed, or A's last recorded notification after the free is done).
Otherwise the arena uses another chunk or extends.

Threads. The arena's lock guards the pools. Two paths skip it: a request with no
stream that finds a freed chunk waiting for it (a *hit*: its size class's list of
small chunks, or a cached large chunk that fits, see ``StreamPool.take_cached``)
takes it, and the release of a chunk that has such a list (its ``home``) puts it
back there. Each list operation is one C call (``pop``, ``append``, ``remove``,
``bisect.insort`` with a C key), which no other thread interleaves with under the
GIL. The hit's bookkeeping (``_in_use``, ``_max_in_use``, ``_bytes_in_use``) is a
few read-modify-writes of ints with no call in between, which a thread switch cannot
split under the GIL either (CPython 3.10 to 3.13 switch threads only at calls and
jumps), and hits count themselves with ``next()`` on an ``itertools.count``. A
buffer's release claims its chunk by deleting the attribute: of two releases racing,
one deletes it and the other gets ``AttributeError``. A free-threaded interpreter
(``sys._is_gil_enabled()`` false) gives none of this: there the arena publishes no
lists for hits and claims chunks under a lock, so every request takes the locked
path (the lists still serve it, under the lock).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading

from .._base.errors import ClosedError, InvalidArgument
from .._base.types import AllocatorType
from .._plugin.allocator import (
    Allocator,
    allocator_origin,
    check_nbytes,
    check_stream,
    set_origin,
)
from .._plugin.buffer import Buffer, new_buffer
from .._plugin.stream import SyncStream
from .arena_buffer import _LOCK_FREE, _ArenaBuffer, _release_locked
from .arena_config import SIZE_MAX, ArenaConfig, ArenaExtendStrategy
from .arena_parking import PARK_MAX
from .arena_pool import StreamPool
from .arena_regions import RegionReturns, free_handles
from .arena_sizes import _FINE_SHIFT, _NO_TABLE, _TABLE_SHIFT, SizeClasses
from .bfc import MIN_ALLOCATION_SIZE, Chunk, Region

__all__ = ["SIZE_MAX", "ArenaAllocator", "ArenaConfig", "ArenaExtendStrategy"]


def _no_chunk(rounded: int) -> Chunk | None:
    """``StreamPool.take_cached`` where hits are off."""
    return None


class ArenaAllocator(Allocator):
    """A stream-aware BFC arena over ``base`` (ORT's ``StreamAwareArena``).

    Its memory info is the base's with ``allocator_type=ARENA``. Thread-safe;
    buffers may be freed from any thread. Closing it (or retiring it and freeing
    the last buffer) returns its regions to the base and retires the base.

    Args:
        base: the device allocator regions come from (host, sim, CUDA ...).
        config: sizes, growth strategy and limit; the defaults are ORT's.
    """

    def __init__(self, base: Allocator, config: ArenaConfig | None = None) -> None:
        if not isinstance(base, Allocator):
            raise InvalidArgument(f"ArenaAllocator needs an aioep.Allocator as base, got {base!r}")
        if config is None:
            config = ArenaConfig()
        elif not isinstance(config, ArenaConfig):
            raise InvalidArgument(f"ArenaAllocator: config must be an ArenaConfig, got {config!r}")
        super().__init__(dataclasses.replace(base.memory_info, allocator_type=AllocatorType.ARENA))
        self._lock = lock = threading.RLock()  # type: ignore[assignment]
        self.base = base
        self.config = config
        # An arena's memory belongs to whoever owns its base.
        set_origin(self, allocator_origin(base))
        self._limit = config.limit
        self._unit = unit = max(MIN_ALLOCATION_SIZE, base.memory_info.alignment)
        self._sizes = sizes = SizeClasses(unit)
        self._size_class = sizes.of  # the chunk size a request gets (as alloc inlines it)
        self._returns = RegionReturns(lock, self._after_give_back)
        self._pool = pool = StreamPool(base, config, unit, self._returns)
        self._homes = pool.parked  # size class -> its list of freed host chunks (kept)
        self._stream_parked = pool.stream_parked
        # Where hits look (while the arena is open, and has the GIL): the lists of freed
        # small chunks by request size (entry i for sizes (i << 8, (i + 1) << 8], all of one
        # size class), and the cached large chunks.
        self._table: list[list[Chunk] | None] | tuple[None, ...] = _NO_TABLE
        self._take_cached = _no_chunk
        # Buffers of this arena: memory info and allocator (and a host request's stream)
        # are class attributes, so a buffer is five stores.
        attrs: dict[str, object] = {
            "__slots__": (),
            "memory_info": self.memory_info,
            "allocator": self,
        }
        if not _LOCK_FREE:
            attrs["_release"] = _release_locked
        self._buffer_class: type[_ArenaBuffer] = type("_ArenaBuffer", (_ArenaBuffer,), attrs)
        self._host_buffer_class: type[_ArenaBuffer] = type(
            "_ArenaBuffer", (self._buffer_class,), {"__slots__": (), "stream": None}
        )
        self._class_from = sizes.class_from
        # Released chunks that the next locked call takes back (appended without the
        # lock: see _ArenaBuffer._release), and the work such a call leaves for after the
        # lock (regions to give back).
        self._returned: list[Chunk] = []
        self._gone: list[Region] = []
        self._after = False  # work for _finish: regions to give back, a prompt release
        self._lazy = True  # open and not retired: a released chunk may wait for the next call
        self._section = False  # locked code that may run anything (so a release re-enters)
        # Statistics. Bytes of chunks handed out (rounded, as ORT's InUse) and requested
        # change on every request and release, hits included (see the module docstring);
        # hits count themselves, and the live buffers are derived (see _live_chunks): the
        # base class's _live_buffers and _num_allocs count null buffers and locked requests.
        self._in_use = 0
        self._max_in_use = 0
        self._hits = itertools.count()  # next() per hit: a count no thread switch splits
        self._hits_read = 0  # next() calls that only read the count
        self._num_reserves = 0
        self._max_alloc_size = 0
        if _LOCK_FREE:
            self._table = sizes.table(self._homes)
            if pool.cache_large:
                self._take_cached = pool.take_cached

    # -- public API --------------------------------------------------------------------------
    def alloc(self, nbytes: int, *, stream: SyncStream | None = None) -> Buffer:
        """Allocate ``nbytes`` for work on ``stream`` (see the module docstring for reuse).

        Raises:
            DeviceError: the limit or the base allocator leaves no room; the message
                names the request, the limit and the bytes in use.
        """
        if stream is None and type(nbytes) is int:
            # The hit path: a freed chunk of the request's size class waits in its list.
            if nbytes <= PARK_MAX:
                chunk = None
                if nbytes > 0 and (home := self._table[(nbytes - 1) >> _TABLE_SHIFT]):
                    try:
                        chunk = home.pop(0)  # the lowest address
                    except IndexError:  # another thread took the last one
                        pass
            else:
                step = 1 << ((nbytes - 1).bit_length() - _FINE_SHIFT)
                chunk = self._take_cached((nbytes + step - 1) & -step)
            if chunk is not None:
                next(self._hits)
                self._in_use = in_use = self._in_use + chunk.size
                if in_use > self._max_in_use:
                    self._max_in_use = in_use
                # Requested bytes: this request's, less those of the buffer that last
                # held the chunk (its release left them to here).
                self._bytes_in_use += nbytes - chunk.req
                chunk.req = nbytes
                buffer = new_buffer(self._host_buffer_class, chunk.ptr, nbytes)
                buffer._chunk = chunk
                return buffer
        return self._alloc(nbytes, stream)

    def _alloc(self, nbytes: int, stream: SyncStream | None) -> Buffer:
        """``alloc`` past the hit path: checks the arguments, then takes a chunk under the
        lock."""
        if type(nbytes) is not int or nbytes <= 0 or not self._lazy:
            check_stream("arena", self.memory_info.name, stream)
            check_nbytes("arena", self.memory_info.name, nbytes)
            if self._closed or self._retired:
                raise ClosedError(f"arena {self.memory_info.name!r} is closed")
            nbytes = int(nbytes)
            if nbytes == 0:
                return super().alloc(0, stream=stream)  # a null buffer, as the base class gives
        elif stream is not None and not isinstance(stream, SyncStream):
            check_stream("arena", self.memory_info.name, stream)
        rounded = self._size_class(nbytes)
        lock = self._lock
        lock.acquire()
        try:
            if self._returned:
                self._drain()
            chunk = self._chunk_for(nbytes, rounded, stream)
        finally:
            lock.release()
        if self._after:
            self._finish()
        if stream is None:
            buffer = new_buffer(self._host_buffer_class, chunk.ptr, nbytes)  # stream None
        else:
            buffer = new_buffer(self._buffer_class, chunk.ptr, nbytes)
            buffer.stream = stream
        buffer._chunk = chunk
        return buffer

    def _chunk_for(self, nbytes: int, rounded: int, stream: SyncStream | None) -> Chunk:
        """A chunk of class ``rounded`` for a request, counted (lock held): its class's
        freed chunk when parked chunks of this class are only on the request's own list
        (else the lowest usable address among them wins, off this path)."""
        if stream is None:
            chunk = None
            if rounded > PARK_MAX:
                chunk = self._pool.take_cached(rounded)
            else:
                home = self._homes.get(rounded)
                if home:
                    try:
                        chunk = home.pop(0)
                    except IndexError:
                        chunk = None
            if chunk is None:
                chunk = self._take(nbytes, rounded, None)
            if chunk.cls > 0:
                # A small chunk of the small pool: freed, it goes back to its class's list
                # without the lock, and hits take it from there.
                home = self._homes.get(chunk.cls)
                if home is None:
                    home = self._homes[chunk.cls] = []
                chunk.home = home
            elif chunk.size > PARK_MAX and self._pool.cache_large and not chunk.region.dedicated:
                # A large chunk: freed, it is cached as it is, by octave (see take_cached).
                chunk.home = self._pool.cached[chunk.size.bit_length()]
            else:
                chunk.home = None
        else:
            per = self._stream_parked.get(rounded)
            parked = per.get(stream) if per is not None and len(per) == 1 else None
            if parked and not self._homes.get(rounded):
                chunk = parked.pop()
                if not parked:  # streams come and go: no empty lists for them
                    del self._stream_parked[rounded]
            else:
                chunk = self._take(nbytes, rounded, stream)
            chunk.home = None
        self._bytes_in_use += nbytes - chunk.req  # (see alloc)
        chunk.req = nbytes
        chunk.key = chunk.size << 64 | chunk.ptr
        self._in_use = in_use = self._in_use + chunk.size
        if in_use > self._max_in_use:
            self._max_in_use = in_use
        self._num_allocs += 1
        return chunk

    def _take(self, nbytes: int, rounded: int, stream: SyncStream | None) -> Chunk:
        """A chunk when the request's parked list is empty (lock held)."""
        self._section = True
        try:
            chunk = self._pool.take(nbytes, rounded, stream, self._in_use)
            chunk.tag = stream
            if chunk.size > self._max_alloc_size:
                self._max_alloc_size = chunk.size
        finally:
            self._section = False
        return chunk

    def reserve(self, nbytes: int, *, stream: SyncStream | None = None) -> Buffer:
        """Allocate a dedicated region of ``nbytes`` straight from the base (ORT's ``Reserve``).

        The memory is outside the pool: it is never split or handed to another
        request, and it goes back to the base when the buffer is freed.
        """
        check_nbytes("arena", self.memory_info.name, nbytes)
        check_stream("arena", self.memory_info.name, stream)
        if self._closed or self._retired:
            raise ClosedError(f"arena {self.memory_info.name!r} is closed")
        if nbytes == 0:
            return super().alloc(0, stream=stream)
        self._begin()
        try:
            if nbytes > self._limit - self._pool.reserved:
                why = "the reservation would pass the limit"
                raise self._pool.oom(nbytes, nbytes, why, self._in_use)
            chunk = self._pool.new_region(nbytes, dedicated=True).head
            chunk.tag = stream
            chunk.cls = -1  # never parked, and given back at once when released
            chunk.home = None
            chunk.req = nbytes
            chunk.key = chunk.size << 64 | chunk.ptr
            self._num_reserves += 1
            self._in_use += chunk.size
            self._max_in_use = max(self._max_in_use, self._in_use)
            self._max_alloc_size = max(self._max_alloc_size, chunk.size)
            self._num_allocs += 1
            self._bytes_in_use += nbytes
        finally:
            self._end()
        buffer = new_buffer(self._buffer_class, chunk.ptr, nbytes)
        buffer.stream = stream
        buffer._chunk = chunk
        return buffer

    def shrink(self) -> int:
        """Return every wholly free region to the base allocator; returns the bytes freed.

        A region whose memory a stream may still be using (freed on a stream that
        has not passed that point) is kept.
        """
        self._begin()
        try:
            self._pool.flush()
            self._pool.reset_passed_streams()
            gone = self._pool.take_free_regions()
            self._pool.shrinkages += len(gone)
        finally:
            self._end()
        freed = free_handles(gone)
        if self._returns.polled:
            freed += self._returns.give_back_polled()
        return freed

    def release_stream_buffers(self, stream: SyncStream) -> None:
        """Forget ``stream`` on its free chunks so any stream can take them (ORT's
        ``ReleaseStreamBuffers``); call it once the stream's work is complete."""
        self._begin()
        try:
            self._pool.release_stream(stream)
        finally:
            self._end()

    def stats(self) -> dict[str, int]:
        """ORT's arena statistics (``Limit``, ``InUse``, ``TotalAllocated``, ``MaxInUse``,
        ``NumAllocs``, ``NumReserves``, ``NumArenaExtensions``, ``NumArenaShrinkages``,
        ``MaxAllocSize``, ``LargestFreeBlock``) plus ``LiveBuffers``, ``InUseRequested``
        and ``MaxTotalAllocated``. Sizes are bytes; in-use sizes are rounded chunk sizes."""
        self._begin()
        try:
            self._pool.flush()
            self._bytes_in_use -= self._pool.parking.dropped_req
            self._pool.parking.dropped_req = 0
            return {
                "Limit": self._limit,
                "InUse": self._in_use,
                "TotalAllocated": self._pool.reserved,
                "MaxInUse": self._max_in_use,
                "NumAllocs": self._num_allocs + self._hit_count(),
                "NumReserves": self._num_reserves,
                "NumArenaExtensions": self._pool.sizer.extensions,
                "NumArenaShrinkages": self._pool.shrinkages,
                "MaxAllocSize": self._max_alloc_size,
                "LargestFreeBlock": self._pool.largest_free(),
                "LiveBuffers": self._live_buffers + self._live_chunks(),
                "InUseRequested": self._bytes_in_use,
                "MaxTotalAllocated": self._pool.max_reserved,
            }
        finally:
            self._end()

    @property
    def live_buffers(self) -> int:
        """Buffers handed out and not yet released."""
        self._begin()
        try:
            return self._live_buffers + self._live_chunks()
        finally:
            self._end()

    def chunks(self) -> list[tuple[int, int, bool, SyncStream | None]]:
        """Every chunk as ``(ptr, size, in_use, stream)`` in address order (for tests and
        debugging)."""
        self._begin()
        try:
            self._pool.flush()
            return [(c.ptr, c.size, c.in_use, c.tag) for c in self._pool.walk()]  # type: ignore[misc]
        finally:
            self._end()

    def regions(self) -> list[tuple[int, int]]:
        """Every region as ``(ptr, size)`` in address order."""
        self._begin()
        try:
            return sorted((r.ptr, r.size) for r in self._pool.regions())
        finally:
            self._end()

    def retire(self) -> None:
        """Stop handing out memory and close once the last live buffer is released."""
        self._begin()
        try:
            self._retired = True
            self._stop_hits()
        finally:
            self._end()  # closes now when no buffer is live

    def close(self) -> None:
        """Stop handing out memory and give the regions back (see ``Allocator.close``)."""
        with self._lock:
            self._stop_hits()
        super().close()

    def _stop_hits(self) -> None:
        """No more hits, and releases take the locked way (lock held): the order matters
        to a release racing with it (see ``_ArenaBuffer._release``)."""
        self._lazy = False
        self._table = _NO_TABLE
        self._take_cached = _no_chunk

    # -- the Allocator hooks (unused: alloc and the buffer's release do the work) -------------
    def _allocate(self, nbytes: int, stream: SyncStream | None) -> int:  # pragma: no cover
        raise NotImplementedError

    def _free(self, ptr: int, nbytes: int, stream: SyncStream | None) -> None:
        pass  # only zero-byte buffers come through the base class, and they hold no memory

    def _close(self) -> None:
        self._begin()
        try:
            self._pool.flush()
            self._pool.reset_passed_streams()
            gone = self._pool.take_free_regions()
            pending = [r for r in self._pool.regions() if r.wholly_free]
        finally:
            self._end()
        free_handles(gone)
        # Wholly free regions that a stream may still be using go back once it passes them.
        self._returns.watch_all(pending, closed=True)
        self._maybe_retire_base()

    # -- taking chunks back ----------------------------------------------------------------------
    def _begin(self) -> None:
        """Enter a locked section that may run anything, with released chunks taken back."""
        self._lock.acquire()
        self._section = True
        if self._returned:
            self._drain()

    def _end(self) -> None:
        """Leave a section: take back what was released meanwhile, then (lock released)
        give back regions, watch the ones a stream may still use, and close if retired
        and no buffer is live."""
        work = None
        try:
            if self._returned:
                self._drain()
            work = self._collect()
        finally:
            self._section = False
            self._lock.release()
        if work is not None:
            self._follow_up(*work)

    def _drain(self) -> None:
        """Take back released chunks (lock held): park each, or free it in its core;
        regions that became wholly free wait in ``_gone`` for ``_finish``."""
        returned = self._returned
        section = self._section
        self._section = True
        try:
            while returned:
                try:
                    chunk = returned.pop()
                except IndexError:  # pragma: no cover - only this thread pops, under the lock
                    break
                if not _LOCK_FREE:  # the release could not count it (see _release_locked)
                    self._in_use -= chunk.size
                self._bytes_in_use -= chunk.req
                chunk.req = 0
                gone = self._pool.put_back(chunk, closed=self._closed)
                if gone is not None:
                    self._gone.append(gone)
                self._after = True  # a region to give back or to watch, maybe
        finally:
            self._section = section

    def _live_chunks(self) -> int:
        """Chunks handed out and not released (lock held, after a drain): the cores' chunks
        in use, less the parked ones and those released since."""
        pool = self._pool
        live = pool.small.chunks_in_use + pool.large.chunks_in_use - len(self._returned)
        for chunks in pool.parked.values():
            live -= len(chunks)
        for chunks in pool.cached:
            live -= len(chunks)
        for per in pool.stream_parked.values():
            for chunks in per.values():
                live -= len(chunks)
        return live

    def _hit_count(self) -> int:
        """Hits so far (lock held)."""
        count = next(self._hits) - self._hits_read
        self._hits_read += 1
        return count

    def _settle(self) -> None:
        """Take released chunks back now, where no locked code is running (a release that
        must not wait: a reserved region, a closing or retired arena). It never waits for
        the lock: when the lock is busy, its holder does this before it is done (see
        ``_finish``)."""
        lock = self._lock
        if not lock.acquire(blocking=False):
            self._after = True
            return
        if self._section:  # a release inside this thread's own section: it drains at its end
            self._after = True
            lock.release()
            return
        self._section = True
        work = None
        try:
            self._drain()
            work = self._collect()
        finally:
            self._section = False
            lock.release()
        if work is not None:
            self._follow_up(*work)

    def _finish(self) -> None:
        """After a call that left work behind (``_after``): see ``_follow_up``."""
        with self._lock:
            if self._section:
                return  # re-entered from this thread's own section: its end does this
            work = self._collect()
        self._follow_up(*work)

    def _collect(self) -> tuple[list[Region], list[Region], bool, bool, bool]:
        """The work for after the lock (lock held): regions to give back, regions to
        watch, whether to close now, whether closed, whether releases are waiting."""
        self._after = False
        gone, self._gone = self._gone, []
        watch = self._returns.take_watch() if self._returns.watch else []
        close_now = (
            self._retired and not self._closed and self._live_buffers + self._live_chunks() == 0
        )
        return gone, watch, close_now, self._closed, bool(self._returned)

    def _follow_up(
        self, gone: list[Region], watch: list[Region], close_now: bool, closed: bool, again: bool
    ) -> None:
        """Lock not held: give back the regions a section freed, watch the ones a stream
        may still use, close a retired arena with no live buffer, and take back what was
        released while the lock was busy."""
        if gone:
            free_handles(gone)
        if watch:
            self._returns.watch_all(watch, closed=closed)
        if close_now:
            self.close()
        elif closed and (gone or watch):
            self._maybe_retire_base()
        if again:
            self._settle()

    # -- internals ---------------------------------------------------------------------------
    def _after_give_back(self) -> None:
        if self._closed:
            self._maybe_retire_base()

    def _maybe_retire_base(self) -> None:
        with self._lock:
            done = not self._pool.regions()
        if done:
            self.base.retire()

    def __repr__(self) -> str:
        return (
            f"<ArenaAllocator {self.memory_info.name!r} in_use={self._in_use} "
            f"reserved={self._pool.reserved}>"
        )
