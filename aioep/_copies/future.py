"""Copy futures: the result of `aioep.copy_tensors`."""

from __future__ import annotations

import enum
import functools
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any

from .._base.errors import EpError, InvalidArgument
from .._base.validate import check_timeout
from .._streams.notification import Notification, device_error
from .._streams.stream_impl import call_reporting
from .._streams.wake import checkpoint, wait_for, warn_if_blocking_loop
from .._tensors.tensor import Tensor

__all__ = ["CopyFuture", "CopyStatus"]


class CopyStatus(enum.Enum):
    """Where a copy stands."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


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
        "_keepalive",
        "_lock",
        "_notification",
        "_on_done",
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
    ) -> None:
        """``keepalive``: every tensor to keep alive and pinned until the copies complete;
        ``dst``: what `result` returns; ``what``: the operation named in a failure's
        message (a string, or the `SyncStream` the copies were enqueued on)."""
        self._lock = threading.Lock()
        self._status = CopyStatus.PENDING
        self._error: EpError | None = None
        self._dst = list(dst)
        self._callbacks: list[Callable[[CopyFuture], None]] = []
        self._notification = notification
        self._what = what
        self._keepalive: list[Tensor] | None = None
        # [wake-ups of awaiting loops], run once the done-callbacks ran (then [None]). Held
        # in a box of its own: what runs them must not keep the future alive meanwhile.
        self._wakers: list[list[Callable[[], None]] | None] = [[]]
        self._on_done: Callable[[CopyFuture], None] | None = None
        self._calls_back = True
        if notification.impl.query():  # already complete (an idle stream ran it inline)
            self._settle()  # nobody else can see this future yet: no lock, no callbacks
            self._wakers[0] = None
            return
        self._keepalive = list(keepalive)
        for t in self._keepalive:
            t.buffer._pin()
        # If the backend cannot call back, completion is found by done(), await or wait().
        self._calls_back = notification.impl.add_done_callback(self._complete)
        if self._calls_back:
            # Runs after _complete returned: the awaiters resume once the done-callbacks ran,
            # and nothing on the completing thread holds the future any more.
            notification.impl.add_done_callback(
                functools.partial(_wake_awaiters, self._lock, self._wakers)
            )

    @classmethod
    def completed(
        cls, dst: Sequence[Tensor], notification: Notification, what: object = "copy_tensors"
    ) -> CopyFuture:
        """A future whose copies already ran (empty batches, inline copies)."""
        return cls((), dst, notification, what)

    @property
    def notification(self) -> Notification:
        """Completes with the copies; ``other_stream.wait(future.notification)`` orders after them."""
        return self._notification

    @property
    def status(self) -> CopyStatus:
        """PENDING, DONE or FAILED."""
        self.done()
        return self._status

    def _complete(self) -> None:
        with self._lock:
            if self._status is not CopyStatus.PENDING:
                return
            keepalive, self._keepalive = self._keepalive, None
            # Unpin before the status says done: whoever sees it done may free the buffers.
            for t in keepalive or ():
                t.buffer._unpin()
            del keepalive  # a completed future holds no source buffer
            callbacks, self._callbacks = self._callbacks, []
            self._settle()
            on_done, self._on_done = self._on_done, None
        if on_done is not None:
            call_reporting(on_done, self)
        callbacks.reverse()
        while callbacks:  # drop each before the next runs; one that raises is logged
            call_reporting(callbacks.pop(), self)
        if not self._calls_back:  # completed by done() on the awaiting thread itself
            _wake_awaiters(self._lock, self._wakers)

    def _finished(self) -> bool:
        """True once completed and its done-callbacks ran (completing it here if the copies
        are done and nobody else did)."""
        return self._wakers[0] is None or (self.done() and self._wakers[0] is None)

    def _when_done(self, fn: Callable[[CopyFuture], None]) -> None:
        """The copy machinery's own done-callback (one; not one a user waits behind)."""
        with self._lock:
            if self._status is CopyStatus.PENDING:
                self._on_done = fn
                return
        fn(self)

    def _settle(self) -> None:
        err = self._notification.impl.error()
        if err is not None:
            what = self._what
            if not isinstance(what, str):
                what = f"copy on {what!r}"
            self._error = device_error(err, what)
            self._status = CopyStatus.FAILED
        else:
            self._status = CopyStatus.DONE

    def done(self) -> bool:
        """True once the copies completed or failed."""
        if self._status is CopyStatus.PENDING and self._notification.impl.query():
            self._complete()
        return self._status is not CopyStatus.PENDING

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
        if not self._notification.impl.wait_on_host(timeout):
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
            if self._status is CopyStatus.PENDING:
                self._callbacks.append(fn)
                return
        call_reporting(fn, self)

    def _add_waker(self, wake: Callable[[], None]) -> bool:
        """Register a wake-up of an awaiting loop (``wait_for``'s ``register``); False when
        the backend cannot call back (``wait_for`` then polls `_finished`)."""
        if not self._calls_back:
            return False
        with self._lock:
            wakers = self._wakers[0]
            if wakers is not None:
                wakers.append(wake)
                return True
        wake()  # finished meanwhile
        return True

    def __await__(self) -> Generator[Any, None, list[Tensor]]:
        if self._wakers[0] is not None:
            # Woken by the thread that completes it, once its done-callbacks ran.
            yield from wait_for(self._add_waker, self._finished).__await__()
        else:
            yield from checkpoint()  # an await always yields once, even when done
        try:
            return self.result()
        finally:
            del self  # see result()

    def __repr__(self) -> str:
        n = len(self._dst)
        return f"<CopyFuture {self._status.value} {n} tensor{'s' if n != 1 else ''}>"


def _wake_awaiters(lock: threading.Lock, box: list[list[Callable[[], None]] | None]) -> None:
    """Wake the tasks awaiting a future (its box of wake-ups), once."""
    with lock:
        wakers, box[0] = box[0], None
    for wake in wakers or ():
        wake()  # a LoopWaker's wake: never raises
