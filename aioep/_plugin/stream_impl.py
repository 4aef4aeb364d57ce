"""What a backend implements for streams and notifications (ORT's ``OrtSyncStreamImpl`` and
``OrtSyncNotificationImpl``), and how done-callbacks run (`ThreadStream`, a ready
implementation whose device work runs in order on one worker thread, is in ``thread_stream``).

The contract is small. A backend stream enqueues work (its data transfer does
that) and makes notifications; a notification marks a point in its stream's
order, can make another stream wait for that point on the device, and reports
completion from any thread through `NotificationImpl.add_done_callback`.
The core turns those callbacks into wake-ups on the right event loop.
"""

from __future__ import annotations

import abc
import logging
import threading
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["NotificationImpl", "StreamImpl", "call_reporting", "run_callbacks"]

_log = logging.getLogger("aioep")


class NotificationImpl(abc.ABC):
    """A point in a stream's order, signalled when the stream passes it."""

    @abc.abstractmethod
    def activate(self) -> None:
        """Mark the current tail of the producing stream (re-activating moves the mark)."""

    @abc.abstractmethod
    def wait_on_device(self, stream: StreamImpl) -> None:
        """Make work enqueued later on ``stream`` wait for this point, without blocking the host.

        Raise [`NotImplementedByEp`][aioep.NotImplementedByEp] if ``stream`` is of a kind this
        cannot order.
        """

    @abc.abstractmethod
    def query(self) -> bool:
        """True once the stream has passed the marked point."""

    def error(self) -> BaseException | None:
        """The first failure of the work between the previous mark and this one, if any."""
        return None

    def add_done_callback(self, fn: Callable[[], None]) -> bool:
        """Call ``fn()`` once, from any thread, when complete (at once if already complete).

        Return False if this notification cannot call back; the core then polls
        [`query`][aioep.abc.NotificationImpl.query] with backoff.
        """
        return False

    def wait_on_host(self, timeout: float | None) -> bool:
        """Block the calling thread until complete or ``timeout``; True when complete."""
        done = threading.Event()
        if not self.add_done_callback(done.set):
            return _poll(self.query, timeout)
        return done.wait(timeout)


class StreamImpl(abc.ABC):
    """An in-order queue of device work owned by a backend."""

    @property
    def handle(self) -> int:
        """The native handle (a ``CUstream`` value on CUDA); 0 where there is none."""
        return 0

    @abc.abstractmethod
    def create_notification(self) -> NotificationImpl:
        """A new, not yet activated notification on this stream."""

    def query(self) -> bool | None:
        """True when all work enqueued so far has completed (``cuStreamQuery``).

        Return None if the backend cannot tell; the core then records a
        notification and queries that.
        """
        return None

    def settled(self) -> bool:
        """True when all work enqueued so far has completed and none of it failed since the
        last notification the stream reached, nor is the device lost: a notification
        recorded now would complete at once, without an error.

        ``await stream`` then returns without recording one. Return False (the default)
        when unsure: the core records a notification and waits for it.
        """
        return False

    def flush(self) -> None:
        """Submit queued work to the device now (for backends that batch)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the stream; the core calls it only after the stream's work is complete."""


def _poll(query: Callable[[], bool], timeout: float | None) -> bool:
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 50e-6
    while not query():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(delay)  # loop-safe: only ever called from a worker or user thread
        delay = min(delay * 2, 5e-3)
    return True


def run_callbacks(callbacks: list[Callable[[], None]]) -> None:
    """Run and drop each callback in turn (one that raises is logged, as `call_reporting`).

    Each is released before the next runs: a later callback may wake a task that
    expects the objects an earlier one referenced (a copy future) to be gone.
    """
    if len(callbacks) > 1:
        callbacks.reverse()
    while callbacks:
        fn = callbacks.pop()
        try:
            fn()
        except Exception as exc:
            _report(fn, exc)
            del exc
        del fn


def _report(fn: Callable[..., object], exc: BaseException) -> None:
    # The text, not exc_info: a record that holds the traceback would keep the frames'
    # objects (the future, its tensors) alive for as long as a handler keeps it.
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    _log.error("a done-callback %r raised; the error was ignored:\n%s", fn, text)


def call_reporting(fn: Callable[..., object], *args: Any) -> None:
    """Call ``fn(*args)``; an exception it raises is logged (logger ``aioep``), not raised.

    Done-callbacks run on whatever thread completes the work (a stream's worker, a copy
    thread): one that raises must not stop that thread or the callbacks after it.
    """
    try:
        fn(*args)
    except Exception as exc:
        _report(fn, exc)
        del exc
