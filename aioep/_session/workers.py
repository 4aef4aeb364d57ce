"""A session's worker threads: onnxruntime calls and loads run there, off the event loop."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from .._plugin.wake import wait_for

__all__ = ["Workers", "wait_future"]

_T = TypeVar("_T")


class Workers:
    """A thread pool started on first use; cancelling `call` abandons only the wait,
    the call still runs its course."""

    __slots__ = ("_executor",)

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Start ``fn(*args)`` on a worker thread."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=min(32, (os.cpu_count() or 1) + 4), thread_name_prefix="aioep-session"
            )
        # The arguments travel in a box the worker empties: the executor's work item outlives
        # the call by a moment on its thread, and must not keep a run's tensors alive then.
        return self._executor.submit(_call_boxed, [(fn, args)])

    async def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` on a worker thread and return its result."""
        return await wait_future(self.submit(fn, *args))

    def shutdown(self) -> None:
        """Stop the threads once their calls are done; a later call starts new ones."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None


async def wait_future(fut: Future[_T]) -> _T:
    """The result of ``fut``, awaited without a thread per waiter."""

    def register(wake: Callable[[], None]) -> bool:
        fut.add_done_callback(lambda _: wake())
        return True

    await wait_for(register, fut.done)
    return fut.result()


def _call_boxed(box: list[tuple[Callable[..., _T], tuple[Any, ...]]]) -> _T:
    fn, args = box.pop()
    return fn(*args)
