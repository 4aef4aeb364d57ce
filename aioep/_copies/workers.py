"""The copy workers: threads that run un-streamed copies no backend queue takes.

A lean pool in place of a ``concurrent.futures.ThreadPoolExecutor``: work items are plain
callables on one shared queue (no future per item, no second hand-off), up to
``max_workers`` threads are started as work arrives, and the thread that finishes a copy
completes its notification, which wakes the awaiting loop: the copy's one hop. Copies
queue only while every worker is busy; one copy never waits behind another while a
worker is free.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable

from .._base.errors import ClosedError
from .._plugin.stream_impl import call_reporting
from .._plugin.wake import flush_wakeups, hold_wakeups

__all__ = ["COPY_THREAD_NICE", "CopyWorkers", "lower_thread_priority"]


COPY_THREAD_NICE = 5
"""Niceness of aioep's copy worker threads (Linux): when the event loop's thread wakes up
it gets a core at once instead of waiting for a copying thread's time slice."""


def lower_thread_priority(nice: int = COPY_THREAD_NICE) -> None:
    """Lower the calling thread's CPU priority by ``nice`` (Linux only; best effort)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (OSError, AttributeError):
        pass


class CopyWorkers:
    """Up to ``max_workers`` daemon threads serving one queue of callables.

    ``initializer`` runs once on each new thread (e.g. to lower its priority).
    """

    __slots__ = ("_idle", "_initializer", "_lock", "_max", "_name", "_queue", "_threads")

    def __init__(
        self,
        max_workers: int,
        name: str,
        initializer: Callable[[], None] | None = None,
    ) -> None:
        self._max = max(1, max_workers)
        self._name = name
        self._initializer = initializer
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] | None = []  # None once shut down
        self._idle = 0  # threads waiting for work and not yet promised to a submitted item

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on a worker thread (a new one if none is idle and there is room).

        Raises:
            ClosedError: after `shutdown`.
        """
        with self._lock:
            threads = self._threads
            if threads is None:
                raise ClosedError(f"copy workers {self._name!r} are shut down")
            self._queue.put(fn)
            if self._idle:
                self._idle -= 1  # an idle thread takes it
                return
            if len(threads) >= self._max:
                return  # every worker is busy: it waits for the first one free
            thread = threading.Thread(
                target=self._work, name=f"{self._name}-{len(threads)}", daemon=True
            )
            threads.append(thread)
        thread.start()

    def _work(self) -> None:
        if self._initializer is not None:
            call_reporting(self._initializer)
        get = self._queue.get
        # The loops a copy wakes are woken right before this thread waits for the next one.
        held = hold_wakeups()
        while True:
            fn = get()
            if fn is None:
                return
            call_reporting(fn)
            del fn  # drop the item (and the tensors it holds) before waiting for the next
            with self._lock:
                self._idle += 1
            if held:
                flush_wakeups(held)

    @property
    def threads(self) -> int:
        """How many worker threads are running."""
        with self._lock:
            return len(self._threads or ())

    def shutdown(self) -> None:
        """Let the queued work finish, then stop and join the threads; idempotent."""
        with self._lock:
            threads, self._threads = self._threads, None
        for _ in threads or ():
            self._queue.put(None)
        for thread in threads or ():
            if thread is not threading.current_thread():
                thread.join()
