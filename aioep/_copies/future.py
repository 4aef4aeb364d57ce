"""Copy futures: the result of `aioep.copy_tensors`."""

from __future__ import annotations

import asyncio
import enum
import functools
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any

from .._base.errors import EpError, InvalidArgument
from .._base.validate import check_timeout
from .._plugin.buffer import pin_for, unpin
from .._plugin.notification import Notification, device_error
from .._plugin.stream_impl import NotificationImpl, StreamImpl, call_reporting
from .._plugin.tensor import Tensor
from .._plugin.wake import (
    checkpoint,
    flush_held_wakeups,
    wait_for,
    waker_for,
    warn_if_blocking_loop,
)

__all__ = ["COMPLETED", "Completed", "CopyFuture", "CopyStatus", "done_future"]


class CopyStatus(enum.Enum):
    """Where a copy stands."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


_PENDING, _DONE, _FAILED = CopyStatus.PENDING, CopyStatus.DONE, CopyStatus.FAILED
_get_running_loop = asyncio._get_running_loop
_partial = functools.partial
_DONE_LOCK = threading.Lock()  # the lock of futures made complete (it guards no transition)


class CopyFuture:
    """A batch of tensor copies in flight.

    ``await future`` returns the destination tensors once the device has
    finished the copies (or raises [`DeviceError`][aioep.DeviceError]). Every source and
    destination buffer is kept alive, and pinned against explicit frees, until
    then, even if the awaiting task is cancelled or every other reference is
    dropped: cancelling abandons the wait, the copy still runs its course.
    ``notification`` lets another stream wait for the copy on the device.
    """

    __slots__ = (
        "__weakref__",
        "_callbacks",
        "_calls_back",
        "_dst",
        "_error",
        "_impl",
        "_keepalive",
        "_lock",
        "_notification",
        "_on_done",
        "_pinned",
        "_status",
        "_wakers",
        "_what",
    )

    def __init__(
        self,
        keepalive: Sequence[Tensor],
        dst: Sequence[Tensor],
        notification: Notification,
        what: object = "copy_tensors",
        *,
        on_done: Callable[[CopyFuture], None] | None = None,
        pinned: list[Tensor] | None = None,
    ) -> None:
        """``keepalive``: every tensor to keep alive until the copies complete (a list is
        taken over); ``dst``: what `result` returns (kept for good); ``what``: the
        operation named in a failure's message (a string, or the `SyncStream` the copies
        were enqueued on); ``on_done``: the copy machinery's own done-callback, called once
        when the copies complete (at once if they already did), before any of the user's;
        ``pinned``: the tensors whose buffers to pin against `Buffer.free` meanwhile (by
        default every tensor of ``keepalive``; tensors nobody else holds need none)."""
        self._lock = threading.Lock()
        self._status = _PENDING
        self._error: EpError | None = None
        self._dst = list(dst)
        self._callbacks: list[Callable[[CopyFuture], None]] | None = None
        self._notification = notification
        self._impl = impl = notification.impl
        self._what = what
        self._keepalive: list[Tensor] | None = None
        self._pinned: list[Tensor] | None = None
        self._on_done = on_done
        # Wake-ups of awaiting loops, run once the done-callbacks ran; None from then on.
        self._wakers: list[Callable[[], None]] | None = []
        self._calls_back = True
        if impl.query():  # already complete (an idle stream ran it inline)
            self._settle()  # nobody else can see this future yet: no lock, no callbacks
            self._wakers = None
            self._on_done = None
            if on_done is not None:
                on_done(self)
            return
        keep = keepalive if type(keepalive) is list else list(keepalive)
        if pinned is None:
            pinned = keep
        if pinned:
            # Pinned, and their memory's last use noted (a DLPack export orders after it).
            pin_for(pinned, notification)
            self._pinned = pinned
        self._keepalive = keep
        # The completing thread reaches the future through a box it empties: once it has
        # completed the future it holds no reference to it when it wakes the awaiters.
        # If the backend cannot call back, done(), await or wait() find the completion.
        self._calls_back = impl.add_done_callback(_partial(_on_mark, [self]))

    @classmethod
    def completed(
        cls, dst: list[Tensor], notification: Notification, what: object = "copy_tensors"
    ) -> CopyFuture:
        """A future whose copies already ran (empty batches, inline copies); ``dst`` is
        taken over."""
        future = _new_future(cls)
        future._lock = _DONE_LOCK
        future._dst = dst
        future._callbacks = None
        future._notification = notification
        future._impl = notification.impl
        future._what = what
        future._keepalive = None
        future._pinned = None
        future._on_done = None
        future._wakers = None
        future._calls_back = True
        future._error = None
        if future._impl.error() is None:
            future._status = _DONE
        else:
            future._settle()
        return future

    @property
    def notification(self) -> Notification:
        """Completes with the copies; ``other_stream.wait(future.notification)`` orders after them."""
        return self._notification

    @property
    def status(self) -> CopyStatus:
        """PENDING, DONE or FAILED."""
        self.done()
        return self._status

    def _complete(self) -> list[Callable[[], None]] | None:
        """Complete the future once (unpin, settle, run the done-callbacks); returns the
        wake-ups of its awaiters for the caller to run, or None if it was complete."""
        lock = self._lock
        lock.acquire()
        try:
            if self._status is not _PENDING:
                return None
            pinned = self._pinned
            if pinned is not None:
                # Unpin before the status says done: whoever sees it done may free them.
                self._pinned = None
                unpin(pinned)
                del pinned
            self._keepalive = None  # a completed future holds no source buffer
            if self._impl.error() is None:
                self._status = _DONE
            else:
                self._settle()
            callbacks = self._callbacks
            if callbacks is None:  # nothing to run first: the awaiters may go now
                wakers, self._wakers = self._wakers, None
            else:
                self._callbacks = None
            on_done = self._on_done
            if on_done is not None:
                self._on_done = None
        finally:
            lock.release()
        if on_done is not None:
            call_reporting(on_done, self)
        if callbacks is None:
            return wakers
        # A callback may take long or block: loops this thread owes a wake-up for earlier
        # completions are woken first, never held behind it.
        flush_held_wakeups()
        callbacks.reverse()
        while callbacks:  # drop each before the next runs; one that raises is logged
            call_reporting(callbacks.pop(), self)
        lock.acquire()
        wakers, self._wakers = self._wakers, None
        lock.release()
        return wakers

    def _finished(self) -> bool:
        """True once completed and its done-callbacks ran (completing it here if the copies
        are done and nobody else did)."""
        return self._wakers is None or (self.done() and self._wakers is None)

    def _settle(self) -> None:
        err = self._impl.error()
        if err is not None:
            what = self._what
            if not isinstance(what, str):
                what = f"copy on {what!r}"
            self._error = device_error(err, what)
            self._status = _FAILED
        else:
            self._status = _DONE

    def done(self) -> bool:
        """True once the copies completed or failed."""
        if self._status is _PENDING:
            if not self._impl.query():
                return False
            wakers = self._complete()
            if wakers:
                for wake in wakers:
                    wake()  # a LoopWaker's wake: never raises
        return True

    def result(self) -> list[Tensor]:
        """The destination tensors; raises the copy's error, or InvalidArgument if still pending."""
        if not self.done():
            raise InvalidArgument(f"{self!r} is still in flight; await it or call wait()")
        error = self._error
        if error is None:
            return list(self._dst)
        try:
            # A fresh traceback per raise, which keeps this frame: clear its locals, or the
            # error and this future would form a cycle that only the gc breaks.
            raise error.with_traceback(None)
        finally:
            del error, self

    def exception(self) -> EpError | None:
        """The copy's error once done, else None."""
        self.done()
        return self._error

    def wait(self, timeout: float | None = None) -> list[Tensor]:
        """Block the calling thread until done and return [`result`][aioep.CopyFuture.result].

        For synchronous code: on a thread that runs an event loop, while the copy is
        pending, it warns (``RuntimeWarning``): ``await future`` instead.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the copy goes on).
            InvalidArgument: ``timeout`` is not None or a number >= 0 (inf waits forever).
        """
        timeout = check_timeout("CopyFuture.wait", timeout)
        warn_if_blocking_loop(self, self.done)
        if not self._impl.wait_on_host(timeout):
            raise TimeoutError(f"{self!r} did not complete within {timeout} s")
        try:
            return self.result()
        finally:
            del self  # see result()

    def add_done_callback(self, fn: Callable[[CopyFuture], None]) -> None:
        """Call ``fn(future)`` when done, from the thread that completes it (at once if done).

        An exception ``fn`` raises is logged (logger ``aioep``), never raised here or on the
        thread that completes the copy.
        """
        if not callable(fn):
            raise InvalidArgument(f"add_done_callback: fn must be callable, got {fn!r}")
        with self._lock:
            if self._status is _PENDING:
                if self._callbacks is None:
                    self._callbacks = [fn]
                else:
                    self._callbacks.append(fn)
                return
        call_reporting(fn, self)

    def _add_waker(self, wake: Callable[[], None]) -> bool:
        """Register a wake-up of an awaiting loop (``wait_for``'s ``register``); False when
        the backend cannot call back (``wait_for`` then polls `_finished`)."""
        if not self._calls_back:
            return False
        lock = self._lock
        lock.acquire()
        wakers = self._wakers
        if wakers is not None:
            wakers.append(wake)
            lock.release()
            return True
        lock.release()
        wake()  # finished meanwhile
        return True

    def __await__(self) -> Generator[Any, None, list[Tensor]]:
        if self._wakers is not None:
            # Woken by the thread that completes it, once its done-callbacks ran.
            loop = _get_running_loop()
            if loop is not None and self._calls_back:
                # asyncio, inlined (what wait_for does): park on a loop future that the
                # completing thread's wake-up resolves.
                waiter = loop.create_future()
                wake = _partial(waker_for(loop).wake, waiter)
                lock = self._lock
                lock.acquire()
                wakers = self._wakers
                if wakers is not None:
                    wakers.append(wake)
                lock.release()
                if wakers is not None:
                    yield from waiter
                else:
                    yield  # finished meanwhile: an await still yields once
            else:
                yield from wait_for(self._add_waker, self._finished).__await__()
        elif _get_running_loop() is not None:
            yield  # an await always yields once, even when done (asyncio's bare yield)
        else:
            yield from checkpoint()
        if self._error is None and self._status is _DONE:
            return list(self._dst)
        try:
            return self.result()
        finally:
            del self  # see result()

    def __repr__(self) -> str:
        n = len(self._dst)
        return f"<CopyFuture {self._status.value} {n} tensor{'s' if n != 1 else ''}>"


