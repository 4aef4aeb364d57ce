"""Copy futures: the result of :func:`aioep.copy_tensors`."""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Generator, Sequence
from typing import Any

from ._errors import EpError, InvalidArgument
from ._notification import Notification, _as_device_error
from ._tensor import Tensor
from ._wake import wait_for

__all__ = ["CopyFuture", "CopyStatus"]


class CopyStatus(enum.Enum):
    """Where a copy stands."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class CopyFuture:
    """A batch of tensor copies in flight.

    ``await future`` returns the destination tensors once the device has
    finished the copies (or raises :class:`DeviceError`). Every source and
    destination buffer is kept alive, and pinned against explicit frees, until
    then, even if the awaiting task is cancelled or every other reference is
    dropped: cancelling abandons the wait, the copy still runs its course.
    ``notification`` lets another stream wait for the copy on the device.
    """

    __slots__ = (
        "__weakref__",
        "_callbacks",
        "_dst",
        "_error",
        "_keepalive",
        "_lock",
        "_notification",
        "_status",
    )

    def __init__(
        self,
        keepalive: Sequence[Tensor],
        dst: Sequence[Tensor],
        notification: Notification,
    ) -> None:
        self._lock = threading.Lock()
        self._status = CopyStatus.PENDING
        self._error: EpError | None = None
        self._dst = list(dst)
        self._callbacks: list[Callable[[CopyFuture], None]] = []
        self._notification = notification
        self._keepalive: list[Tensor] | None = None
        if notification.impl.query():  # already complete (an idle stream ran it inline)
            self._complete()
            return
        self._keepalive = list(keepalive)
        for t in self._keepalive:
            t.buffer._pin()
        # If the backend cannot call back, completion is found by done(), await or wait().
        notification.impl.add_done_callback(self._complete)

    @classmethod
    def completed(cls, dst: Sequence[Tensor], notification: Notification) -> CopyFuture:
        """A future that is already done (empty batches, inline copies)."""
        return cls((), dst, notification)

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
            err = self._notification.impl.error()
            if err is not None:
                self._error = _as_device_error(err, self)
                self._error.__cause__ = err
                self._status = CopyStatus.FAILED
            else:
                self._status = CopyStatus.DONE
            keepalive, self._keepalive = self._keepalive, None
            callbacks, self._callbacks = self._callbacks, []
        for t in keepalive or ():
            t.buffer._unpin()
        del keepalive
        for fn in callbacks:
            fn(self)

    def done(self) -> bool:
        """True once the copies completed or failed."""
        if self._status is CopyStatus.PENDING and self._notification.impl.query():
            self._complete()
        return self._status is not CopyStatus.PENDING

    def result(self) -> list[Tensor]:
        """The destination tensors; raises the copy's error, or InvalidArgument if still pending."""
        if not self.done():
            raise InvalidArgument(f"{self!r} is still in flight; await it or call wait()")
        if self._error is not None:
            raise self._error
        return list(self._dst)

    def exception(self) -> EpError | None:
        """The copy's error once done, else None."""
        self.done()
        return self._error

    def wait(self, timeout: float | None = None) -> list[Tensor]:
        """Block the calling thread until done and return :meth:`result`.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the copy goes on).
        """
        if not self._notification.impl.wait_on_host(timeout):
            raise TimeoutError(f"{self!r} did not complete within {timeout} s")
        return self.result()

    def add_done_callback(self, fn: Callable[[CopyFuture], None]) -> None:
        """Call ``fn(future)`` when done, from the thread that completes it (at once if done)."""
        with self._lock:
            if self._status is CopyStatus.PENDING:
                self._callbacks.append(fn)
                return
        fn(self)

    async def _wait_async(self) -> list[Tensor]:
        impl = self._notification.impl
        await wait_for(impl.add_done_callback, impl.query)
        return self.result()

    def __await__(self) -> Generator[Any, None, list[Tensor]]:
        return self._wait_async().__await__()

    def __repr__(self) -> str:
        n = len(self._dst)
        return f"<CopyFuture {self._status.value} {n} tensor{'s' if n != 1 else ''}>"
