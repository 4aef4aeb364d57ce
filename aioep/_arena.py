"""A stream-aware best-fit-with-coalescing (BFC) arena over any allocator, and its
configuration (ORT's ``BFCArena`` / ``StreamAwareArena`` and ``OrtArenaCfg``).

The arena reserves large regions from a base allocator and carves them into
chunks. Free chunks sit in bins by size class (256 B << i); a request takes the
smallest free chunk that fits (lowest address on ties), splits off the rest
when that wastes too much, and a freed chunk merges with free neighbours.

Stream rule (ORT's, made a little stricter): a chunk freed by a buffer that was
allocated on stream A remembers A and A's sync id at the time of the free. A
request on stream B may take it when B is A, when B has since waited on a
notification that A recorded after the free (``B.wait(A.record())``), or when A
has completed all its work up to that point (A is idle or closed, or A's last
recorded notification after the free is done). Otherwise the arena uses
another chunk or extends.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._allocator import Allocator
from ._errors import ClosedError, DeviceError, EpError, InUseError, InvalidArgument
from ._options import parse_int_option
from ._tensor import Buffer
from ._types import AllocatorType

if TYPE_CHECKING:
    from ._notification import Notification
    from ._stream import SyncStream

__all__ = ["ArenaAllocator", "ArenaConfig", "ArenaExtendStrategy"]

MIN_ALLOCATION_BITS = 8
MIN_ALLOCATION_SIZE = 1 << MIN_ALLOCATION_BITS  # 256 B, as ORT's kMinAllocationSize
NUM_BINS = 21  # bin i holds free chunks of [256 << i, 256 << (i + 1)); the last has no top
SIZE_MAX = (1 << 64) - 1  # ORT's "no limit" (std::numeric_limits<size_t>::max())
_bisect_left = bisect.bisect_left
_insort = bisect.insort
_BACKPEDAL = 0.9  # on a base-allocator failure, retry an extension this much smaller
_MAX_PARKED = 64  # freed chunks parked before coalescing (see ArenaAllocator._quick)
# Size classes: above 16 units (4 KiB for 256-byte units) a request rounds up to one of
# 8 classes per power of two (at most 12.5% more), so freed chunks of nearby sizes are
# interchangeable and a recurring size is a dict lookup (PyTorch's roundup_power2_divisions).
_CLASS_BITS = 3
_CLASS_SHIFT = _CLASS_BITS + 1

_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)


class ArenaExtendStrategy(enum.IntEnum):
    """How the arena grows when no free chunk fits (ORT's ``ArenaExtendStrategy``)."""

    NEXT_POWER_OF_TWO = 0
    """Regions double in size (from the initial chunk size), capped by max_power_of_two_extend_bytes."""
    SAME_AS_REQUESTED = 1
    """Each region is exactly the (rounded) request: least waste, more regions."""


_STRATEGY_NAMES = {
    "next_power_of_two": ArenaExtendStrategy.NEXT_POWER_OF_TWO,
    "same_as_requested": ArenaExtendStrategy.SAME_AS_REQUESTED,
}
# key -> (field, (min, max) of the C type ORT parses it as, unsigned?)
_KEYS: dict[str, tuple[str, tuple[int, int], bool]] = {
    "arena.extend_strategy": ("extend_strategy", _INT32, False),
    "arena.initial_chunk_size_bytes": ("initial_chunk_size_bytes", _INT32, False),
    "arena.max_dead_bytes_per_chunk": ("max_dead_bytes_per_chunk", _INT32, False),
    "arena.initial_growth_chunk_size_bytes": ("initial_growth_chunk_size_bytes", _INT32, False),
    "arena.max_power_of_two_extend_bytes": ("max_power_of_two_extend_bytes", _INT64, False),
    "arena.max_mem": ("max_mem", (0, SIZE_MAX), True),
}
_CUDA_MEMPOOL_KEYS = (
    "arena.use_cuda_mempool",
    "arena.cuda_mempool_release_threshold",
    "arena.cuda_mempool_bytes_to_keep_on_shrink",
)
_SIGNED = re.compile(r"-?[0-9]+")
_UNSIGNED = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]+")


