"""A session's worker threads: onnxruntime calls and loads run there, off the event loop.

A run reaches the loop in one hop: the awaiting task files a call on the pool's queue with
its own waiter (an asyncio future, a trio event), a worker runs it and wakes the loop
itself through the loop's `LoopWaker` (one ``call_soon_threadsafe`` or trio token call,
shared by the completions that arrive together). No ``concurrent.futures`` future is made
or chained in between. Cancelling the await abandons only the wait: the call runs its
course on the worker, which keeps its arguments (the run's inputs) alive until then, and
its result is dropped.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from .._base.errors import ClosedError
from .._plugin.wake import wait_for, waker_for

__all__ = ["DEFAULT_WORKERS", "Workers", "wait_future"]

_T = TypeVar("_T")


def _cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


DEFAULT_WORKERS = min(32, max(2, _cores()))
"""Threads per session: one per core the process may use (at least two, so that two runs
overlap on any machine; at most 32). onnxruntime's ``run`` releases the GIL while it
computes, so runs of one session overlap up to the cores; more threads than cores only
add switches and cold caches (measured on a 2-core VM with 50 concurrent runs, see
``docs/concepts/sessions.md``)."""


class _Call(Generic[_T]):
    """One call on a worker: the function and its arguments, and once run, its result or
    error, then the wake-up of the waiter on its loop."""

    __slots__ = ("args", "error", "fn", "value", "waiter", "wake")

    def __init__(
        self,
        fn: Callable[..., _T],
        args: tuple[Any, ...],
        wake: Callable[[Any], None],
        waiter: Any,
    ) -> None:
        self.fn: Callable[..., _T] | None = fn
        self.args: tuple[Any, ...] = args
        self.wake = wake
        self.waiter = waiter
        self.value: _T | None = None
        self.error: BaseException | None = None

    def execute(self) -> None:
        """Run the call on this (worker) thread and keep its result or error."""
        fn, args = self.fn, self.args
        assert fn is not None
        self.fn, self.args = None, ()
        try:
            self.value = fn(*args)
        except BaseException as exc:  # handed to the awaiting task, raised there
            self.error = exc
        # The arguments (a run's inputs) are released before the waiter can resume.
        del fn, args

    def notify(self) -> None:
        """Wake the waiter on its loop (once)."""
        waiter, self.waiter = self.waiter, None
        self.wake(waiter)

    def result(self) -> _T:
        """The call's result, or its error raised (the error is handed over only once:
        the call keeps no reference to it, so no cycle through its traceback)."""
        error = self.error
        if error is not None:
            self.error = None
            try:
                raise error
            finally:
                del error
        return self.value  # type: ignore[return-value]


class _Thread:
    """A worker thread's mailbox: the call it is handed while idle, and the lock it waits
    on (held while there is nothing for it; released to hand it a call)."""

    __slots__ = ("call", "wakeup")

    def __init__(self) -> None:
        self.call: _Call[Any] | None = None
        self.wakeup = threading.Lock()
        self.wakeup.acquire()


class _Pool:
    """The threads' shared state (what a worker thread holds: not the `Workers`, which is
    freed with its session and then shuts the pool down)."""

    __slots__ = ("backlog", "closed", "idle", "lock", "max", "name", "started")

    def __init__(self, max_workers: int, name: str) -> None:
        self.max = max(1, max_workers)
        self.name = name
        self.lock = threading.Lock()
        self.idle: list[_Thread] = []  # a stack: the last one idle is handed the next call
        self.backlog: collections.deque[_Call[Any]] = collections.deque()
        self.started = 0
        self.closed = False

    def file(self, call: _Call[Any]) -> None:
        with self.lock:
            if self.closed:
                raise ClosedError("the session's workers are shut down")
            if self.idle:
                thread = self.idle.pop()
                thread.call = call
                thread.wakeup.release()
                return
            if self.started >= self.max:
                self.backlog.append(call)  # every thread is busy: the first one free takes it
                return
            self.started += 1
            name = f"{self.name}-{self.started - 1}"
        try:
            threading.Thread(target=_work, args=(self, call), name=name, daemon=True).start()
        except BaseException:  # no thread (the OS refused one): the call was not filed
            with self.lock:
                self.started -= 1
            raise

    def shutdown(self) -> None:
        with self.lock:
            self.closed = True
            idle, self.idle[:] = list(self.idle), []
            self.started -= len(idle)
        for thread in idle:
            thread.wakeup.release()  # with no call: the thread ends


def _work(pool: _Pool, call: _Call[Any]) -> None:
    """A worker thread: run ``call``, then the next one filed, until the pool shuts down."""
    me = _Thread()
    lock, idle, backlog = pool.lock, pool.idle, pool.backlog
    while True:
        call.execute()
        with lock:
            park = False
            following: _Call[Any] | None = None
            if backlog:
                following = backlog.popleft()
            elif pool.closed:
                pool.started -= 1
            else:
                park = True
                idle.append(me)  # idle before the waiter wakes: its next call finds me
        call.notify()
        del call  # the call (and its result) is the awaiter's now
        if park:
            me.wakeup.acquire()
            following, me.call = me.call, None
        if following is None:
            return  # shut down
        call = following


class Workers:
    """Up to ``max_workers`` threads running calls in the order they are filed, started as
    calls arrive (none until the first); runs of one session overlap up to that many.

    A call goes to the thread that became idle last (its caches are the warmest: a
    thread that has just run the model runs it again fastest), else to a new thread while
    there is room, else it waits in a queue that the first thread to finish takes it from.
    A thread marks itself idle before it wakes the loop, so the next run the woken task
    files finds it. The threads end at `shutdown`, or once the `Workers` is freed.
    """

    __slots__ = ("__weakref__", "_pool")

    def __init__(self, max_workers: int = DEFAULT_WORKERS, name: str = "aioep-session") -> None:
        self._pool = _Pool(max_workers, name)
        weakref.finalize(self, self._pool.shutdown)

    @property
    def max_workers(self) -> int:
        """The most threads this pool runs."""
        return self._pool.max

    @property
    def threads(self) -> int:
        """How many worker threads were started (and have not stopped)."""
        return self._pool.started

    async def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on a worker thread and return its result (or raise its error).

        Cancelling the await abandons the wait, not the call.

        Raises:
            ClosedError: the pool was shut down.
        """
        loop = asyncio._get_running_loop()
        if loop is not None:
            fut = loop.create_future()
            call = _Call(fn, args, waker_for(loop).wake, fut)
            self._pool.file(call)
            await fut
            return call.result()
        import trio  # no asyncio loop: anyio runs on trio

        event = trio.Event()
        call = _Call(fn, args, waker_for(trio.lowlevel.current_trio_token()).wake, event)
        self._pool.file(call)
        await event.wait()
        return call.result()

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Start ``fn(*args)`` on a worker thread; its future, for callers that wait for
        it later or from elsewhere (loading the model's parts, not a run)."""
        future: Future[_T] = Future()
        future.set_running_or_notify_cancel()
        self._pool.file(_Call(_complete, (future, fn, args), _ignore, None))
        return future

    def shutdown(self) -> None:
        """Stop the threads once the calls filed so far are done (without waiting for
        them); a later call raises `ClosedError`."""
        self._pool.shutdown()


def _complete(future: Future[_T], fn: Callable[..., _T], args: tuple[Any, ...]) -> None:
    try:
        result = fn(*args)
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _ignore(_: object) -> None:
    pass


async def wait_future(fut: Future[_T]) -> _T:
    """The result of ``fut``, awaited without a thread per waiter."""

    def register(wake: Callable[[], None]) -> bool:
        fut.add_done_callback(lambda _: wake())
        return True

    await wait_for(register, fut.done)
    return fut.result()
