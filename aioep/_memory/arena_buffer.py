"""The arena's buffers: a release (``free()`` or the last reference going) hands the chunk
back to the arena without waiting for its lock (see ``arena``'s docstring for the threads).
"""

from __future__ import annotations

import bisect
import operator
import sys
import threading
from typing import Protocol

from .._plugin.buffer import Buffer
from .._plugin.stream import sync_point
from .arena_parking import MAX_PARKED
from .bfc import Chunk

__all__ = ["_LOCK_FREE", "_ArenaBuffer", "_release_locked"]

# The lock-free paths (see the arena's docstring) need the GIL.
_LOCK_FREE = bool(getattr(sys, "_is_gil_enabled", lambda: True)())
_PIN_LOCK = threading.Lock()  # guards the pin counts of arena buffers (held for an increment)
_insort = bisect.insort
_KEY = operator.attrgetter("key")


class _Arena(Protocol):
    """What a buffer's release touches of its arena (`ArenaAllocator`)."""

    _in_use: int
    _lazy: bool
    _returned: list[Chunk]

    def _settle(self) -> None: ...


class _ArenaBuffer(Buffer):
    """An arena buffer: its release (``free()`` or the last reference going) hands the
    chunk back to the arena.

    ``_chunk`` is the arena chunk until the release claims it (deleting the attribute:
    see the module docstring), so a chunk comes back exactly once however often, and
    from however many threads, the buffer is released. Each arena makes subclasses
    with its ``memory_info`` and ``allocator`` (and, for host requests, ``stream``);
    what is the same for every arena buffer is a class attribute here, so creating
    one sets five slots (six with a stream).
    """

    __slots__ = ("_chunk",)
    _chunk: Chunk
    allocator: _Arena  # type: ignore[assignment]
    readonly = False
    _pin_lock = _PIN_LOCK
    _on_release = None

    @property
    def _owner(self) -> object:  # type: ignore[override]
        # Views of host memory hold the region's backing object, so reading a freed
        # buffer through a view never touches unmapped memory.
        chunk: Chunk | None = getattr(self, "_chunk", None)
        return None if chunk is None else chunk.region.handle._owner  # type: ignore[attr-defined]

    def _release(self) -> None:
        """The arena buffers' release path (see ``Buffer._release``); it never waits for
        the arena's lock. A chunk with a home list (a size class's freed chunks that
        hits pop) goes back onto it; any other joins the arena's returned list, whose
        chunks the arena's next locked call takes back (``ArenaAllocator._drain``).
        Appending to a list needs no lock, and a release that runs inside the arena's
        own locked code (garbage collection calling ``__del__``) changes nothing under
        it. Memory that must go back to the base at once (a reserved region, a closing
        arena) is taken back now where the lock is free."""
        self._released = True
        try:
            chunk = self._chunk
            del self._chunk  # the claim: a second release finds no chunk
        except AttributeError:
            return
        arena = self.allocator
        # No longer in use (a plain int update: see the module docstring). Its requested
        # bytes stay counted until the chunk is handed out again or taken back.
        arena._in_use -= chunk.size
        home = chunk.home
        if home is not None and (not home or len(home) < MAX_PARKED):
            if home:
                # Smallest first, then lowest address (hits pop(0)), as best fit would
                # pick: one C call, which no thread switch splits.
                _insort(home, chunk, key=_KEY)
            else:
                home.append(chunk)
            if arena._lazy:
                return
            # The arena retired or closed meanwhile: its chunks take the locked way.
            try:
                home.remove(chunk)
            except ValueError:
                return  # the arena already took it back
        else:
            stream = chunk.tag
            if stream is not None:
                # The point in the stream's order after the work that used this chunk.
                chunk.mark = sync_point(stream)  # type: ignore[arg-type]
            if chunk.cls >= 0 and arena._lazy:
                arena._returned.append(chunk)
                return
        arena._returned.append(chunk)
        arena._settle()


def _release_locked(self: _ArenaBuffer) -> None:
    """``_ArenaBuffer._release`` without the GIL (see the module docstring): the claim
    takes the pin lock, and every chunk goes through the returned list."""
    with self._pin_lock:
        if self._released:
            return
        self._released = True
        chunk: Chunk | None = getattr(self, "_chunk", None)
        if chunk is None:
            return
        del self._chunk
    arena = self.allocator
    stream = chunk.tag
    if stream is not None:
        chunk.mark = sync_point(stream)  # type: ignore[arg-type]
    arena._returned.append(chunk)
    if chunk.cls < 0 or not arena._lazy:
        arena._settle()
