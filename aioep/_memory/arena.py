"""A stream-aware best-fit-with-coalescing (BFC) arena over any allocator (ORT's
``BFCArena`` / ``StreamAwareArena``).

Layers: the BFC core (``bfc``: bins, chunks, regions, split and merge, no streams or
locks), the stream-aware pools (``arena_pool``: the stream rule, parked chunks, a
core for small requests and one for large ones, growth), region sizing and give-back
(``arena_regions``), and locking, buffers and statistics here. The arena reserves
large regions from a base allocator and the cores carve them into chunks.

Stream rule (ORT's, made a little stricter): a chunk freed by a buffer that was
allocated on stream A remembers A and A's sync id at the time of the free (the
core's tag and mark). A request on stream B may take it when B is A, when B has
since waited on a notification that A recorded after the free
(``B.wait(A.record())``), or when A has completed all its work up to that point (A
is idle or closed, or A's last recorded notification after the free is done).
Otherwise the arena uses another chunk or extends.
"""

from __future__ import annotations

import dataclasses
import threading

from .._base.errors import ClosedError, InvalidArgument
from .._base.types import AllocatorType
from .._streams.stream import SyncStream
from .._tensors.tensor import Buffer
from .allocator import Allocator, check_nbytes, check_stream
from .arena_config import SIZE_MAX, ArenaConfig, ArenaExtendStrategy
from .arena_pool import MAX_PARKED, PARK_MAX, StreamPool
from .arena_regions import RegionReturns, free_handles
from .bfc import MIN_ALLOCATION_SIZE, Chunk, Region

__all__ = ["SIZE_MAX", "ArenaAllocator", "ArenaConfig", "ArenaExtendStrategy"]

# Size classes: above 16 units (4 KiB for 256-byte units) a request rounds up to one of
# 8 classes per power of two (at most 12.5% more), so freed chunks of nearby sizes are
# interchangeable and a recurring size is a dict lookup (PyTorch's roundup_power2_divisions).
_CLASS_BITS = 3
_CLASS_SHIFT = _CLASS_BITS + 1
# Above the fast path's sizes (PARK_MAX) classes are finer, 64 per power of two (at most
# 1.6% more): big chunks are not parked, so coarse classes would only waste memory.
_FINE_SHIFT = 6 + 1

_PIN_LOCK = threading.Lock()  # guards the pin counts of arena buffers (held for an increment)
_new_buffer = object.__new__


