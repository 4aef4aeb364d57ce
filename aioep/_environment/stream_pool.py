"""The streams ``env.pooled_stream`` lends: a bounded set per EP device, shared round-robin.

A server whose requests outnumber the streams worth having borrows one per request with
``async with env.pooled_stream(ep_device) as stream``. Many requests share each stream, as
they share PyTorch's pooled CUDA streams: work on a stream runs in order anyway, and each
request awaits its own futures. So the streams (on the sim, one worker thread each) stay
bounded by the pool's size, not by the requests. Each borrower enqueues in an error lane of
its own (``aioep._plugin.thread_stream.ErrorLane``): a device error reaches only the work
that failed, never the next borrower's.

The registry keeps one `StreamRing` per EP device in the library that offers it,
so unregistering the library and closing the environment close the pooled streams first.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import Token
from types import TracebackType
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from .._base.errors import EpError, InUseError
from .._plugin.notification import Notification
from .._plugin.stream import SyncStream
from .._plugin.thread_stream import ErrorLane, HostNotification, enter_lane, leave_lane

if TYPE_CHECKING:
    from .._plugin.device import EpDevice
    from .._plugin.stream_impl import StreamImpl

__all__ = ["DEFAULT_STREAM_POOL_SIZE", "PooledStream", "Reservation", "StreamLease", "StreamRing"]

DEFAULT_STREAM_POOL_SIZE = 4
"""Streams per EP device behind ``env.pooled_stream`` unless ``Environment(stream_pool_size=)``
says otherwise (measured: ``benchmarks/stream_pool.py``)."""


class PooledStream(SyncStream):
    """A stream of the environment's pool: lent to any number of borrowers at once, and
    closed by the environment only (a borrower's ``aclose()`` is refused)."""

    __slots__ = ("_lent",)

    def __init__(
        self,
        impl: StreamImpl,
        ep_device: EpDevice,
        *,
        on_close: Callable[[SyncStream], None] | None = None,
    ) -> None:
        super().__init__(impl, ep_device, on_close=on_close)
        self._lent = 0

    @property
    def lent(self) -> int:
        """How many borrowers hold this stream now."""
        return self._lent

    @property
    def spare(self) -> bool:
        """Not lent, and all its work is complete: the pool may close it at once."""
        if self._lent or self.closed:
            return False
        try:
            return self.done()
        except EpError:  # a failed device: nothing on it will complete any more
            return True

    def borrowed(self) -> None:
        """Count a borrower (the registry calls it under the environment's lock)."""
        self._lent += 1

    def returned(self) -> None:
        """Count a borrower gone (the registry calls it under the environment's lock)."""
        self._lent = max(0, self._lent - 1)

    def _refuse(self, what: str) -> InUseError:
        return InUseError(
            f"{what} refused: {self!r} belongs to the environment's stream pool and other "
            "requests may share it; leaving 'async with env.pooled_stream(...)' gives it back, "
            "and the environment closes it"
        )

    async def aclose(self) -> None:
        """Refused: leaving the ``async with env.pooled_stream(...)`` block gives it back."""
        raise self._refuse("aclose()")

    def close(self) -> None:
        """Refused: leaving the ``async with env.pooled_stream(...)`` block gives it back."""
        raise self._refuse("close()")

    async def __aenter__(self) -> PooledStream:
        raise self._refuse("async with on it")

    def retire(self) -> None:
        """The pool's close: after its work (blocking, at once when it is idle), release it."""
        if self.closed:
            return
        if self.spare:
            self._release()
        else:
            SyncStream.close(self)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"pooled, lent to {self._lent}"
        return f"<SyncStream {self.ep_device.ep_name}:{self.handle:#x} {state}>"


class Reservation:
    """A place in a pool for a stream one borrower is making, off the event loop (a driver
    may wait in its stream creation); others who find every place taken wait for ``made``."""

    __slots__ = ("made", "ring")

    def __init__(self, ring: StreamRing) -> None:
        self.ring = ring
        self.made = HostNotification()

    def fill(self, stream: PooledStream | None) -> None:
        """The stream is made and joins the pool (None: making it failed; the place is free);
        the registry calls it under the environment's lock."""
        self.ring.filled(self, stream)
        self.made.set()


class StreamRing:
    """The pooled streams of one EP device: made on demand up to the pool's size, lent in
    turn (a stream no one holds first), so a lone request reuses one stream and a crowd
    shares ``size`` of them round-robin. The registry calls it under the environment's lock."""

    __slots__ = ("_cursor", "making", "streams")

    def __init__(self) -> None:
        self.streams: list[PooledStream] = []
        self.making: list[Reservation] = []
        self._cursor = 0

    def pick(self, size: int) -> PooledStream | Reservation | HostNotification:
        """The stream to lend next (the caller counts the borrower); else a new place for the
        caller to fill; else, while every place is being filled, what to await first."""
        streams = self.streams = [s for s in self.streams if not s.closed]
        n = len(streams)
        for k in range(n):
            i = (self._cursor + k) % n
            if not streams[i].lent:
                self._cursor = i + 1
                return streams[i]
        if n + len(self.making) < size:
            reservation = Reservation(self)
            self.making.append(reservation)
            return reservation
        if n:
            i = self._cursor % n
            self._cursor = i + 1
            return streams[i]
        return self.making[0].made

    def filled(self, reservation: Reservation, stream: PooledStream | None) -> None:
        """``reservation``'s stream is made (or not): it joins the ring in its place."""
        if reservation in self.making:
            self.making.remove(reservation)
        if stream is not None:
            self.streams.append(stream)


class StreamLease:
    """What ``env.pooled_stream(ep_device)`` returns: ``async with`` it to borrow a stream.

    Entering lends a pooled stream (making one first, off the event loop, while the pool
    has fewer than its size) and opens this task's error lane on it; leaving closes the lane
    and gives the stream back, without waiting for the work on it (await your futures).
    """

    __slots__ = ("_give_back", "_lend", "_make", "_stream", "_token")

    def __init__(
        self,
        lend: Callable[[], PooledStream | Reservation | HostNotification],
        make: Callable[[Reservation], None],
        give_back: Callable[[PooledStream], None],
    ) -> None:
        self._lend = lend
        self._make = make
        self._give_back = give_back
        self._stream: PooledStream | None = None
        self._token: Token[tuple[ErrorLane, ...]] | None = None

    async def __aenter__(self) -> SyncStream:
        if self._stream is not None:
            raise InUseError(
                f"this env.pooled_stream(...) lease already holds {self._stream!r}; call "
                "env.pooled_stream(...) again for another borrow"
            )
        while True:
            got = self._lend()
            if isinstance(got, PooledStream):
                break
            if isinstance(got, Reservation):
                # Made in a worker thread; the stream joins the pool even if this task is
                # cancelled meanwhile, and the next lend finds it.
                await anyio.to_thread.run_sync(self._make, got)
            else:
                await Notification(got)
        self._token = enter_lane(got.impl)
        self._stream = got
        return got

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stream, self._stream = self._stream, None
        token, self._token = self._token, None
        if token is not None:
            leave_lane(token)
        if stream is not None:
            self._give_back(stream)

    def __repr__(self) -> str:
        held = "idle" if self._stream is None else f"holding {self._stream!r}"
        return f"<StreamLease {held}>"
