"""The factory's free thread: the driver calls that synchronise the device run here only.

``cuMemFree`` and ``cuMemFreeHost`` wait until the whole device is idle. They are reached
from wherever a buffer happens to die: the event loop (the loop would stall for as long as
any stream is busy), or the dispatcher thread when a completing copy drops the last
reference to its source (every wake-up would stall, and a stream whose pageable copy needs
the dispatcher to move on would deadlock it). So they are queued to one thread of their own,
on which nothing the device waits for ever depends. It starts with the first such free and
is drained when the factory closes, before the contexts go.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable

__all__ = ["Freer"]


class Freer:
    """Runs queued frees in order on one lazily started thread; inline once closed."""

    def __init__(self, name: str = "aioep-cuda-free") -> None:
        self.name = name
        self._cond = threading.Condition()
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.done = 0
        """Frees run so far (diagnostics)."""

    @property
    def thread(self) -> threading.Thread | None:
        """The free thread once started."""
        return self._thread

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job`` (a free that synchronises the device); never blocks on the device."""
        with self._cond:
            if not self._closed:
                try:
                    if self._thread is None:
                        thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                        thread.start()
                        self._thread = thread
                except RuntimeError:  # no new threads (interpreter shutdown): free inline
                    pass
                else:
                    self._jobs.append(job)
                    self._cond.notify()
                    return
        _call(job)  # closed: the device is gone or idle, the call returns at once

    def pending(self) -> int:
        """Frees queued and not yet run."""
        with self._cond:
            return len(self._jobs)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    if self._closed:
                        return
                    self._cond.wait()
                job = self._jobs.popleft()
            _call(job)
            self.done += 1

    def close(self) -> None:
        """Run what is queued, then stop the thread; later frees run inline. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


def _call(job: Callable[[], None]) -> None:
    try:
        job()
    except Exception:  # frees come from finalizers: report, never raise
        hook = sys.unraisablehook
        exc = sys.exc_info()[1]
        if exc is not None:
            hook(
                type(
                    "UnraisableHookArgs",
                    (),
                    {
                        "exc_type": type(exc),
                        "exc_value": exc,
                        "exc_traceback": exc.__traceback__,
                        "err_msg": "Exception in an aioep-cuda free",
                        "object": None,
                    },
                )()
            )
