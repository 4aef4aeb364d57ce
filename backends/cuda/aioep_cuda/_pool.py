"""Caching pools for memory whose release synchronises the device.

``cuMemFreeHost`` (pinned host memory) and ``cuMemFree`` (``cuMemAlloc`` device memory)
wait until every stream of the context is idle, and meanwhile the driver holds back other
threads' calls on that context (``cuStreamCreate``, ``cuEventRecord``...). While an
environment runs the backend never makes such a call: freed blocks go back to a pool,
like PyTorch's caching host allocator, and are reused for later allocations of their size
class once the stream work that used them has completed (an event recorded on each of
those streams, checked with ``cuEventQuery``: nothing waits). The driver gets the memory
back only when the device's shared state is released at close, off the event loop, after
every stream is idle (`CachingPool.release_all`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from aioep import DeviceError

from ._driver import driver

__all__ = ["Block", "CachingPool", "EventSink", "Marker", "PoolHome", "size_class"]


class Marker(Protocol):
    """A stream a block was used on (``_stream.CudaStream``): ``mark()`` records a pooled
    event on it now, or returns None once the stream is closed."""

    def mark(self) -> Any | None: ...


class EventSink(Protocol):
    """Where a pool gives back the events of its blocks (the device's event pool)."""

    def give(self, event: Any) -> None: ...


class PoolHome(Protocol):
    """What a pool needs of the device state it belongs to (``_device.SharedDevice``): its
    ordinal (for messages), its event pool, and a call when memory comes back (the device
    state may then be released)."""

    @property
    def ordinal(self) -> int: ...
    @property
    def events(self) -> EventSink: ...
    def maybe_release(self) -> None: ...


def size_class(nbytes: int, *, coarse_above: int = 1 << 20, coarse: int = 1 << 20) -> int:
    """The size a request is served with: a power of two from 512 B, then multiples of
    ``coarse`` above ``coarse_above`` (large blocks waste at most ``coarse`` bytes)."""
    if nbytes > coarse_above:
        return -(-nbytes // coarse) * coarse
    size = 512
    while size < nbytes:
        size <<= 1
    return size


class Block:
    """One block of a `CachingPool`: ``ptr`` and its ``size`` (its size class).

    While idle in the pool, ``events`` mark the stream work that last used it; the block
    is handed out again only once every one of them has completed.
    """

    __slots__ = ("events", "ptr", "size")

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr = ptr
        self.size = size
        self.events: list[Any] = []

    def __repr__(self) -> str:
        return f"<Block {self.ptr:#x} {self.size} bytes>"


class CachingPool:
    """Size-class free lists over an allocate / release function pair.

    Args:
        shared: the device state whose context and event pool the blocks use.
        what: a name for messages (``"pinned"``).
        allocate: ``allocate(size) -> ptr`` (raises `DeviceError` on failure).
        release: ``release(ptr)``: the synchronising free, called by `release_all` only.
        limit: most bytes the pool holds (in use and idle together); -1: no limit.
        round: ``round(nbytes) -> size`` of the block that serves a request.
    """

    def __init__(
        self,
        shared: PoolHome,
        what: str,
        allocate: Callable[[int], int],
        release: Callable[[int], None],
        *,
        limit: int = -1,
        round: Callable[[int], int] = size_class,
    ) -> None:
        self._shared = shared
        self.what = what
        self._allocate = allocate
        self._release = release
        self.limit = limit
        self._round = round
        self._lock = threading.RLock()  # re-entered by a finalizer (a give) run by a GC in here
        self._idle: dict[int, list[Block]] = {}
        self._held = 0  # bytes of every block the pool made and has not released
        self._in_use = 0
        self.allocations = 0
        """Blocks made with the driver so far (diagnostics: reuse does not count)."""

    @property
    def held_bytes(self) -> int:
        """Bytes of every block the pool made (in use and idle)."""
        return self._held

    @property
    def in_use_bytes(self) -> int:
        """Bytes of the blocks handed out and not given back."""
        return self._in_use

    def take(self, nbytes: int) -> Block:
        """A block of at least ``nbytes``: an idle one whose last users are done, else a new one.

        Raises:
            DeviceError: the driver has no memory left, or the pool's limit is reached and no
                idle block of at least that size is free to reuse.
        """
        size = self._round(max(nbytes, 1))
        with self._lock:
            block = self._reuse(self._idle.get(size, ()))
            # A new block's bytes count against the limit from here on, before the driver
            # call (made without the lock): threads allocating at once cannot overshoot.
            allocate = block is None and not 0 <= self.limit < self._held + size
            if allocate:
                self._held += size
        refused = ""
        if allocate:
            try:
                ptr = self._allocate(size)
            except DeviceError as exc:
                ptr, refused = 0, str(exc)
            with self._lock:
                if ptr:
                    block = Block(ptr, size)
                    self.allocations += 1
                else:
                    self._held -= size
        if block is None:
            with self._lock:  # best fit among larger idle blocks
                bigger = [b for s, blocks in sorted(self._idle.items()) if s > size for b in blocks]
                block = self._reuse(bigger)
            if block is None:
                why = refused or f"its limit of {self.limit} bytes refused more"
                raise DeviceError(
                    f"CUDA {self.what} pool (device {self._shared.ordinal}): {nbytes} bytes "
                    f"could not be allocated: {self._held} bytes are held ({self._in_use} in "
                    f"use), and {why}"
                )
        with self._lock:
            self._in_use += block.size
        return block

    def _reuse(self, candidates: Iterable[Block]) -> Block | None:
        # Called with the lock held: the first candidate whose events all completed.
        for block in candidates:
            if self._ready(block):
                self._idle[block.size].remove(block)
                return block
        return None

    def _ready(self, block: Block) -> bool:
        drv = driver()
        while block.events:
            err = drv.cuEventQuery(block.events[-1])[0]
            if err == drv.CUresult.CUDA_ERROR_NOT_READY:
                return False
            # Complete, or the context is broken (nothing will run on it again).
            self._shared.events.give(block.events.pop())
        return True

    def give(self, block: Block, after_streams: Iterable[Marker] = ()) -> None:
        """Return ``block``; it is reused only after the work now enqueued on each of
        ``after_streams`` has completed (an event is recorded on each; nothing waits)."""
        events = []
        for stream in after_streams:
            event = stream.mark()
            if event is not None:
                events.append(event)
        with self._lock:
            block.events = events
            self._in_use -= block.size
            self._idle.setdefault(block.size, []).append(block)
        if not self._in_use:
            self._shared.maybe_release()

    def release_all(self) -> None:
        """Give every idle block back to the driver (synchronising: at close, off the loop,
        after every stream is idle). Blocks still in use stay with their holders."""
        with self._lock:
            blocks = [b for bs in self._idle.values() for b in bs]
            self._idle.clear()
            for b in blocks:
                self._held -= b.size
        for b in blocks:
            for event in b.events:
                self._shared.events.give(event)
            b.events = []
            try:
                self._release(b.ptr)
            except Exception:  # a broken context: the memory goes with it
                pass