class _ArenaBuffer(Buffer):
    """An arena buffer: its release (``free()`` or the last reference going) hands the
    chunk back to the arena.

    ``_chunk`` is the arena chunk until the arena takes it back; the arena clears it
    under its lock, so a chunk comes back exactly once however often (and from however
    many threads) the buffer is released. Each arena makes subclasses with its
    ``memory_info`` and ``allocator`` (and, for host requests, ``stream``); what is the
    same for every arena buffer is a class attribute here, so creating one sets five
    slots (six with a stream).
    """

    __slots__ = ("_chunk",)
    _chunk: Chunk | None
    allocator: ArenaAllocator
    readonly = False
    _pin_lock = _PIN_LOCK
    _on_release = None

    @property
    def _owner(self) -> object:  # type: ignore[override]
        # Views of host memory hold the region's backing object, so reading a freed
        # buffer through a view never touches unmapped memory.
        chunk = self._chunk
        return None if chunk is None else chunk.region.handle._owner  # type: ignore[attr-defined]

    def _release(self) -> None:
        """The arena buffers' release path (see ``Buffer._release``): the buffer joins the
        arena's returned list, whose chunks the arena's next locked call takes back
        (``ArenaAllocator._drain``). Appending to a list needs no lock, so a release never
        waits for the arena, and a release that runs inside the arena's own locked code
        (garbage collection calling ``__del__``) changes nothing under it. Memory that
        must go back to the base at once (a reserved region, a closing arena) is taken
        back now where the lock is free."""
        if self._released:
            return
        self._released = True
        chunk = self._chunk
        if chunk is None:
            return
        stream = chunk.tag
        if stream is not None:
            # The point in the stream's order after the work that used this chunk.
            chunk.mark = stream._sync_id  # type: ignore[attr-defined]
        arena = self.allocator
        arena._returned.append(self)
        if chunk.cls < 0 or not arena._lazy:
            arena._settle()


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
        self._origin = base._origin  # an arena's memory belongs to whoever owns its base
        self._limit = config.limit
        self._unit = unit = max(MIN_ALLOCATION_SIZE, base.memory_info.alignment)
        self._returns = RegionReturns(lock, self._after_give_back)
        self._pool = pool = StreamPool(base, config, unit, self._returns)
        self._parked = pool.parked  # the hot paths read the parked chunks directly
        self._stream_parked = pool.stream_parked
        # Buffers of this arena: memory info and allocator (and a host request's stream)
        # are class attributes, so a buffer is five stores.
        attrs = {"__slots__": (), "memory_info": self.memory_info, "allocator": self}
        self._buffer_class: type[_ArenaBuffer] = type("_ArenaBuffer", (_ArenaBuffer,), attrs)
        self._host_buffer_class: type[_ArenaBuffer] = type(
            "_ArenaBuffer", (self._buffer_class,), {"__slots__": (), "stream": None}
        )
        # Size classes need a power-of-two unit; otherwise every size is its own class.
        self._class_from = unit << (_CLASS_BITS + 1) if unit & (unit - 1) == 0 else SIZE_MAX
        # Released buffers whose chunks the next locked call takes back (appended without
        # the lock: see _ArenaBuffer._release), and the work such a call leaves for after
        # the lock (regions to give back).
        self._returned: list[_ArenaBuffer] = []
        self._gone: list[Region] = []
        self._after = False  # work for _finish: regions to give back, a prompt release
        self._lazy = True  # open and not retired: a released chunk may wait for the next call
        self._section = False  # locked code that may run anything (so a release re-enters)
        self._in_use = 0  # bytes of chunks handed out (rounded), as ORT's InUse
        self._max_in_use = 0
        self._num_reserves = 0
        self._max_alloc_size = 0

    # -- public API --------------------------------------------------------------------------
    def alloc(self, nbytes: int, *, stream: SyncStream | None = None) -> Buffer:
        """Allocate ``nbytes`` for work on ``stream`` (see the module docstring for reuse).

        Raises:
            DeviceError: the limit or the base allocator leaves no room; the message
                names the request, the limit and the bytes in use.
        """
        if type(nbytes) is not int or nbytes <= 0 or not self._lazy:
            # Off the hot path (a plain int > 0 on an open arena): check each argument once.
            check_stream("arena", self.memory_info.name, stream)
            check_nbytes("arena", self.memory_info.name, nbytes)
            if self._closed or self._retired:
                raise ClosedError(f"arena {self.memory_info.name!r} is closed")
            nbytes = int(nbytes)
            if nbytes == 0:
                return super().alloc(0, stream=stream)  # a null buffer, as the base class gives
        elif stream is not None and not isinstance(stream, SyncStream):
            check_stream("arena", self.memory_info.name, stream)
        # The size class (see _size_class), inlined, as this is the hot path.
        if nbytes > self._class_from:
            bits = (nbytes - 1).bit_length()
            step = 1 << (bits - (_FINE_SHIFT if nbytes > PARK_MAX else _CLASS_SHIFT))
            rounded = (nbytes + step - 1) & -step
        else:
            unit = self._unit
            rounded = (nbytes + unit - 1) // unit * unit
        lock = self._lock
        lock.acquire()
        try:
            returned = self._returned
            if returned:
                last = returned[-1]
                held = last._chunk
                if (
                    held is not None
                    and held.cls == rounded
                    and stream is None
                    and held.tag is None
                    and len(returned) == 1
                    and not self._parked.get(rounded)
                    and rounded not in self._stream_parked
                ):
                    # The one buffer released since the last call holds this class and
                    # nothing else is parked for it: taking its chunk back and handing it
                    # out again (what _drain and the fast path below would do) is handing
                    # it over; its bytes stay in use.
                    returned.pop()
                    last._chunk = None
                    self._num_allocs += 1
                    self._bytes_in_use += nbytes - last.nbytes
                    chunk = held
                else:
                    self._drain()
                    chunk = self._chunk_for(nbytes, rounded, stream)
            else:
                chunk = self._chunk_for(nbytes, rounded, stream)
        finally:
            lock.release()
        if self._after:
            self._finish()
        buffer: _ArenaBuffer
        if stream is None:
            buffer = _new_buffer(self._host_buffer_class)  # its class says stream None
        else:
            buffer = _new_buffer(self._buffer_class)
            buffer.stream = stream
        buffer.ptr = chunk.ptr
        buffer.nbytes = nbytes
        buffer._pins = 0
        buffer._released = False
        buffer._chunk = chunk
        return buffer

    def _chunk_for(self, nbytes: int, rounded: int, stream: SyncStream | None) -> Chunk:
        """A chunk of class ``rounded`` for a request, counted (lock held): the fast path
        when parked chunks of this class are only on the request's own list (else the
        lowest usable address among them wins, off this path; the lowest is last)."""
        if stream is None:
            parked = self._parked.get(rounded)
            if parked and rounded not in self._stream_parked:
                chunk = parked.pop()
            else:
                chunk = self._take(nbytes, rounded, None)
        else:
            per = self._stream_parked.get(rounded)
            parked = per.get(stream) if per is not None and len(per) == 1 else None
            if parked and not self._parked.get(rounded):
                chunk = parked.pop()
                if not parked:  # streams come and go: no empty lists for them
                    del self._stream_parked[rounded]
            else:
                chunk = self._take(nbytes, rounded, stream)
        self._in_use = in_use = self._in_use + chunk.size
        if in_use > self._max_in_use:
            self._max_in_use = in_use
        self._live_buffers += 1
        self._num_allocs += 1
        self._bytes_in_use += nbytes
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
            self._num_reserves += 1
            self._in_use += chunk.size
            self._max_in_use = max(self._max_in_use, self._in_use)
            self._max_alloc_size = max(self._max_alloc_size, chunk.size)
            self._live_buffers += 1
            self._num_allocs += 1
            self._bytes_in_use += nbytes
        finally:
            self._end()
        buffer: _ArenaBuffer = _new_buffer(self._buffer_class)
        buffer.ptr = chunk.ptr
        buffer.nbytes = nbytes
        buffer.stream = stream
        buffer._pins = 0
        buffer._released = False
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
            return {
                "Limit": self._limit,
                "InUse": self._in_use,
                "TotalAllocated": self._pool.reserved,
                "MaxInUse": self._max_in_use,
                "NumAllocs": self._num_allocs,
                "NumReserves": self._num_reserves,
                "NumArenaExtensions": self._pool.sizer.extensions,
                "NumArenaShrinkages": self._pool.shrinkages,
                "MaxAllocSize": self._max_alloc_size,
                "LargestFreeBlock": self._pool.largest_free(),
                "LiveBuffers": self._live_buffers,
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
            return self._live_buffers
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
        self._lazy = False
        self._begin()
        try:
            self._retired = True
        finally:
            self._end()  # closes now when no buffer is live

    def close(self) -> None:
        """Stop handing out memory and give the regions back (see ``Allocator.close``)."""
        self._lazy = False
        super().close()

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
        """Take back the chunks of released buffers (lock held): park each, or free it in
        its core; regions that became wholly free wait in ``_gone`` for ``_finish``."""
        returned = self._returned
        section = self._section
        self._section = True
        try:
            while returned:
                buffer = returned.pop()
                chunk = buffer._chunk
                if chunk is None:
                    continue  # released twice (by two threads): taken back once
                buffer._chunk = None
                self._in_use -= chunk.size
                self._live_buffers -= 1
                self._bytes_in_use -= buffer.nbytes
                if chunk.tag is None and self._lazy:
                    # The common cases inline: a parked class's list with room (kept
                    # highest address first), or a large chunk back to its core.
                    cls = chunk.cls
                    if cls > 0:
                        parked = self._parked.get(cls)
                        if (
                            parked is not None
                            and len(parked) < MAX_PARKED
                            and (not parked or parked[-1].ptr > chunk.ptr)
                        ):
                            parked.append(chunk)
                            continue
                    elif cls == 0:
                        chunk.region.core.free(chunk, None, chunk.mark)  # type: ignore[union-attr]
                        continue
                gone = self._pool.put_back(chunk, closed=self._closed)
                if gone is not None:
                    self._gone.append(gone)
                self._after = True  # a region to give back or to watch, maybe
        finally:
            self._section = section

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
        close_now = self._retired and self._live_buffers == 0 and not self._closed
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
    def _size_class(self, nbytes: int) -> int:
        """The chunk size a request of ``nbytes`` (> 0) gets (as `alloc` inlines it)."""
        if nbytes > self._class_from:
            bits = (nbytes - 1).bit_length()
            step = 1 << (bits - (_FINE_SHIFT if nbytes > PARK_MAX else _CLASS_SHIFT))
            return (nbytes + step - 1) & -step
        unit = self._unit
        return (nbytes + unit - 1) // unit * unit

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
            f"reserved={self._pool.reserved} live={self._live_buffers}>"
        )
