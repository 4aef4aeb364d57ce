"""A stream-aware best-fit-with-coalescing (BFC) arena over any allocator (ORT's
``BFCArena`` / ``StreamAwareArena``).

Three layers: the BFC core (``bfc``: bins, chunks, regions, split and merge, no
streams or locks), the stream rule and locking here, and region sizing and give-back
(``arena_regions``). The arena reserves large regions from a base allocator and the
core carves them into chunks.

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

from .._base.errors import ClosedError, InUseError, InvalidArgument
from .._base.types import AllocatorType
from .._streams.stream import SyncStream
from .._tensors.exports import free_deferred, request_free
from .._tensors.tensor import Buffer
from .allocator import Allocator, check_nbytes, check_stream
from .arena_config import SIZE_MAX, ArenaConfig, ArenaExtendStrategy
from .arena_pool import MAX_PARKED, PARK_MAX, StreamPool
from .arena_regions import RegionReturns, free_handles
from .bfc import MIN_ALLOCATION_SIZE, BfcCore, Chunk, Region

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
    """An arena buffer: released by ``__del__`` (no ``weakref.finalize``) or :meth:`free`.

    ``_chunk`` is the arena chunk while the buffer holds it; the arena clears it under
    its lock, so a buffer is released exactly once whichever way comes first. Each
    arena makes a subclass with its ``memory_info`` and ``allocator``; what is the
    same for every arena buffer is a class attribute here, so creating one sets five
    slots.
    """

    __slots__ = ("_chunk",)
    _chunk: Chunk | None
    readonly = False
    _pin_lock = _PIN_LOCK
    _finalizer = None

    @property
    def freed(self) -> bool:
        return self._chunk is None or free_deferred(self)

    @property
    def _owner(self) -> object:  # type: ignore[override]
        # Views of host memory hold the region's backing object, so reading a freed
        # buffer through a view never touches unmapped memory.
        chunk = self._chunk
        return None if chunk is None else chunk.region.handle._owner  # type: ignore[attr-defined]

    def free(self) -> None:
        # Reading _pins without the lock is safe: a concurrent _pin either comes first
        # (the count is seen) or after the release, as with Buffer's lock.
        if self._pins:
            raise InUseError(
                f"buffer {self.ptr:#x} ({self.nbytes} bytes on {self.memory_info.name}) is "
                f"used by {self._pins} operation(s) in flight; await them before freeing"
            )
        # While a DLPack export holds the memory, its release does the free (request_free).
        if self._chunk is not None and not request_free(self):
            self.allocator._release_buffer(self)  # type: ignore[union-attr]

    def __del__(self) -> None:
        if self._chunk is not None:
            try:
                self.allocator._release_buffer(self)  # type: ignore[union-attr]
            except Exception:  # pragma: no cover - nothing can be raised from a finalizer
                pass


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
        self._lock = lock = threading.RLock()  # type: ignore[assignment]  # see _busy
        self.base = base
        self.config = config
        self._origin = base._origin  # an arena's memory belongs to whoever owns its base
        self._limit = config.limit
        self._unit = unit = max(MIN_ALLOCATION_SIZE, base.memory_info.alignment)
        self._core = core = BfcCore(unit, config.max_dead_bytes_per_chunk)
        self._returns = RegionReturns(core, lock, self._after_give_back)
        self._pool = pool = StreamPool(base, config, unit, self._returns)
        self._fast = pool.fast  # the hot path reads the parked chunks directly
        # Buffers of this arena: memory info and allocator are class attributes (fewer
        # stores per buffer); _chunk ties a buffer to its chunk until it is released.
        self._buffer_class = type(
            "_ArenaBuffer",
            (_ArenaBuffer,),
            {"__slots__": (), "memory_info": self.memory_info, "allocator": self},
        )
        # Size classes need a power-of-two unit; otherwise every size is its own class.
        self._class_from = unit << (_CLASS_BITS + 1) if unit & (unit - 1) == 0 else SIZE_MAX
        # A finalizer can run a release on this thread while it is inside a locked section
        # (garbage collection); such a release is queued and done when the section ends.
        self._busy = False
        self._deferred: list[Chunk] = []
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
        if stream is not None and not isinstance(stream, SyncStream):
            check_stream("arena", self.memory_info.name, stream)
        if type(nbytes) is not int or nbytes <= 0:  # the hot path takes a plain int > 0
            check_nbytes("arena", self.memory_info.name, nbytes)
            nbytes = int(nbytes)
            if nbytes == 0:
                if self._closed or self._retired:
                    raise ClosedError(f"arena {self.memory_info.name!r} is closed")
                return super().alloc(0, stream=stream)  # a null buffer, as the base class gives
        if self._closed or self._retired:
            raise ClosedError(f"arena {self.memory_info.name!r} is closed")
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
        self._busy = True
        try:
            chunk = self._take_locked(nbytes, rounded, stream)
        finally:
            if self._deferred:
                self._end_section()
            self._busy = False
            lock.release()
        return self._buffer(chunk, nbytes, stream)

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
        with self._lock:
            self._busy = True
            try:
                if nbytes > self._limit - self._core.reserved:
                    why = "the reservation would pass the limit"
                    raise self._pool.oom(nbytes, nbytes, why, self._in_use)
                chunk = self._pool.new_region(nbytes, dedicated=True).head
                chunk.requested = nbytes
                chunk.tag = stream
                chunk.cls = 0  # never parked
                self._num_reserves += 1
                self._account_alloc(chunk.size, nbytes)
            finally:
                self._end_section()
        return self._buffer(chunk, nbytes, stream)

    def _buffer(self, chunk: Chunk, nbytes: int, stream: SyncStream | None) -> Buffer:
        buffer: _ArenaBuffer = _new_buffer(self._buffer_class)
        buffer.ptr = chunk.ptr
        buffer.nbytes = nbytes
        buffer.stream = stream
        buffer._pins = 0
        buffer._chunk = chunk
        return buffer

    def shrink(self) -> int:
        """Return every wholly free region to the base allocator; returns the bytes freed.

        A region whose memory a stream may still be using (freed on a stream that
        has not passed that point) is kept.
        """
        with self._lock:
            self._busy = True
            try:
                self._pool.reset_passed_streams()
                gone = self._pool.take_free_regions()
                self._pool.shrinkages += len(gone)
            finally:
                self._end_section()
        freed = free_handles(gone)
        if self._returns.polled:
            freed += self._returns.give_back_polled()
        return freed

    def release_stream_buffers(self, stream: SyncStream) -> None:
        """Forget ``stream`` on its free chunks so any stream can take them (ORT's
        ``ReleaseStreamBuffers``); call it once the stream's work is complete."""
        with self._lock:
            self._busy = True
            try:
                self._pool.release_stream(stream)
            finally:
                self._end_section()

    def stats(self) -> dict[str, int]:
        """ORT's arena statistics (``Limit``, ``InUse``, ``TotalAllocated``, ``MaxInUse``,
        ``NumAllocs``, ``NumReserves``, ``NumArenaExtensions``, ``NumArenaShrinkages``,
        ``MaxAllocSize``, ``LargestFreeBlock``) plus ``LiveBuffers``, ``InUseRequested``
        and ``MaxTotalAllocated``. Sizes are bytes; in-use sizes are rounded chunk sizes."""
        with self._lock:
            if not self._busy:
                self._pool.flush()
            return {
                "Limit": self._limit,
                "InUse": self._in_use,
                "TotalAllocated": self._core.reserved,
                "MaxInUse": self._max_in_use,
                "NumAllocs": self._num_allocs,
                "NumReserves": self._num_reserves,
                "NumArenaExtensions": self._pool.sizer.extensions,
                "NumArenaShrinkages": self._pool.shrinkages,
                "MaxAllocSize": self._max_alloc_size,
                "LargestFreeBlock": self._core.largest_free(),
                "LiveBuffers": self._live_buffers,
                "InUseRequested": self._bytes_in_use,
                "MaxTotalAllocated": self._pool.max_reserved,
            }

    def chunks(self) -> list[tuple[int, int, bool, SyncStream | None]]:
        """Every chunk as ``(ptr, size, in_use, stream)`` in address order (for tests and
        debugging)."""
        with self._lock:
            if not self._busy:
                self._pool.flush()
            return [(c.ptr, c.size, c.in_use, c.tag) for c in self._core.walk()]  # type: ignore[misc]

    def regions(self) -> list[tuple[int, int]]:
        """Every region as ``(ptr, size)`` in address order."""
        with self._lock:
            return sorted((r.ptr, r.size) for r in self._core.regions)

    # -- the Allocator hooks (unused: alloc and the buffer's release do the work) -------------
    def _allocate(self, nbytes: int, stream: SyncStream | None) -> int:  # pragma: no cover
        raise NotImplementedError

    def _free(self, ptr: int, nbytes: int, stream: SyncStream | None) -> None:
        pass  # only zero-byte buffers come through the base class, and they hold no memory

    def _close(self) -> None:
        with self._lock:
            self._busy = True
            try:
                self._pool.reset_passed_streams()
                gone = self._pool.take_free_regions()
                pending = [r for r in self._core.regions if r.wholly_free]
            finally:
                self._end_section()
        free_handles(gone)
        # Wholly free regions that a stream may still be using go back once it passes them.
        self._returns.watch_all(pending, closed=True)
        self._maybe_retire_base()

    # -- taking and releasing chunks -----------------------------------------------------------
    def _take_locked(self, nbytes: int, rounded: int, stream: SyncStream | None) -> Chunk:
        """A chunk of class ``rounded`` for a request, counted (lock held, in a section)."""
        per = self._fast.get(rounded)
        # The fast path: only this stream (or, for a host request, nobody) has parked
        # chunks of this class; the lowest address is last.
        if per is not None and len(per) == 1 and (parked := per.get(stream)):
            chunk = parked.pop()
            if not parked and stream is not None:
                del per[stream]  # streams come and go: no empty lists for them
            size = chunk.size
        else:
            chunk = self._pool.take(nbytes, rounded, stream, self._in_use)
            size = chunk.size
            if size > self._max_alloc_size:
                self._max_alloc_size = size
        chunk.requested = nbytes
        chunk.tag = stream
        chunk.cls = rounded
        self._in_use = in_use = self._in_use + size
        if in_use > self._max_in_use:
            self._max_in_use = in_use
        self._live_buffers += 1
        self._num_allocs += 1
        self._bytes_in_use = requested = self._bytes_in_use + nbytes
        if requested > self._peak_bytes_in_use:
            self._peak_bytes_in_use = requested
        return chunk

    def _free_chunk(self, chunk: Chunk) -> Region | None:
        """Take back a chunk whose buffer was freed (lock held, in a section): park it or
        free it in the core; returns a region to give back (see StreamPool.put_back)."""
        self._in_use -= chunk.size
        self._live_buffers -= 1
        self._bytes_in_use -= chunk.requested
        if chunk.tag is None and not self._closed:
            # A host chunk of a parked class (reserved chunks have class 0): the fast path.
            per = self._fast.get(chunk.cls)
            if per is not None:
                parked = per.get(None)
                if parked is None:
                    per[None] = [chunk]
                    return None
                if not parked or (len(parked) < MAX_PARKED and parked[-1].ptr > chunk.ptr):
                    parked.append(chunk)
                    return None
        return self._pool.put_back(chunk, closed=self._closed)

    def _release_buffer(self, buffer: _ArenaBuffer) -> None:
        """An arena buffer was freed or dropped (from any thread): return its chunk once."""
        lock = self._lock
        lock.acquire()
        chunk = buffer._chunk
        if chunk is None:  # another thread released it meanwhile
            lock.release()
            return
        buffer._chunk = None
        if self._busy or self._returns.watch or self._retired or self._closed:
            lock.release()
            self._release_chunk(chunk)
            return
        # The hot path: no section of this thread is running (else _busy), nothing to
        # watch or close.
        self._busy = True
        try:
            gone = self._free_chunk(chunk)
        finally:
            if self._deferred:
                self._end_section()
            self._busy = False
            watch = self._returns.take_watch() if self._returns.watch else None
            lock.release()
        if gone is not None:
            free_handles([gone])
        if watch:
            self._returns.watch_all(watch, closed=False)

    def _release_chunk(self, chunk: Chunk) -> None:
        """Return a chunk whose buffer was freed (from any thread)."""
        with self._lock:
            if self._busy:
                self._deferred.append(chunk)  # a finalizer inside our own locked section
                return
            self._busy = True
            try:
                gone = self._free_chunk(chunk)
            finally:
                if self._deferred:
                    self._end_section()
                self._busy = False
            watch = self._returns.take_watch()
            if gone is None and not watch and not self._retired and not self._closed:
                return  # the hot path
            close_now = self._retired and self._live_buffers == 0 and not self._closed
            closed = self._closed
        if gone is not None:
            free_handles([gone])
        self._returns.watch_all(watch, closed=closed)
        if close_now:
            self.close()
        elif closed:
            self._maybe_retire_base()

    def _end_section(self) -> None:
        # Called with the lock held: run releases that finalizers queued meanwhile.
        while self._deferred:
            chunk = self._deferred.pop()
            self._free_chunk(chunk)
        self._busy = False

    # -- internals ---------------------------------------------------------------------------
    def _size_class(self, nbytes: int) -> int:
        """The chunk size a request of ``nbytes`` (> 0) gets (as :meth:`alloc` inlines it)."""
        if nbytes > self._class_from:
            bits = (nbytes - 1).bit_length()
            step = 1 << (bits - (_FINE_SHIFT if nbytes > PARK_MAX else _CLASS_SHIFT))
            return (nbytes + step - 1) & -step
        return self._core.round(nbytes)

    def _account_alloc(self, size: int, nbytes: int) -> None:
        self._in_use += size
        if self._in_use > self._max_in_use:
            self._max_in_use = self._in_use
        if size > self._max_alloc_size:
            self._max_alloc_size = size
        self._live_buffers += 1
        self._num_allocs += 1
        self._bytes_in_use += nbytes
        if self._bytes_in_use > self._peak_bytes_in_use:
            self._peak_bytes_in_use = self._bytes_in_use

    def _after_give_back(self) -> None:
        if self._closed:
            self._maybe_retire_base()

    def _maybe_retire_base(self) -> None:
        with self._lock:
            done = not self._core.regions
        if done:
            self.base.retire()

    def __repr__(self) -> str:
        return (
            f"<ArenaAllocator {self.memory_info.name!r} in_use={self._in_use} "
            f"reserved={self._core.reserved} live={self._live_buffers}>"
        )
