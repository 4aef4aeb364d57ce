"""Awaitable notifications: a point in a stream's order (ORT's ``OrtSyncNotification``)."""

from __future__ import annotations

import asyncio
import functools
import traceback
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from .._base.errors import DeviceError, EpError, InvalidArgument
from .._base.validate import check_timeout, describe
from .stream_impl import NotificationImpl, StreamImpl
from .thread_stream import ThreadStream
from .wake import checkpoint, poll, wait_for, waker_for, warn_if_blocking_loop

if TYPE_CHECKING:
    from .stream import SyncStream

__all__ = ["Notification", "device_error", "notification_of", "wait_blocking"]


class Notification:
    """A point in a stream's order that can be awaited on the host or waited on by another stream.

    Get one from [`SyncStream.record`][aioep.SyncStream.record] or
    [`CopyFuture.notification`][aioep.CopyFuture.notification]. ``await notification`` waits without
    blocking the event loop; cancelling that await abandons the wait, never the device work, which
    still runs its course. ``wait(timeout)`` is the blocking form for synchronous code.
    """

    __slots__ = ("__weakref__", "_impl", "_stream", "_sync_table")

    def __init__(self, impl: NotificationImpl, stream: SyncStream | None = None) -> None:
        if not isinstance(impl, NotificationImpl):
            raise InvalidArgument(
                f"Notification: impl must be an aioep.abc.NotificationImpl, got {describe(impl)}"
            )
        if stream is not None and not isinstance(getattr(stream, "_impl", None), StreamImpl):
            raise InvalidArgument(
                f"Notification: stream must be an aioep.SyncStream or None, got {describe(stream)}"
            )
        self._impl = impl
        self._stream = stream
        # Producer stream uid -> sync id this point stands for (set on activate; see SyncStream).
        self._sync_table: dict[int, int] = {}

    @classmethod
    def _recorded(cls, stream: SyncStream) -> Notification:
        """A new notification of ``stream``'s backend stream, activated: `SyncStream.record`
        (the caller checked the stream is open)."""
        backend = stream._impl
        note = _new_notification(cls)
        create = backend.create_notification
        if getattr(create, "__func__", None) is _THREAD_STREAM_CREATE:
            # A ThreadStream's own notification, made in its activated state at once.
            impl: NotificationImpl = backend._new_mark()  # type: ignore[attr-defined]
            fresh = True
        else:
            impl = create()
            fresh = False
        note._impl = impl
        note._stream = stream
        stream._dirty = False
        stream._tail = note
        stream._sync_id = sync_id = stream._sync_id + 1
        clock = stream._sync_clock
        note._sync_table = {**clock, stream._uid: sync_id} if clock else {stream._uid: sync_id}
        if fresh:
            backend._enqueue_signal(impl, 1)  # type: ignore[attr-defined]
        else:
            impl.activate()
        return note

    @property
    def impl(self) -> NotificationImpl:
        """The backend's notification object."""
        return self._impl

    @property
    def stream(self) -> SyncStream | None:
        """The stream this notification marks a point in (None for un-streamed copies)."""
        return self._stream

    def activate(self) -> None:
        """Move the mark to the current tail of the producing stream (like re-recording an event)."""
        stream = self._stream
        if stream is not None:
            stream._check_open()
            stream._dirty = False
            stream._tail = self
            stream._sync_id = sync_id = stream._sync_id + 1
            clock = stream._sync_clock
            self._sync_table = {**clock, stream._uid: sync_id} if clock else {stream._uid: sync_id}
        self._impl.activate()

    def wait_on_device(self, stream: SyncStream) -> None:
        """Make work enqueued later on ``stream`` wait for this point; returns at once."""
        # SyncStream lives in the layer above: recognise it by the backend stream it wraps.
        if not isinstance(getattr(stream, "_impl", None), StreamImpl) or not callable(
            getattr(stream, "wait", None)
        ):
            raise InvalidArgument(
                f"Notification.wait_on_device: stream must be an aioep.SyncStream, got "
                f"{describe(stream)}"
            )
        stream.wait(self)

    def done(self) -> bool:
        """True once the stream has passed this point."""
        return self._impl.query()

    def exception(self) -> EpError | None:
        """The device failure of the work before this point, once done; else None."""
        err = self._impl.error() if self._impl.query() else None
        if err is None:
            return None
        return device_error(err, f"device work before {self!r}")

    def wait(self, timeout: float | None = None) -> None:
        """Block the calling thread until done.

        For synchronous code: on a thread that runs an event loop, while the work is
        pending, it warns (``RuntimeWarning``): ``await notification`` instead.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
            DeviceError: the work before this point failed.
            InvalidArgument: ``timeout`` is not None or a number >= 0 (inf waits forever).
        """
        timeout = check_timeout("Notification.wait", timeout)
        warn_if_blocking_loop(self, self._impl.query)
        wait_blocking(self, timeout)

    def _raise_if_failed(self) -> None:
        err = self._impl.error()
        if err is not None:
            raise device_error(err, f"device work before {self!r}")

    def __await__(self) -> Generator[Any, None, None]:
        impl = self._impl
        if impl.query():
            yield from checkpoint()  # an await always yields once, even when done
        else:
            loop = _get_running_loop()
            if loop is None:  # trio (through anyio): wait_for's general path
                yield from wait_for(impl.add_done_callback, impl.query).__await__()
            else:
                # asyncio, inlined (what wait_for does): park on a loop future that the
                # completing thread's wake-up resolves.
                waiter = loop.create_future()
                if impl.add_done_callback(_partial(waker_for(loop).wake, waiter)):
                    yield from waiter
                else:  # the backend cannot call back: poll
                    yield from poll(impl.query).__await__()
        if impl.error() is not None:
            self._raise_if_failed()

    def __repr__(self) -> str:
        where = f" on {self._stream!r}" if self._stream is not None else ""
        return f"<Notification {'done' if self.done() else 'pending'}{where}>"


