"""The one event-loop-specific piece: wake a waiting task from any thread (and tell whether
this thread runs an event loop, which a blocking wait would stall).

A backend signals completion from its own thread (a stream worker, a driver
callback). `wait_for` registers a thread-safe callback that schedules the
waiting task's wake-up on its own loop: ``loop.call_soon_threadsafe`` on
asyncio, the run's ``TrioToken`` on trio. No thread is parked per waiter and
nothing spins; cancelling the wait abandons it and leaves the device work alone.
"""

from __future__ import annotations

import asyncio
import sys
import warnings
from collections.abc import Callable

import anyio
import anyio.lowlevel

__all__ = ["runs_event_loop", "wait_for", "warn_if_blocking_loop"]

Register = Callable[[Callable[[], None]], bool]


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


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

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(_set_result, fut)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        if register(wake):
            await fut
            return
    elif "trio" in sys.modules:
        import trio

        token = trio.lowlevel.current_trio_token()
        event = trio.Event()

        def wake_trio() -> None:
            try:
                token.run_sync_soon(event.set)
            except trio.RunFinishedError:
                pass

        if register(wake_trio):
            await event.wait()
            return
    await _poll(query)


async def _poll(query: Callable[[], bool]) -> None:
    delay = 50e-6
    while not query():
        await anyio.sleep(delay)
        delay = min(delay * 2, 5e-3)


def runs_event_loop() -> bool:
    """True when the calling thread is running an asyncio or trio event loop (in a task
    or in a callback of it); False on worker threads and in synchronous programs.

    asyncio's running loop for this thread, then, only when trio is imported,
    ``trio.lowlevel.in_trio_run()``: two thread-local lookups, about a microsecond in all.
    anyio runs on one of the two, so it is covered.
    """
    if asyncio._get_running_loop() is not None:
        return True
    trio = sys.modules.get("trio")
    return trio is not None and bool(trio.lowlevel.in_trio_run())


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
