"""The allocator base class that backends implement and the environment shares."""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._base.errors import ClosedError, InvalidArgument
from .._base.types import MemoryInfo
from .._base.validate import MAX_DIM
from .buffer import Buffer
from .stream import SyncStream

if TYPE_CHECKING:
    from .ownership import Origin

__all__ = ["Allocator", "allocator_origin", "check_nbytes", "check_stream", "set_origin"]


def check_nbytes(kind: str, name: str, nbytes: object) -> None:
    """Raise `InvalidArgument` naming the ``kind`` of allocator and its memory's
    ``name`` unless ``nbytes`` is an int in ``[0, 2**62]`` (a bool is refused)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= MAX_DIM:
        raise InvalidArgument(
            f"{kind} {name!r}: nbytes must be an int >= 0 (at most 2**62), got {nbytes!r}"
        )


def check_stream(kind: str, name: str, stream: object) -> None:
    """Raise `InvalidArgument` naming the ``kind`` of allocator and its memory's
    ``name`` unless ``stream`` is a `SyncStream` or None."""
    if stream is not None and not isinstance(stream, SyncStream):
        raise InvalidArgument(
            f"{kind} {name!r}: stream must be an aioep.SyncStream or None, "
            f"got {type(stream).__name__} {stream!r}"
        )


class Allocator(abc.ABC):
    """Hands out [`Buffer`][aioep.Buffer] objects in one kind of memory (ORT's ``OrtAllocator``).

    Backends implement [`_allocate`][aioep.abc.Allocator._allocate] and
    [`_free`][aioep.abc.Allocator._free]; this base class does the bookkeeping (live buffers,
    statistics, closing) and is thread-safe: buffers may be released from any thread.
    """

    def __init__(self, memory_info: MemoryInfo) -> None:
        self.memory_info = memory_info
        self._lock = threading.Lock()
        self._live_buffers = 0
        self._bytes_in_use = 0
        self._peak_bytes_in_use = 0
        self._num_allocs = 0
        self._closed = False
        self._retired = False
        self._close_callbacks: list[Callable[[], None]] = []
        # The environment and library that made this allocator (set by the environment);
        # None: a user's own allocator, whose buffers are producer-owned (see _ownership).
        self._origin: Origin | None = None

    # -- what a backend implements ---------------------------------------------------------
    @abc.abstractmethod
    def _allocate(self, nbytes: int, stream: SyncStream | None) -> int:
        """Reserve ``nbytes`` (> 0) and return the device address."""

    @abc.abstractmethod
    def _free(self, ptr: int, nbytes: int, stream: SyncStream | None) -> None:
        """Give back memory that [`_allocate`][aioep.abc.Allocator._allocate] returned; called from
        any thread."""

    def _close(self) -> None:
        """Release backend resources; called once, after the last buffer is gone."""

    # -- public API ------------------------------------------------------------------------
    def alloc(self, nbytes: int, *, stream: SyncStream | None = None) -> Buffer:
        """Allocate ``nbytes`` and return a buffer that frees itself when dropped.

        ``stream`` names the stream that will use the memory (stream-aware
        allocators such as the arena use it to decide which freed memory is safe).
        """
        check_nbytes("allocator", self.memory_info.name, nbytes)
        check_stream("allocator", self.memory_info.name, stream)
        if self._closed or self._retired:
            raise ClosedError(f"allocator {self.memory_info.name!r} is closed")
        return self._account(self._allocate(nbytes, stream) if nbytes else 0, nbytes, stream)

    def adopt(self, ptr: int, nbytes: int, *, stream: SyncStream | None = None) -> Buffer:
        """A buffer of this allocator over memory the backend reserved outside
        [`alloc`][aioep.Allocator.alloc].

        For backends whose runtime allocates memory itself (an output an EP's runtime
        made, say): the backend first takes ownership of it as
        [`_allocate`][aioep.abc.Allocator._allocate] would, then adopts it here, so that it counts
        as a live buffer (the library cannot be unregistered under it) and goes back through
        [`_free`][aioep.abc.Allocator._free] when dropped. Works on a closed allocator too:
        ``_free`` serves live buffers after closing.
        """
        check_nbytes("allocator", self.memory_info.name, nbytes)
        return self._account(ptr, nbytes, stream)

    def _account(self, ptr: int, nbytes: int, stream: SyncStream | None) -> Buffer:
        with self._lock:
            self._live_buffers += 1
            self._num_allocs += 1
            self._bytes_in_use += nbytes
            self._peak_bytes_in_use = max(self._peak_bytes_in_use, self._bytes_in_use)
        return Buffer(
            ptr,
            nbytes,
            self.memory_info,
            allocator=self,
            release=lambda: self._release(ptr, nbytes, stream),
            stream=stream,
        )

    def free(self, buffer: Buffer) -> None:
        """Free ``buffer`` now (it must come from this allocator)."""
        if not isinstance(buffer, Buffer):
            raise InvalidArgument(
                f"allocator {self.memory_info.name!r}: free(buffer) takes an aioep.Buffer, "
                f"got {type(buffer).__name__}"
            )
        if buffer.allocator is not self:
            raise InvalidArgument(
                f"allocator {self.memory_info.name!r} did not allocate {buffer!r}"
            )
        buffer.free()

    def _release(self, ptr: int, nbytes: int, stream: SyncStream | None) -> None:
        if nbytes:
            self._free(ptr, nbytes, stream)
        with self._lock:
            self._live_buffers -= 1
            self._bytes_in_use -= nbytes
            close_now = self._retired and self._live_buffers == 0
        if close_now:
            self.close()

    @property
    def live_buffers(self) -> int:
        """Buffers handed out and not yet freed."""
        return self._live_buffers

    @property
    def bytes_in_use(self) -> int:
        """The bytes that the live buffers asked for."""
        return self._bytes_in_use

    @property
    def closed(self) -> bool:
        """True after [`close`][aioep.Allocator.close]."""
        return self._closed

    def stats(self) -> dict[str, int]:
        """Counters in ORT's key names where one exists (``NumAllocs``, ``InUse`` ...)."""
        with self._lock:
            return {
                "NumAllocs": self._num_allocs,
                "InUse": self._bytes_in_use,
                "MaxInUse": self._peak_bytes_in_use,
                "LiveBuffers": self._live_buffers,
            }

    def retire(self) -> None:
        """Stop handing out memory and close once the last live buffer is freed."""
        with self._lock:
            self._retired = True
            close_now = self._live_buffers == 0
        if close_now:
            self.close()

    def close(self) -> None:
        """Stop handing out memory and release backend resources; idempotent.

        Live buffers stay valid: they are still returned through
        [`_free`][aioep.abc.Allocator._free].
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            callbacks, self._close_callbacks = self._close_callbacks, []
        try:
            self._close()
        finally:
            for fn in callbacks:
                fn()

    def add_close_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once this allocator has closed (at once if it already has).

        The environment uses it to close a factory only after the allocators that
        depend on it (a retired allocator closes when its last buffer is freed).
        """
        with self._lock:
            if not self._closed:
                self._close_callbacks.append(fn)
                return
        fn()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.memory_info.name!r} live={self._live_buffers}>"


def allocator_origin(allocator: Allocator) -> Origin | None:
    """The environment and library registration that made ``allocator`` (None for a user's
    own allocator, whose buffers are producer-owned)."""
    return allocator._origin


def set_origin(allocator: Allocator, origin: Origin | None) -> None:
    """Record who made ``allocator`` (the environment, when it creates or adopts one)."""
    allocator._origin = origin
