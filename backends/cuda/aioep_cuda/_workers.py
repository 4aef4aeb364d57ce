"""A small pool of worker threads that share their owner's lock (`WorkerPool`)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from ._wake import _report

__all__ = ["Task", "WorkerPool"]

Task = Callable[[], None]


class WorkerPool:
    """Up to ``threads`` daemon threads, started on first use, that run tasks: the queued
    ones first (`push`), then what the owner's ``source`` offers.

    The workers wait on the owner's ``cond``: the owner changes its state (a chunk freed, a
    batch submitted) and notifies under the same lock, and an idle worker asks ``source``
    again. ``source`` and ``idle`` are called with the lock held. A task that raises is a
    bug: it is reported (`sys.unraisablehook`) and the worker goes on.

    Args:
        name: the threads' name prefix (``{name}-{i}``).
        threads: the most threads.
        cond: the owner's condition (lock) that guards the pool and the owner's state.
        source: the owner's next task, or None when it has none now.
        idle: whether the owner has nothing in flight (a closing pool's workers then exit).
    """

    def __init__(
        self,
        name: str,
        threads: int,
        cond: threading.Condition,
        source: Callable[[], Task | None],
        idle: Callable[[], bool],
    ) -> None:
        self._name = name
        self._max = threads
        self._cond = cond
        self._source = source
        self._idle = idle
        self._tasks: collections.deque[Task] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._closing = False  # exit once the owner is idle and no task is queued
        self._stopped = False  # exit now, dropping queued tasks

    def start(self) -> None:
        """Start the threads not started yet. Call with the lock held."""
        while len(self._threads) < self._max:
            t = threading.Thread(
                target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
            )
            self._threads.append(t)
            t.start()

    def push(self, *tasks: Task) -> None:
        """Queue ``tasks`` ahead of what ``source`` offers and wake as many workers. Call
        with the lock held."""
        self._tasks.extend(tasks)
        self._cond.notify(len(tasks))

    def close(self, deadline: float) -> None:
        """Let the workers finish what is queued and what ``source`` still offers, and exit
        once the owner is idle; wait for them until ``deadline`` (``time.monotonic``). A
        worker calling this is not waited for. Call without the lock."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            threads = list(self._threads)
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        """Make every worker exit as soon as its task returns; drop the queued tasks. Call
        with the lock held."""
        self._stopped = True
        self._tasks.clear()
        self._cond.notify_all()

    def _next(self) -> Task | None:
        with self._cond:
            while True:
                if self._stopped:
                    return None
                if self._tasks:
                    return self._tasks.popleft()
                task = self._source()
                if task is not None:
                    return task
                if self._closing and self._idle():
                    return None
                self._cond.wait()

    def _work(self) -> None:
        while True:
            task = self._next()
            if task is None:
                return
            try:
                task()
            except BaseException as exc:  # a bug: report it, keep the worker
                _report(exc)