@dataclass(frozen=True)
class ArenaConfig:
    """Arena settings, with ORT's defaults (``OrtArenaCfg`` after ``-1`` is resolved).

    Build one from ORT's key/value options with :meth:`from_options`, or directly.
    ``max_mem=0`` means no limit.
    """

    extend_strategy: ArenaExtendStrategy = ArenaExtendStrategy.NEXT_POWER_OF_TWO
    initial_chunk_size_bytes: int = 1 << 20
    max_dead_bytes_per_chunk: int = 128 << 20
    initial_growth_chunk_size_bytes: int = 2 << 20
    max_power_of_two_extend_bytes: int = 1 << 30
    max_mem: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "extend_strategy", ArenaExtendStrategy(self.extend_strategy))
        except ValueError:
            raise InvalidArgument(
                f"ArenaConfig: extend_strategy must be 0 (next_power_of_two) or 1 "
                f"(same_as_requested), got {self.extend_strategy!r}"
            ) from None
        for name in (
            "initial_chunk_size_bytes",
            "initial_growth_chunk_size_bytes",
            "max_power_of_two_extend_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"ArenaConfig: {name} must be an int > 0, got {value!r}")
        for name in ("max_dead_bytes_per_chunk", "max_mem"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"ArenaConfig: {name} must be an int >= 0, got {value!r}")
        if self.max_mem > SIZE_MAX:
            raise InvalidArgument(f"ArenaConfig: max_mem {self.max_mem} does not fit in size_t")

    @property
    def limit(self) -> int:
        """The byte limit the arena enforces (``SIZE_MAX`` when ``max_mem`` is 0)."""
        return self.max_mem or SIZE_MAX

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> ArenaConfig:
        """Parse ORT's arena options (``OrtArenaCfg::FromKeyValuePairs`` then ``IsValid``).

        Keys: ``arena.extend_strategy`` (-1/0 next power of two, 1 same as requested,
        or the names ``next_power_of_two`` / ``same_as_requested``),
        ``arena.initial_chunk_size_bytes``, ``arena.max_dead_bytes_per_chunk``,
        ``arena.initial_growth_chunk_size_bytes``, ``arena.max_power_of_two_extend_bytes``
        and ``arena.max_mem`` (0 = no limit). Values are ints or strings that parse
        whole (``"0x"`` hex for the unsigned ``max_mem``); ``-1`` means the default.

        Raises:
            InvalidArgument: an unknown key, a value that is not an integer, out of
                range for its C type, negative where that is not allowed, or a
                strategy outside the set. The message names the key and the value.
        """
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise InvalidArgument(
                f"arena options must be a mapping of str to str/int, got {type(options).__name__}"
            )
        values: dict[str, Any] = {}
        for key, raw in options.items():
            if key in _CUDA_MEMPOOL_KEYS:
                raise InvalidArgument(
                    f"arena option {key!r}={raw!r}: CUDA mempool options are not supported by "
                    "aioep's arena (use the CUDA backend's allocator options instead)"
                )
            spec = _KEYS.get(key) if isinstance(key, str) else None
            if spec is None:
                raise InvalidArgument(
                    f"Invalid arena option {key!r}={raw!r}; known keys are {sorted(_KEYS)}"
                )
            name, (lo, hi), unsigned = spec
            if name == "extend_strategy" and isinstance(raw, str) and raw in _STRATEGY_NAMES:
                values[name] = _STRATEGY_NAMES[raw]
                continue
            value = _parse_int(key, raw, unsigned)
            if value == -1:
                continue  # the default, as in ORT
            if not lo <= value <= hi:
                raise InvalidArgument(
                    f"arena option {key!r}={raw!r}: out of range for its type [{lo}, {hi}]"
                )
            if name == "extend_strategy":
                if value not in (0, 1):
                    raise InvalidArgument(
                        f"arena option {key!r}={raw!r}: must be -1 or 0 (next_power_of_two) "
                        "or 1 (same_as_requested)"
                    )
                values[name] = ArenaExtendStrategy(value)
            elif value < 0:
                raise InvalidArgument(
                    f"arena option {key!r}={raw!r}: must be -1 (the default) or >= 0"
                )
            elif value == 0 and name != "max_dead_bytes_per_chunk" and name != "max_mem":
                raise InvalidArgument(
                    f"arena option {key!r}={raw!r}: must be -1 (the default) or > 0"
                )
            else:
                values[name] = value
        return cls(**values)


def _parse_int(key: str, raw: Any, unsigned: bool) -> int:
    # ORT's syntax is stricter than the common option rules (ParseStringWithClassicLocale:
    # the whole string, no whitespace or "+", hex only for unsigned types; "-1" is the
    # default): check it here, then let parse_int_option apply the shared type rules
    # (an int, not a bool or a float) and convert. The C-type range is checked by the caller.
    syntax = _UNSIGNED if unsigned else _SIGNED
    if isinstance(raw, str) and raw != "-1" and not syntax.fullmatch(raw):
        raise InvalidArgument(f"Failed to parse value for {key!r} from {raw!r}")
    return parse_int_option("arena", key, raw)


# -- the arena -------------------------------------------------------------------------------


class _Chunk:
    __slots__ = (
        "cls",
        "in_use",
        "next",
        "prev",
        "ptr",
        "quick",
        "region",
        "requested",
        "size",
        "stream",
        "sync_id",
    )

    def __init__(self, ptr: int, size: int, region: _Region) -> None:
        self.ptr = ptr
        self.size = size
        self.region = region
        self.in_use = False
        self.quick = False  # free, parked in the quick list (not binned, not yet coalesced)
        self.requested = 0
        self.cls = size  # the size class it was last handed out for (its park key)
        self.prev: _Chunk | None = None
        self.next: _Chunk | None = None
        self.stream: SyncStream | None = None
        self.sync_id = 0


class _Region:
    __slots__ = ("buffer", "head", "owner", "reserved", "size")

    def __init__(self, buffer: Buffer, reserved: bool) -> None:
        self.buffer = buffer
        self.owner = buffer._owner
        self.size = buffer.nbytes
        self.reserved = reserved  # a dedicated region from reserve(): never split or reused
        self.head = _Chunk(buffer.ptr, buffer.nbytes, self)


_PIN_LOCK = threading.Lock()  # guards the pin counts of arena buffers (held for an increment)
_new_buffer = object.__new__


class _ArenaBuffer(Buffer):
    """An arena buffer: released by ``__del__`` (no ``weakref.finalize``) or :meth:`free`.

    ``_chunk`` is the arena chunk while the buffer holds it; the arena clears it under
    its lock, so a buffer is released exactly once whichever way comes first.
    """

    __slots__ = ("_chunk",)
    _chunk: _Chunk | None

    @property
    def freed(self) -> bool:
        return self._released or self._chunk is None

    def free(self) -> None:
        # Reading _pins without the lock is safe: a concurrent _pin either comes first
        # (the count is seen) or after the release, as with Buffer's lock.
        if self._pins:
            raise InUseError(
                f"buffer {self.ptr:#x} ({self.nbytes} bytes on {self.memory_info.name}) is "
                f"used by {self._pins} operation(s) in flight; await them before freeing"
            )
        self._released = True
        if self._chunk is not None:
            self.allocator._release_buffer(self)  # type: ignore[union-attr]
        self._owner = None

    def __del__(self) -> None:
        if self._chunk is not None:
            try:
                self.allocator._release_buffer(self)  # type: ignore[union-attr]
            except Exception:  # pragma: no cover - nothing can be raised from a finalizer
                pass


def _bin_index(size: int) -> int:
    return min((size >> MIN_ALLOCATION_BITS).bit_length() - 1, NUM_BINS - 1)


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
        self._lock = threading.RLock()  # type: ignore[assignment]  # see _busy
        self.base = base
        self.config = config
        self._limit = config.limit
        self._max_dead = config.max_dead_bytes_per_chunk
        self._unit = unit = max(MIN_ALLOCATION_SIZE, base.memory_info.alignment)
        # Size classes need a power-of-two unit; otherwise every size is its own class.
        self._class_from = unit << (_CLASS_BITS + 1) if unit & (unit - 1) == 0 else SIZE_MAX
        self._curr_region_bytes = self._round(min(self._limit, config.initial_chunk_size_bytes))
        self._bins: list[list[tuple[int, int, _Chunk]]] = [[] for _ in range(NUM_BINS)]
        self._nonempty = 0  # bit i set <=> bin i has a free chunk
        self._regions: list[_Region] = []
        # A finalizer can run a release on this thread while it is inside a locked section
        # (garbage collection); such a release is queued and done when the section ends.
        self._busy = False
        self._deferred: list[_Chunk] = []
        self._watch: list[_Region] = []  # free regions to give back once their stream passes
        # Such regions whose stream's notifications cannot call back: checked on later calls.
        self._polled: list[tuple[_Region, Notification]] = []
        # Freed chunks parked by exact size before coalescing, like malloc's fast bins: an
        # alloc/free cycle of one size then costs a list append and pop. They are coalesced
        # before the arena would extend, and whenever a caller looks at the chunks.
        self._quick: dict[int, list[_Chunk]] = {}
        self._quick_count = 0
        self._in_use = 0  # bytes of chunks in use (rounded), as ORT's InUse
        self._max_in_use = 0
        self._reserved_bytes = 0  # bytes of regions, ORT's TotalAllocated
        self._max_reserved_bytes = 0
        self._num_reserves = 0
        self._num_extensions = 0
        self._num_shrinkages = 0
        self._max_alloc_size = 0

    # -- public API --------------------------------------------------------------------------
    def alloc(self, nbytes: int, *, stream: SyncStream | None = None) -> Buffer:
        """Allocate ``nbytes`` for work on ``stream`` (see the module docstring for reuse).

        Raises:
            DeviceError: the limit or the base allocator leaves no room; the message
                names the request, the limit and the bytes in use.
        """
        if type(nbytes) is not int or nbytes <= 0:  # the hot path takes a plain int > 0
            if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
                raise InvalidArgument(
                    f"arena {self.memory_info.name!r}: nbytes must be an int >= 0, got {nbytes!r}"
                )
            nbytes = int(nbytes)
            if nbytes == 0:
                if self._closed or self._retired:
                    raise ClosedError(f"arena {self.memory_info.name!r} is closed")
                return super().alloc(0, stream=stream)  # a null buffer, as the base class gives
        if self._closed or self._retired:
            raise ClosedError(f"arena {self.memory_info.name!r} is closed")
        # The size class: 256-byte units up to 16 units, then 8 classes per power of two
        # (see _size_class); inlined, as this is the hot path.
        if nbytes > self._class_from:
            step = 1 << ((nbytes - 1).bit_length() - _CLASS_SHIFT)
            rounded = (nbytes + step - 1) & -step
        else:
            unit = self._unit
            rounded = (nbytes + unit - 1) // unit * unit
        lock = self._lock
        lock.acquire()
        self._busy = True
        try:
            chunk = None
            parked = self._quick.get(rounded)
            if parked:
                if len(parked) == 1 and (parked[0].stream is None or parked[0].stream is stream):
                    chunk = parked.pop()
                    chunk.quick = False
                    self._quick_count -= 1
                else:  # the lowest usable address, as best fit would pick
                    chunk = self._take_parked(parked, stream)
            if chunk is None:
                chunk = self._find(rounded, stream)
                if chunk is None:
                    chunk = self._grow_and_find(nbytes, rounded, stream)
            chunk.in_use = True
            chunk.requested = nbytes
            chunk.stream = stream
            chunk.cls = rounded
            size = chunk.size
            self._in_use = in_use = self._in_use + size
            if in_use > self._max_in_use:
                self._max_in_use = in_use
            if size > self._max_alloc_size:
                self._max_alloc_size = size
            self._live_buffers += 1
            self._num_allocs += 1
            self._bytes_in_use = requested = self._bytes_in_use + nbytes
            if requested > self._peak_bytes_in_use:
                self._peak_bytes_in_use = requested
        finally:
            if self._deferred:
                self._end_section()
            self._busy = False
            lock.release()
        buffer = _new_buffer(_ArenaBuffer)
        buffer.ptr = chunk.ptr
        buffer.nbytes = nbytes
        buffer.memory_info = self.memory_info
        buffer.allocator = self
        buffer.readonly = False
        buffer.stream = stream
        # Views of host memory keep the region's backing object alive, so reading a freed
        # buffer through a view never touches unmapped memory.
        buffer._owner = chunk.region.owner
        buffer._pins = 0
        buffer._released = False
        buffer._pin_lock = _PIN_LOCK
        buffer._finalizer = None
        buffer._chunk = chunk
        return buffer

    def _take_parked(self, parked: list[_Chunk], stream: SyncStream | None) -> _Chunk | None:
        # The lowest address among the usable parked chunks, as best fit would pick.
        best = -1
        idle: dict[int, bool] = {}
        for i, chunk in enumerate(parked):
            owner = chunk.stream
            if (owner is None or owner is stream or self._usable(chunk, stream, idle)) and (
                best < 0 or chunk.ptr < parked[best].ptr
            ):
                best = i
        if best < 0:
            return None
        chunk = parked.pop(best)
        chunk.quick = False
        self._quick_count -= 1
        return chunk

    def _flush_parked(self) -> None:
        """Coalesce every parked chunk into the bins (lock held)."""
        if not self._quick_count:
            return
        parked = [c for chunks in self._quick.values() for c in chunks]
        self._quick.clear()
        self._quick_count = 0
        for chunk in parked:
            # Parked neighbours still have quick set, so each merges once it is reached.
            chunk.quick = False
            self._coalesce(chunk)

    def reserve(self, nbytes: int, *, stream: SyncStream | None = None) -> Buffer:
        """Allocate a dedicated region of ``nbytes`` straight from the base (ORT's ``Reserve``).

        The memory is outside the pool: it is never split or handed to another
        request, and it goes back to the base when the buffer is freed.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidArgument(
                f"arena {self.memory_info.name!r}: nbytes must be an int >= 0, got {nbytes!r}"
            )
        if self._closed or self._retired:
            raise ClosedError(f"arena {self.memory_info.name!r} is closed")
        if nbytes == 0:
            return super().alloc(0, stream=stream)
        with self._lock:
            self._busy = True
            try:
                if nbytes > self._limit - self._reserved_bytes:
                    raise self._oom(nbytes, nbytes, "the reservation would pass the limit")
                region = self._new_region(nbytes, reserved=True)
                chunk = region.head
                chunk.in_use = True
                chunk.requested = nbytes
                chunk.stream = stream
                self._num_reserves += 1
                self._account_alloc(chunk.size, nbytes)
            finally:
                self._end_section()
        return self._make_buffer(chunk, stream)

    def shrink(self) -> int:
        """Return every wholly free region to the base allocator; returns the bytes freed.

        A region whose memory a stream may still be using (freed on a stream that
        has not passed that point) is kept.
        """
        with self._lock:
            self._busy = True
            try:
                self._reset_passed_streams()
                gone = self._take_free_regions()
                self._num_shrinkages += len(gone)
            finally:
                self._end_section()
        freed = self._free_regions(gone)
        if self._polled:
            before = self._reserved_bytes
            self._give_back_polled()
            freed += before - self._reserved_bytes
        return freed

    def release_stream_buffers(self, stream: SyncStream) -> None:
        """Forget ``stream`` on its free chunks so any stream can take them (ORT's
        ``ReleaseStreamBuffers``); call it once the stream's work is complete."""
        with self._lock:
            self._busy = True
            try:
                self._flush_parked()
                for chunk in self._free_chunks():
                    if chunk.stream is stream:
                        self._reset_chunk(chunk)
            finally:
                self._end_section()

    def stats(self) -> dict[str, int]:
        """ORT's arena statistics (``Limit``, ``InUse``, ``TotalAllocated``, ``MaxInUse``,
        ``NumAllocs``, ``NumReserves``, ``NumArenaExtensions``, ``NumArenaShrinkages``,
        ``MaxAllocSize``, ``LargestFreeBlock``) plus ``LiveBuffers``, ``InUseRequested``
        and ``MaxTotalAllocated``. Sizes are bytes; in-use sizes are rounded chunk sizes."""
        with self._lock:
            if not self._busy:
                self._flush_parked()
            return {
                "Limit": self._limit,
                "InUse": self._in_use,
                "TotalAllocated": self._reserved_bytes,
                "MaxInUse": self._max_in_use,
                "NumAllocs": self._num_allocs,
                "NumReserves": self._num_reserves,
                "NumArenaExtensions": self._num_extensions,
                "NumArenaShrinkages": self._num_shrinkages,
                "MaxAllocSize": self._max_alloc_size,
                "LargestFreeBlock": self._largest_free(),
                "LiveBuffers": self._live_buffers,
                "InUseRequested": self._bytes_in_use,
                "MaxTotalAllocated": self._max_reserved_bytes,
            }

    def chunks(self) -> list[tuple[int, int, bool, SyncStream | None]]:
        """Every chunk as ``(ptr, size, in_use, stream)`` in address order (for tests and
        debugging)."""
        with self._lock:
            if not self._busy:
                self._flush_parked()
            out = []
            for region in sorted(self._regions, key=lambda r: r.head.ptr):
                c: _Chunk | None = region.head
                while c is not None:
                    out.append((c.ptr, c.size, c.in_use, c.stream))
                    c = c.next
            return out

    def regions(self) -> list[tuple[int, int]]:
        """Every region as ``(ptr, size)`` in address order."""
        with self._lock:
            return sorted((r.head.ptr, r.size) for r in self._regions)

    # -- the Allocator hooks (unused: alloc and the buffer's release do the work) -------------
    def _allocate(self, nbytes: int, stream: SyncStream | None) -> int:  # pragma: no cover
        raise NotImplementedError

    def _free(self, ptr: int, nbytes: int, stream: SyncStream | None) -> None:
        pass  # only zero-byte buffers come through the base class, and they hold no memory

    def _close(self) -> None:
        with self._lock:
            self._busy = True
            try:
                self._reset_passed_streams()
                gone = self._take_free_regions()
                pending = [r for r in self._regions if not r.head.in_use and r.head.next is None]
            finally:
                self._end_section()
        self._free_regions(gone)
        # Wholly free regions that a stream may still be using go back once it passes them.
        for region in pending:
            self._release_when_stream_passes(region)
        self._maybe_retire_base()

    # -- internals ---------------------------------------------------------------------------
    def _size_class(self, nbytes: int) -> int:
        """The chunk size a request of ``nbytes`` (> 0) gets (as :meth:`alloc` inlines it)."""
        if nbytes > self._class_from:
            step = 1 << ((nbytes - 1).bit_length() - _CLASS_SHIFT)
            return (nbytes + step - 1) & -step
        return self._round(nbytes)

    def _round(self, nbytes: int) -> int:
        unit = self._unit
        return (nbytes + unit - 1) // unit * unit

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

    def _make_buffer(self, chunk: _Chunk, stream: SyncStream | None) -> Buffer:
        buffer = _new_buffer(_ArenaBuffer)
        Buffer.__init__(
            buffer,
            chunk.ptr,
            chunk.requested,
            self.memory_info,
            allocator=self,
            owner=chunk.region.owner,
            stream=stream,
        )
        buffer._pin_lock = _PIN_LOCK
        buffer._chunk = chunk
        return buffer

    def _end_section(self) -> None:
        # Called with the lock held: run releases that finalizers queued meanwhile.
        while self._deferred:
            chunk = self._deferred.pop()
            self._free_chunk(chunk)
        self._busy = False

    @staticmethod
    def _usable(chunk: _Chunk, stream: SyncStream | None, idle: dict[int, bool]) -> bool:
        owner = chunk.stream
        if owner is None or owner is stream:
            return True
        if stream is not None and stream._sync_clock.get(owner._uid, 0) > chunk.sync_id:
            return True  # stream waited on a notification owner recorded after the free
        key = owner._uid
        done = idle.get(key)
        if done is None:
            done = idle[key] = _idle(owner)
        return done or _tail_passed(owner, chunk.sync_id)

    def _find(self, rounded: int, stream: SyncStream | None) -> _Chunk | None:
        b = (rounded >> MIN_ALLOCATION_BITS).bit_length() - 1
        if b >= NUM_BINS:
            b = NUM_BINS - 1
        mask = self._nonempty >> b
        idle: dict[int, bool] = {}
        bins = self._bins
        while mask:
            skip = (mask & -mask).bit_length() - 1
            b += skip
            mask >>= skip
            free = bins[b]
            i = _bisect_left(free, (rounded,))
            for j in range(i, len(free)):
                chunk = free[j][2]
                owner = chunk.stream
                if owner is None or owner is stream or self._usable(chunk, stream, idle):
                    del free[j]
                    if not free:
                        self._nonempty &= ~(1 << b)
                    rest = chunk.size - rounded
                    if rest and (rest >= rounded or rest >= self._max_dead):
                        self._split(chunk, rounded, rest)
                    return chunk
            b += 1
            mask >>= 1
        return None

    def _split(self, chunk: _Chunk, rounded: int, rest: int) -> None:
        new = _Chunk(chunk.ptr + rounded, rest, chunk.region)
        new.stream = chunk.stream
        new.sync_id = chunk.sync_id
        new.prev = chunk
        nxt = new.next = chunk.next
        if nxt is not None:
            nxt.prev = new
        chunk.next = new
        chunk.size = rounded
        self._insert(new)

    def _insert(self, chunk: _Chunk) -> None:
        size = chunk.size
        b = (size >> MIN_ALLOCATION_BITS).bit_length() - 1
        if b >= NUM_BINS:
            b = NUM_BINS - 1
        _insort(self._bins[b], (size, chunk.ptr, chunk))
        self._nonempty |= 1 << b

    def _remove(self, chunk: _Chunk) -> None:
        size = chunk.size
        b = (size >> MIN_ALLOCATION_BITS).bit_length() - 1
        if b >= NUM_BINS:
            b = NUM_BINS - 1
        free = self._bins[b]
        del free[_bisect_left(free, (size, chunk.ptr))]
        if not free:
            self._nonempty &= ~(1 << b)

    def _free_chunks(self) -> list[_Chunk]:
        return [entry[2] for free in self._bins for entry in free]

    def _largest_free(self) -> int:
        if not self._nonempty:
            return 0
        return self._bins[self._nonempty.bit_length() - 1][-1][0]

    def _grow_and_find(self, nbytes: int, rounded: int, stream: SyncStream | None) -> _Chunk:
        # Before growing: coalesce parked chunks, and chunks of streams that have since
        # finished become anyone's.
        flushed = self._quick_count
        self._flush_parked()
        if self._reset_passed_streams() or flushed:
            chunk = self._find(rounded, stream)
            if chunk is not None:
                return chunk
        # Wholly free regions did not fit the request (regions never coalesce with each
        # other): give them back before extending, so the new region does not add to them.
        if self._polled:
            self._give_back_polled()
        gone = self._take_free_regions()
        if gone:
            self._num_shrinkages += len(gone)
            self._free_regions(gone)
        self._extend(nbytes, rounded)
        chunk = self._find(rounded, stream)
        if chunk is None:  # pragma: no cover - a fresh region always fits
            raise DeviceError(f"arena {self.memory_info.name!r}: no chunk after extending")
        return chunk

    def _extend(self, nbytes: int, rounded: int) -> None:
        available = (self._limit - self._reserved_bytes) // self._unit * self._unit
        if rounded > available:
            raise self._oom(nbytes, rounded, f"only {available} bytes are left under the limit")
        cap = max(self.config.max_power_of_two_extend_bytes, self._unit)
        if self.config.extend_strategy is ArenaExtendStrategy.SAME_AS_REQUESTED:
            size = rounded
        else:
            size = self._curr_region_bytes
            grew = False
            while size < rounded:
                size *= 2
                grew = True
            if self._num_extensions == 0:
                following = self._round(self.config.initial_growth_chunk_size_bytes)
            elif grew:
                following = size
            else:
                following = size * 2
            self._curr_region_bytes = max(min(following, cap), self._unit)
            size = min(size, available)
        while True:
            try:
                self._new_region(size, reserved=False)
                return
            except DeviceError as exc:
                smaller = self._round(int(size * _BACKPEDAL))
                if smaller < rounded or smaller < 8192 or smaller >= size:
                    raise self._oom(nbytes, rounded, f"the base allocator failed: {exc}") from exc
                size = smaller

    def _new_region(self, size: int, *, reserved: bool) -> _Region:
        try:
            buffer = self.base.alloc(size)
        except EpError as exc:
            if isinstance(exc, DeviceError):
                raise
            raise DeviceError(
                f"arena {self.memory_info.name!r}: base allocator failed for {size} bytes: {exc}"
            ) from exc
        except MemoryError as exc:
            raise DeviceError(
                f"arena {self.memory_info.name!r}: base allocator out of memory for {size} bytes"
            ) from exc
        region = _Region(buffer, reserved)
        self._regions.append(region)
        self._reserved_bytes += size
        if self._reserved_bytes > self._max_reserved_bytes:
            self._max_reserved_bytes = self._reserved_bytes
        if not reserved:
            self._num_extensions += 1
            self._insert(region.head)
        return region

    def _oom(self, nbytes: int, rounded: int, why: str) -> DeviceError:
        limit = "no limit" if self._limit == SIZE_MAX else f"limit {self._limit} bytes"
        return DeviceError(
            f"arena {self.memory_info.name!r}: out of memory allocating {nbytes} bytes "
            f"(rounded to {rounded}): {why}; {limit}, {self._in_use} bytes in use, "
            f"{self._reserved_bytes} reserved, largest free block {self._largest_free()} bytes"
        )

    def _release_buffer(self, buffer: _ArenaBuffer) -> None:
        """An arena buffer was freed or dropped (from any thread): return its chunk once."""
        lock = self._lock
        lock.acquire()
        chunk = buffer._chunk
        if chunk is None:  # another thread released it meanwhile
            lock.release()
            return
        buffer._chunk = None
        if self._busy or self._watch or self._retired or self._closed:
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
            watch = self._watch
            if watch:  # a reserved region freed while its stream may still use it
                self._watch = []
            lock.release()
        if gone is not None:
            self._free_regions([gone])
        for region in watch:
            self._release_when_stream_passes(region)

    def _release_chunk(self, chunk: _Chunk) -> None:
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
            if gone is None and not self._watch and not self._retired and not self._closed:
                return  # the hot path
            close_now = self._retired and self._live_buffers == 0 and not self._closed
            closed = self._closed
            watch, self._watch = self._watch, []
        if gone is not None:
            self._free_regions([gone])
        for region in watch:
            self._release_when_stream_passes(region)
        if close_now:
            self.close()
        elif closed:
            self._maybe_retire_base()

    def _free_chunk(self, chunk: _Chunk) -> _Region | None:
        """Return a chunk to the bins (lock held); the region to give back, if any."""
        self._in_use -= chunk.size
        self._live_buffers -= 1
        self._bytes_in_use -= chunk.requested
        chunk.in_use = False
        chunk.requested = 0
        stream = chunk.stream
        if stream is not None:
            # The point in the stream's order after the work that used this chunk.
            chunk.sync_id = stream._sync_id
            if _idle(stream):
                chunk.stream = None  # that work is done: anyone may take it
        region = chunk.region
        if region.reserved:
            if chunk.stream is None:
                self._drop_region(region)
                return region
            self._watch.append(region)
            return None
        if not self._closed:
            chunk.quick = True
            parked = self._quick.get(chunk.cls)
            if parked is None:
                self._quick[chunk.cls] = [chunk]
            else:
                parked.append(chunk)
            self._quick_count += 1
            if self._quick_count > _MAX_PARKED:
                self._flush_parked()
            return None
        chunk = self._coalesce(chunk)
        if chunk.next is None and chunk.prev is None:
            if chunk.stream is None:
                self._remove(chunk)
                self._drop_region(region)
                return region
            self._watch.append(region)
        return None

    def _coalesce(self, chunk: _Chunk) -> _Chunk:
        """Merge a free chunk with free neighbours of the same stream and bin the result."""
        nxt = chunk.next
        if nxt is not None and not nxt.in_use and not nxt.quick and nxt.stream is chunk.stream:
            self._remove(nxt)
            chunk.size += nxt.size
            if nxt.sync_id > chunk.sync_id:
                chunk.sync_id = nxt.sync_id
            after = chunk.next = nxt.next
            if after is not None:
                after.prev = chunk
        prev = chunk.prev
        if prev is not None and not prev.in_use and not prev.quick and prev.stream is chunk.stream:
            self._remove(prev)
            prev.size += chunk.size
            if chunk.sync_id > prev.sync_id:
                prev.sync_id = chunk.sync_id
            after = prev.next = chunk.next
            if after is not None:
                after.prev = prev
            chunk = prev
        self._insert(chunk)
        return chunk

    def _reset_chunk(self, chunk: _Chunk) -> None:
        """A free chunk's stream is done with it: make it anyone's and coalesce (lock held)."""
        self._remove(chunk)
        chunk.stream = None
        chunk.sync_id = 0
        self._coalesce(chunk)

    def _reset_passed_streams(self) -> int:
        """Reset free chunks whose stream has passed their point; returns how many (lock held)."""
        self._flush_parked()
        idle: dict[int, bool] = {}
        passed = [
            chunk
            for chunk in self._free_chunks()
            if chunk.stream is not None and self._usable(chunk, None, idle)
        ]
        for chunk in passed:
            # An earlier reset in this loop may have merged this chunk into a neighbour.
            if self._is_binned(chunk):
                self._reset_chunk(chunk)
        return len(passed)

    def _is_binned(self, chunk: _Chunk) -> bool:
        free = self._bins[_bin_index(chunk.size)]
        i = bisect.bisect_left(free, (chunk.size, chunk.ptr))
        return i < len(free) and free[i][2] is chunk

    def _take_free_regions(self) -> list[_Region]:
        """Unlink wholly free regions that no stream may still use (lock held)."""
        self._flush_parked()
        gone = []
        for region in list(self._regions):
            head = region.head
            if region.reserved or head.in_use or head.next is not None or head.stream is not None:
                continue
            self._remove(head)
            self._drop_region(region)
            gone.append(region)
        return gone

    def _drop_region(self, region: _Region) -> None:
        self._regions.remove(region)
        self._reserved_bytes -= region.size

    def _free_regions(self, regions: list[_Region]) -> int:
        freed = 0
        for region in regions:
            freed += region.size
            region.buffer.free()
        return freed

    def _release_when_stream_passes(self, region: _Region) -> None:
        """Give a free region back once its stream has passed the work that used it."""
        stream = region.head.stream
        if stream is None or stream._closed:
            self._give_back_later(region)
            return
        try:
            mark = stream.record()
        except Exception:
            self._give_back_later(region)  # the stream closed meanwhile: its work is done
            return
        if not mark.impl.add_done_callback(lambda: self._give_back_later(region)):
            # This backend's notifications cannot call back. Never block the freeing
            # thread (it may run the event loop): later arena calls check the mark. A
            # closed arena has no later calls: it waits (environments close off the loop).
            with self._lock:
                self._polled.append((region, mark))
            if self._closed:
                self._give_back_polled(wait=True)

    def _give_back_polled(self, *, wait: bool = False) -> None:
        """Give back polled regions whose stream has passed them (all of them, waiting on
        the host, with ``wait``: only closing does that, off the loop in an environment)."""
        with self._lock:
            polled, self._polled = self._polled, []
            pending = []
            for region, mark in polled:
                if mark.done():
                    self._give_back_later(region)
                else:
                    pending.append((region, mark))
            self._polled += pending
        for region, mark in pending if wait else ():
            mark.wait()
            with self._lock:
                if (region, mark) in self._polled:  # another thread may have taken it
                    self._polled.remove((region, mark))
            self._give_back_later(region)

    def _give_back_later(self, region: _Region) -> None:
        with self._lock:
            if region not in self._regions:
                return
            head = region.head
            if head.in_use or head.next is not None:
                return
            if not region.reserved:
                self._remove(head)
            head.stream = None
            self._drop_region(region)
        self._free_regions([region])
        if self._closed:
            self._maybe_retire_base()

    def _maybe_retire_base(self) -> None:
        with self._lock:
            done = not self._regions
        if done:
            self.base.retire()

    def __repr__(self) -> str:
        return (
            f"<ArenaAllocator {self.memory_info.name!r} in_use={self._in_use} "
            f"reserved={self._reserved_bytes} live={self._live_buffers}>"
        )


def _idle(stream: SyncStream) -> bool:
    """True when ``stream`` has completed all work enqueued so far (or is closed)."""
    return stream._closed or stream._impl.query() is True


def _tail_passed(stream: SyncStream, sync_id: int) -> bool:
    """True when a notification ``stream`` recorded after point ``sync_id`` is done."""
    tail = stream._tail
    return tail is not None and tail._sync_table.get(stream._uid, 0) > sync_id and tail.done()
