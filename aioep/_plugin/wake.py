"""The one event-loop-specific piece: wake a waiting task from any thread (and tell whether
this thread runs an event loop, which a blocking wait would stall).

A backend signals completion from its own thread (a stream worker, a driver's
dispatcher thread). `wait_for` registers a thread-safe callback that schedules the
waiting task's wake-up on its own loop: ``loop.call_soon_threadsafe`` on asyncio, the
run's ``TrioToken`` on trio. That is the one hop of a completion: the thread that learns
the work is done wakes the loop itself. Completions that arrive together (one pass of a
stream worker over several marks, a dispatcher finding many events done) share one
wake-up: each loop has one `LoopWaker` that collects them and wakes the loop once
per batch. A worker thread that completes work and then parks (a `ThreadStream`'s worker,
a copy worker) holds the wake-ups it owes (`hold_wakeups`) and schedules them right before
it runs more work, runs a user's done-callback or parks (`flush_wakeups`): the loop it
wakes finds the interpreter free, instead of waking up only to wait for that thread to let
go of it. No thread is parked per waiter and nothing spins; cancelling the wait abandons
it and leaves the device work alone.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Generator
from typing import Any

import anyio
import anyio.lowlevel

__all__ = [
    "LoopWaker",
    "checkpoint",
    "flush_held_wakeups",
    "flush_wakeups",
    "hold_wakeups",
    "poll",
    "runs_event_loop",
    "wait_for",
    "waker_for",
    "warn_if_blocking_loop",
]

Register = Callable[[Callable[[], None]], bool]


class LoopWaker:
    """Wakes one event loop from any thread, once per batch of completions.

    `wake` files a waiter (an asyncio future, a trio event) to be woken on the loop
    by ``fire(waiter)``; the first one filed since the loop last ran the batch schedules
    the batch (``call_soon_threadsafe`` on asyncio, ``TrioToken.run_sync_soon`` on trio);
    the others only join it.
    """

    __slots__ = ("__weakref__", "_fire", "_pending", "_schedule", "_scheduled")

    def __init__(
        self, schedule: Callable[[Callable[[], None]], object], fire: Callable[[Any], object]
    ) -> None:
        self._schedule = schedule
        self._fire = fire
        # A deque's append and popleft are atomic: no lock on the completing thread's path.
        self._pending: collections.deque[Any] = collections.deque()
        self._scheduled = False

    def wake(self, waiter: Any) -> None:
        """Wake ``waiter`` on the loop soon (call from any thread; never raises).

        On a thread that holds its wake-ups (`hold_wakeups`), the batch is scheduled
        by that thread's next `flush_wakeups`.
        """
        self._pending.append(waiter)
        if self._scheduled:
            return  # the batch is already scheduled: this completion rides along
        held: list[LoopWaker] | None = getattr(_local, "held", None)
        if held is not None:
            if self not in held:
                held.append(self)
            return
        # Two threads may both get here: the loop then runs one batch more, which is harmless.
        self._scheduled = True
        try:
            self._schedule(self._run_batch)
        except Exception:  # the loop is closed (asyncio) or the run finished (trio)
            self._pending.clear()

    def _schedule_batch(self) -> None:
        # Two threads may both get here: the loop then runs one batch more, which is harmless.
        self._scheduled = True
        try:
            self._schedule(self._run_batch)
        except Exception:  # the loop is closed (asyncio) or the run finished (trio)
            self._pending.clear()

    def _run_batch(self) -> None:
        # Cleared before draining: a waiter filed after this point either is drained below
        # or (if it saw the flag clear) schedules a batch of its own.
        self._scheduled = False
        pending, fire = self._pending, self._fire
        while pending:
            fire(pending.popleft())


class _AsyncioWaker(LoopWaker):
    """The `LoopWaker` of an asyncio loop: its waiters are asyncio futures, resolved in
    the batch itself (no call per waiter)."""

    __slots__ = ()

    def _run_batch(self) -> None:
        self._scheduled = False  # see LoopWaker._run_batch
        pending = self._pending
        while pending:
            fut = pending.popleft()
            if not fut.done():  # not cancelled meanwhile
                fut.set_result(None)


_local = threading.local()  # .held: the LoopWakers a thread holding its wake-ups owes a batch


def hold_wakeups() -> list[LoopWaker]:
    """Hold the calling thread's loop wake-ups from now on: `LoopWaker.wake` files the
    waiter but leaves scheduling its loop's batch to the thread's `flush_wakeups`, which
    it calls before it does anything long (runs more work, sleeps).

    For a worker thread that completes work and then blocks (a stream's worker, a copy
    worker): woken last, right before the thread parks, the loop finds the interpreter
    free when it wakes up, instead of waiting for the thread to get to its next wait
    (and the completions of several marks passed in a row share one wake-up). Returns
    the list the held wakers collect in, for `flush_wakeups`.
    """
    held: list[LoopWaker] = []
    _local.held = held
    return held


def flush_held_wakeups() -> None:
    """`flush_wakeups` for the calling thread, if it holds its wake-ups: before it runs
    code that may take long or block (a user's done-callback), so that no loop it owes a
    wake-up waits behind that code."""
    held: list[LoopWaker] | None = getattr(_local, "held", None)
    if held:
        flush_wakeups(held)


def flush_wakeups(held: list[LoopWaker]) -> None:
    """Schedule the batch of every loop the calling thread owes a wake-up (see
    `hold_wakeups`); never raises."""
    while held:
        waker = held.pop()
        if not waker._scheduled:
            waker._schedule_batch()


# The waker of the loop (or trio run) last seen, then all of them by loop: most programs
# have one loop, and the identity test is cheaper than the weak dictionary's lookup.
_last: tuple[weakref.ref[Any], LoopWaker] | None = None
_wakers: weakref.WeakKeyDictionary[Any, LoopWaker] = weakref.WeakKeyDictionary()
_wakers_lock = threading.Lock()


def waker_for(loop: asyncio.AbstractEventLoop | Any) -> LoopWaker:
    """The `LoopWaker` of an asyncio loop or of a trio run's ``TrioToken``."""
    global _last
    last = _last
    if last is not None and last[0]() is loop:
        return last[1]
    with _wakers_lock:
        waker = _wakers.get(loop)
        if waker is None:
            if isinstance(loop, asyncio.AbstractEventLoop):
                waker = _AsyncioWaker(loop.call_soon_threadsafe, _set_result)
            else:
                waker = LoopWaker(loop.run_sync_soon, _set_event)
            _wakers[loop] = waker
    _last = (weakref.ref(loop), waker)
    return waker


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_event(event: Any) -> None:
    event.set()


def checkpoint() -> Generator[Any, None, None]:
    """Yield to the event loop once; for ``yield from`` in an ``__await__``.

    On asyncio a bare ``yield`` (what ``asyncio.sleep(0)`` does, without its coroutine);
    elsewhere anyio's checkpoint.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        yield from anyio.lowlevel.checkpoint().__await__()
    else:
        yield


async def wait_for(register: Register, query: Callable[[], bool]) -> None:
    """Wait until the callback handed to ``register`` is called (from any thread).

    ``register(fn)`` must arrange for ``fn()`` to be called once on completion
    and return True, or return False if it cannot; then ``query()`` is polled
    with backoff (the fallback). Always checkpoints, even when already complete.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if query():
        # Checkpoint even when already complete, so loops of awaits cannot starve other tasks.
        if loop is not None:
            await asyncio.sleep(0)  # what anyio's checkpoint does on asyncio, minus the lookup
        else:
            await anyio.lowlevel.checkpoint()
        return
    if loop is not None:
        fut: asyncio.Future[None] = loop.create_future()
        if register(functools.partial(waker_for(loop).wake, fut)):
            await fut
            return
    elif "trio" in sys.modules:
        import trio

        event = trio.Event()
        if register(functools.partial(waker_for(trio.lowlevel.current_trio_token()).wake, event)):
            await event.wait()
            return
    await poll(query)


async def poll(query: Callable[[], bool]) -> None:
    """Wait until ``query()`` is True, polling with backoff (50 us doubling to 5 ms): the
    fallback of a wait whose completion cannot call back."""
    delay = 50e-6
    while not query():
        await anyio.sleep(delay)
        delay = min(delay * 2, 5e-3)


def runs_event_loop() -> bool:
    """True when the calling thread is running an asyncio or trio event loop (in a task
    or in a callback of it); False on worker threads and in synchronous programs.

    asyncio's running loop for this thread, then, only when trio is imported, trio's run
    of this thread: two thread-local lookups, about a microsecond in all. anyio runs on one
    of the two, so it is covered.
    """
    if asyncio._get_running_loop() is not None:
        return True
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    in_trio_run = getattr(trio.lowlevel, "in_trio_run", None)
    if in_trio_run is not None:  # trio >= 0.27
        return bool(in_trio_run())
    # Older trio (the lowest declared version has no in_trio_run): current_trio_token()
    # raises outside a run.
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


def warn_if_blocking_loop(waiter: object, done: Callable[[], bool]) -> None:
    """Warn with a `RuntimeWarning` when ``waiter.wait()`` is about to block an event
    loop: the calling thread runs one and the work is still pending (``done()`` is False).

    The warning points at the caller of ``wait()``. ``done()`` is asked first: work
    already done costs one query, and a pending wait is about to block anyway.
    """
    if not done() and runs_event_loop():
        warnings.warn(
            f"{waiter!r}.wait() blocks the event loop running on this thread until the work "
            "completes; use 'await' on it instead",
            RuntimeWarning,
            stacklevel=3,
        )
