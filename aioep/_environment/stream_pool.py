"""The streams ``env.pooled_stream`` lends: a bounded set per EP device, shared round-robin.

A server whose requests outnumber the streams worth having borrows one per request with
``async with env.pooled_stream(ep_device) as stream``. Many requests share each stream, as
they share PyTorch's pooled CUDA streams: work on a stream runs in order anyway, and each
request awaits its own futures. So the streams (on the sim, one worker thread each) stay
bounded by the pool's size, not by the requests. Each borrower enqueues in an error lane of
its own (``aioep._streams.stream_impl.ErrorLane``): a device error reaches only the work
that failed, never the next borrower's.

The registry keeps one :class:`StreamRing` per EP device in the library that offers it,
so unregistering the library and closing the environment close the pooled streams first.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import Token
from types import TracebackType
from typing import TYPE_CHECKING

from .._base.errors import EpError, InUseError
from .._streams.stream import SyncStream
from .._streams.stream_impl import ErrorLane, enter_lane, leave_lane

if TYPE_CHECKING:
    from .._devices.device import EpDevice
    from .._streams.stream_impl import StreamImpl

__all__ = ["DEFAULT_STREAM_POOL_SIZE", "PooledStream", "StreamLease", "StreamRing"]

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


class StreamRing:
    """The pooled streams of one EP device: made on demand up to the pool's size, lent in
    turn (a stream no one holds first), so a lone request reuses one stream and a crowd
    shares ``size`` of them round-robin."""

    __slots__ = ("_cursor", "streams")

    def __init__(self) -> None:
        self.streams: list[PooledStream] = []
        self._cursor = 0

    def pick(self, size: int, make: Callable[[], PooledStream]) -> PooledStream:
        """The stream to lend next (the caller counts the borrower)."""
        streams = self.streams = [s for s in self.streams if not s.closed]
        n = len(streams)
        for k in range(n):
            i = (self._cursor + k) % n
            if not streams[i].lent:
                self._cursor = i + 1
                return streams[i]
        if n < size:
            stream = make()
            streams.append(stream)
            self._cursor = 0
            return stream
        i = self._cursor % n
        self._cursor = i + 1
        return streams[i]


class StreamLease:
    """What ``env.pooled_stream(ep_device)`` returns: ``async with`` it to borrow a stream.

    Entering lends a pooled stream and opens this task's error lane on it; leaving closes the
    lane and gives the stream back, without waiting for the work on it (await your futures).
    """

    __slots__ = ("_give_back", "_lend", "_stream", "_token")

    def __init__(
        self,
        lend: Callable[[], PooledStream],
        give_back: Callable[[PooledStream], None],
    ) -> None:
        self._lend = lend
        self._give_back = give_back
        self._stream: PooledStream | None = None
        self._token: Token[tuple[ErrorLane, ...]] | None = None

    async def __aenter__(self) -> SyncStream:
        if self._stream is not None:
            raise InUseError(
                f"this env.pooled_stream(...) lease already holds {self._stream!r}; call "
                "env.pooled_stream(...) again for another borrow"
            )
        stream = self._lend()
        self._token = enter_lane(stream.impl)
        self._stream = stream
        return stream

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
