"""Awaitable device streams (ORT's ``OrtSyncStream``)."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import AsyncResource

from .._base.errors import ClosedError, InvalidArgument, NotImplementedByEp
from .notification import Notification, wait_blocking
from .routes import RouteCache
from .stream_impl import StreamImpl
from .wake import checkpoint

if TYPE_CHECKING:
    from .device import EpDevice

__all__ = [
    "SyncStream",
    "check_open",
    "has_passed",
    "has_waited_for",
    "note_enqueued",
    "sync_point",
]

_stream_uids = itertools.count(1)


class SyncStream(AsyncResource):
    """An in-order queue of device work (a ``CUstream`` on CUDA, a worker thread on sim).

    Create one with ``env.create_sync_stream(ep_device)`` or
    ``ep_device.create_sync_stream()``. ``await stream`` waits on the host for
    all work enqueued so far without blocking the event loop; ``async with``
    closes it after its pending work.
    """

    __slots__ = (
        "__weakref__",
        "_closed",
        "_dirty",
        "_ep_device",
        "_impl",
        "_on_close",
        "_routes",
        "_sync_clock",
        "_sync_id",
        "_tail",
        "_uid",
    )

    def __init__(
        self,
        impl: StreamImpl,
        ep_device: EpDevice,
        *,
        on_close: Callable[[SyncStream], None] | None = None,
    ) -> None:
        self._impl = impl
        self._ep_device = ep_device
        self._on_close = on_close
        self._closed = False
        self._dirty = False
        self._tail: Notification | None = None
        self._routes = RouteCache()  # copy_tensors routing for this stream
        # Sync-id bookkeeping for stream-aware allocators (ORT's stream_handles.cc): _sync_id
        # counts recorded points; _sync_clock maps a producer stream's _uid to the highest of
        # its sync ids that this stream has waited for.
        self._uid = next(_stream_uids)
        self._sync_id = 0
        self._sync_clock: dict[int, int] = {}

    @property
    def impl(self) -> StreamImpl:
        """The backend's stream object."""
        return self._impl

    @property
    def handle(self) -> int:
        """The native handle (the ``CUstream`` value on CUDA)."""
        return self._impl.handle

    @property
    def ep_device(self) -> EpDevice:
        """The EP device this stream runs on."""
        return self._ep_device

    @property
    def closed(self) -> bool:
        """True after [`aclose`][aioep.SyncStream.aclose]."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self!r} is closed")

    def record(self) -> Notification:
        """Return a notification activated at the current tail of this stream."""
        if self._closed:
            self._check_open()
        return Notification._recorded(self)

    def wait(self, notification: Notification) -> None:
        """Make later work on this stream wait, on the device, for ``notification``.

        Returns at once; the host never blocks. A notification that is already
        done needs no wait.
        """
        self._check_open()
        if not isinstance(notification, Notification):
            raise InvalidArgument(
                f"{self!r}.wait() needs an aioep.Notification, got {type(notification).__name__}"
            )
        if notification.done():
            self._merge_sync_table(notification)
            return
        try:
            notification.impl.wait_on_device(self._impl)
        except NotImplementedError as exc:
            raise NotImplementedByEp(
                f"{self!r} cannot wait on the device for {notification!r}: {exc}"
            ) from exc
        self._dirty = True
        self._merge_sync_table(notification)

    def _merge_sync_table(self, notification: Notification) -> None:
        # ORT's UpdateWithAwaitedNotification: keep the highest sync id seen per producer.
        for uid, sync_id in notification._sync_table.items():
            if sync_id > self._sync_clock.get(uid, 0):
                self._sync_clock[uid] = sync_id

    def done(self) -> bool:
        """True when all work enqueued so far has completed (never blocks).

        Raises:
            ClosedError: the stream was closed.
        """
        self._check_open()
        idle = self._impl.query()
        if idle is not None:
            return idle
        # The backend cannot query its stream: mark the tail and query the mark.
        if self._tail is None and not self._dirty:
            return True
        if self._dirty or self._tail is None:
            self.record()
        assert self._tail is not None
        return self._tail.done()

    async def synchronize(self) -> None:
        """Wait on the host, without blocking the loop, for all work enqueued so far.

        Raises [`DeviceError`][aioep.DeviceError] if work since the last recorded point failed.
        """
        await self

    def __await__(self) -> Generator[Any, None, None]:
        self._check_open()
        if self._impl.settled():
            # Idle, and nothing failed since the last mark: nothing to record or wait for.
            yield from checkpoint()
            return
        yield from self.record().__await__()

    async def aclose(self) -> None:
        """Wait for pending work, then release the stream; idempotent and shielded."""
        if self._closed:
            return
        with anyio.CancelScope(shield=True):
            # Work other tasks enqueue while this waits is waited for too: releasing the
            # stream (a backend may join its worker) must find it idle, not drain it on
            # the loop.
            while not self._closed:
                try:
                    mark = self.record()
                    await mark
                except Exception:
                    break
                if not self._dirty and self._tail is mark:
                    break
            self._release()

    def close(self) -> None:
        """Blocking form of [`aclose`][aioep.SyncStream.aclose], for synchronous code."""
        if self._closed:
            return
        try:
            wait_blocking(self.record())  # blocking on purpose: no event-loop warning
        except Exception:
            pass
        self._release()

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._routes.clear()  # the copy fast path finds no route on a closed stream
        try:
            self._impl.close()
        finally:
            if self._on_close is not None:
                self._on_close(self)

    async def __aenter__(self) -> SyncStream:
        self._check_open()
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<SyncStream {self._ep_device.ep_name}:{self.handle:#x} {state}>"


# What the layers above need of a stream's bookkeeping, by name (they are aioep's own, not
# part of the public SyncStream).


def check_open(stream: SyncStream) -> None:
    """Raise `ClosedError` if ``stream`` is closed."""
    if stream._closed:
        raise ClosedError(f"{stream!r} is closed")


def note_enqueued(stream: SyncStream) -> None:
    """Note that work was enqueued on ``stream`` behind its last recorded point (so the next
    query or await records a new one)."""
    stream._dirty = True


sync_point: Callable[[SyncStream], int] = operator.attrgetter("_sync_id")
"""The number of points ``stream`` has recorded so far: a stream-aware allocator tags freed
memory with it (ORT's sync ids). An attribute getter: the arena's release path calls it."""


def has_waited_for(stream: SyncStream, producer: SyncStream, sync_id: int) -> bool:
    """True when ``stream`` has waited on a notification ``producer`` recorded after its
    point ``sync_id`` (ORT's ``UpdateWithAwaitedNotification`` clock)."""
    return stream._sync_clock.get(producer._uid, 0) > sync_id


def has_passed(stream: SyncStream, sync_id: int) -> bool:
    """True when a notification ``stream`` recorded after its point ``sync_id`` is done."""
    tail = stream._tail
    return tail is not None and tail._sync_table.get(stream._uid, 0) > sync_id and tail.done()