_new_future = CopyFuture.__new__


def _on_mark(box: list[CopyFuture]) -> None:
    """A copy's notification callback (on the thread that completes the copies): complete
    the future, let go of it, then wake the tasks awaiting it."""
    try:
        future = box.pop()
    except IndexError:
        return
    wakers = future._complete()
    del future
    if wakers:
        for wake in wakers:
            wake()  # a LoopWaker's wake: never raises


class Completed(NotificationImpl):
    """The notification of a copy that finished before its future was made (inline or empty)."""

    __slots__ = ("_error",)

    def __init__(self, error: BaseException | None) -> None:
        self._error = error

    def activate(self) -> None:
        pass

    def wait_on_device(self, stream: StreamImpl) -> None:
        pass  # already complete: nothing to order after

    def query(self) -> bool:
        return True

    def error(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[[], None]) -> bool:
        fn()
        return True

    def wait_on_host(self, timeout: float | None) -> bool:
        return True


COMPLETED = Notification(Completed(None))
"""The notification of every copy that finished without error before its future was made."""


class _DoneFuture(CopyFuture):
    """A future of copies that ran without error before it was made (inline, or an empty
    batch): all it holds of its own are the destinations; the rest is the class's."""

    __slots__ = ()

    # Shadowing the slots: read-only here, which is what a completed future needs.
    _lock = _DONE_LOCK
    _status = _DONE
    _error = None
    _callbacks = None
    _notification = COMPLETED
    _impl = COMPLETED.impl
    _what = "copy_tensors"
    _keepalive = None
    _pinned = None
    _on_done = None
    _wakers = None
    _calls_back = True


def done_future(dst: list[Tensor]) -> CopyFuture:
    """The future of copies that already ran without error; ``dst`` is taken over."""
    future = _new_future(_DoneFuture)
    future._dst = dst
    return future