_new_notification = Notification.__new__
_THREAD_STREAM_CREATE = ThreadStream.create_notification
_get_running_loop = asyncio._get_running_loop
_partial = functools.partial
_NO_SYNC: dict[int, int] = {}  # the sync table of a mark never activated on a stream (read-only)


def notification_of(impl: NotificationImpl, stream: SyncStream | None = None) -> Notification:
    """A notification over ``impl`` (of ``stream``) that aioep made itself: the checks of
    `Notification`'s constructor are known to pass (the copy paths' form)."""
    note = _new_notification(Notification)
    note._impl = impl
    note._stream = stream
    note._sync_table = _NO_SYNC
    return note


def wait_blocking(notification: Notification, timeout: float | None = None) -> None:
    """`Notification.wait` without its event-loop warning, for aioep's own synchronous
    paths that block on purpose (a blocking close, a DLPack export of host memory).

    ``timeout`` is already checked (None, or seconds >= 0).
    """
    if not notification.impl.wait_on_host(timeout):
        raise TimeoutError(f"{notification!r} not reached within {timeout} s")
    notification._raise_if_failed()


def device_error(err: BaseException, what: str) -> DeviceError:
    """The one translation of a failure a backend reported for device work.

    Returns a new `DeviceError` (never ``err`` itself) with the backend's
    message and, when the backend raised an `EpError`, its code; its
    ``__cause__`` is ``err``. The locals of the failed work's finished frames in
    ``err``'s traceback are cleared (file and line stay), so the error does not
    keep that work's tensors alive.
    """
    _clear_frames(err)
    code = err.code if isinstance(err, EpError) else None
    error = DeviceError(f"{what} failed: {type(err).__name__}: {err}", code=code)
    error.__cause__ = err
    return error


def _clear_frames(err: BaseException) -> None:
    seen: set[int] = set()
    exc: BaseException | None = err
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)  # frames still running are skipped
        exc = exc.__cause__ or exc.__context__
