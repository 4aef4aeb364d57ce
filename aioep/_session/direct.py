"""A session's direct runs: a model onnxruntime's CPU execution provider runs whole, one
onnxruntime call per run, fed numpy arrays checked against what was worked out when the
session was made.

The call runs on a session worker, which wakes the loop itself when it is done (one hop),
or inline on the loop thread within the environment's inline budget, decided per kind of
run (the session and its input shapes) from measured times: see `DirectRuns.run`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from threading import get_ident
from time import perf_counter, thread_time
from typing import TYPE_CHECKING, Any

import anyio.lowlevel
import numpy as np

from .cpu_fallback import run_ort

if TYPE_CHECKING:
    from .host import SessionHost
    from .plan import PlanStep, SessionPlan
    from .values import RunInput
    from .workers import Workers

__all__ = ["MAX_SHAPE_KINDS", "TRIAL_FACTOR", "TRIAL_RUNS", "DirectRuns"]

MAX_SHAPE_KINDS = 64
"""The most input-shape combinations of one session the inline path tracks; runs on
shapes beyond them always go to a worker."""

TRIAL_RUNS = 8
"""Runs of a kind timed on a worker before the kind may run inline (a session's first runs
are slower than the rest: onnxruntime plans its memory on them)."""

TRIAL_FACTOR = 2.0
"""A kind may run inline once the least time of its first `TRIAL_RUNS` runs on a worker
is at most this many times the inline budget: a worker woken for one run computes it
slower than a thread that has just run the model (cold caches; 1.5-5x for a 10 us model on
a 2-core VM), so that time only estimates the inline cost. Every inline run is timed: the
first one over the budget moves the kind off the loop for good (its one overrun)."""


class _ShapeKind:
    """What a session knows of its direct runs on one set of input shapes (kept and read on
    the loop thread only)."""

    __slots__ = ("best", "inline", "timed")

    def __init__(self) -> None:
        self.best = float("inf")  # the least time of a trial run on a worker
        self.timed = 0  # trial runs timed so far
        self.inline: bool | None = None  # undecided while the trial runs


_Check = tuple[str, "np.dtype[Any]", tuple[int, ...] | None, int, tuple[tuple[int, int], ...]]
"""A model input as the fast path checks it: name, dtype, the shape when every dimension is
fixed (else None), the rank, and the fixed dimensions as (index, size)."""


class DirectRuns:
    """The direct runs of one session: the fast feed checks and the inline decisions."""

    __slots__ = (
        "_checks",
        "_kinds",
        "_token",
        "_warm_thread",
        "env",
        "single_threaded",
        "workers",
    )

    def __init__(self, env: SessionHost, workers: Workers) -> None:
        self.env = env
        self.workers = workers
        self._checks: tuple[_Check, ...] | None = None
        self._token = object()  # this session, in the inline budget's kinds
        self._warm_thread = 0  # the thread that ran this session's last inline run
        self._kinds: dict[tuple[object, tuple[tuple[int, ...], ...]], _ShapeKind] = {}
        self.single_threaded = False
        """True when onnxruntime computes the session's CPU steps on the calling thread
        alone (``intra_op_num_threads=1``): its runs are then timed in that thread's CPU
        time, which a thread preempted by another process does not accrue."""

    def prepare(self, plan: SessionPlan, single_threaded: bool) -> None:
        """The plan is built: note whether onnxruntime computes on the calling thread alone
        and work out the checks of the fast path (every input a tensor)."""
        self.single_threaded = single_threaded
        specs = plan.input_specs
        if plan.direct is None or any(
            info.kind != "tensor" or dtype is None for _, dtype, _, info in specs
        ):
            return
        checks: list[_Check] = []
        for name, dtype, shape, _ in specs:
            assert dtype is not None
            if shape is None:
                return  # any rank: the general checks
            if all(isinstance(d, int) for d in shape):
                checks.append((name, dtype, tuple(shape), len(shape), ()))
            else:
                fixed = tuple((i, d) for i, d in enumerate(shape) if isinstance(d, int))
                checks.append((name, dtype, None, len(shape), fixed))
        self._checks = tuple(checks)

    def feeds(self, inputs: Mapping[str, RunInput]) -> dict[str, Any] | None:
        """``inputs`` as onnxruntime's feeds when each is a numpy array of the model's
        dtype and shape (checked once, against what was worked out when the session was
        made); else None, and the general checks decide."""
        checks = self._checks
        if checks is None or type(inputs) is not dict or len(inputs) != len(checks):
            return None
        for name, dtype, shape, ndim, fixed in checks:
            given = inputs.get(name)
            if type(given) is not np.ndarray or given.dtype != dtype:
                return None
            if shape is not None:
                if given.shape != shape:
                    return None
            elif given.ndim != ndim or any(given.shape[i] != n for i, n in fixed):
                return None
        # A copy: the caller may change its mapping while the run waits for a worker.
        return dict(inputs)

    async def run(
        self,
        step: PlanStep,
        feeds: dict[str, Any],
        names: list[str] | None,
        run_options: Any,
    ) -> list[Any]:
        """The model's one onnxruntime call (CPU EP only), returning onnxruntime's list.

        Runs on a worker, which wakes the loop itself when done, unless the environment's
        inline budget lets this kind (this session, these input shapes) run on the loop
        thread: a kind is timed on a worker for its first `TRIAL_RUNS` runs, may run
        inline when the best of them is within `TRIAL_FACTOR` times the budget, and moves
        off the loop for good at its first inline run over the budget (the session's first
        inline run on a thread is onnxruntime's set-up of that thread: not timed). Runs are
        timed in the running thread's CPU time where onnxruntime computes on that thread
        alone (`single_threaded`: a loop thread preempted by another process is not the
        run's overrun), else by the wall clock.
        """
        session = step.ort_session
        budget = self.env.inline_budget
        if budget.budget:
            kind = (self._token, tuple([a.shape for a in feeds.values()]))
            state = self._kinds.get(kind)
            if state is None and len(self._kinds) < MAX_SHAPE_KINDS:
                state = self._kinds[kind] = _ShapeKind()
            if state is not None:
                clock = thread_time if self.single_threaded else perf_counter
                if state.inline:
                    thread = get_ident()
                    if thread != self._warm_thread:
                        # onnxruntime's first run of a session on a thread sets the thread
                        # up (70-330 us on a 2-core VM for a 10 us model): paid once, not
                        # held against the kind.
                        self._warm_thread = thread
                        results = run_ort(session, feeds, names, run_options)
                        await _checkpoint()
                        return results
                    start = clock()
                    try:
                        results = run_ort(session, feeds, names, run_options)
                    finally:
                        seconds = clock() - start
                        budget.ran_inline(kind, 0, seconds)
                        if seconds > budget.budget:
                            state.inline = False  # the one overrun of this kind
                    await _checkpoint()
                    return results
                if state.inline is None:  # on trial
                    results, seconds = await self.workers.call(
                        _timed, clock, session, feeds, names, run_options
                    )
                    state.timed += 1
                    state.best = min(state.best, seconds)
                    if state.inline is None and state.timed >= TRIAL_RUNS:
                        state.inline = state.best <= TRIAL_FACTOR * budget.budget
                    return results
        return await self.workers.call(run_ort, session, feeds, names, run_options)

    def close(self) -> None:
        """The session is closing: the inline budget forgets its kinds."""
        budget = self.env.inline_budget
        for kind in self._kinds:
            budget.forget(kind)
        self._kinds.clear()

    def inline_kinds(self) -> dict[tuple[tuple[int, ...], ...], bool | None]:
        """For diagnostics and tests: per set of input shapes tracked, whether its runs go
        inline (True), to a worker (False), or are on trial (None)."""
        return {shapes: state.inline for (_, shapes), state in self._kinds.items()}


async def _checkpoint() -> None:
    """Let the loop run other tasks once: a run that ran inline still yields, as one that
    hopped does."""
    if asyncio._get_running_loop() is not None:
        await asyncio.sleep(0)
    else:
        await anyio.lowlevel.checkpoint()


def _timed(
    clock: Callable[[], float],
    session: Any,
    feeds: dict[str, Any],
    names: list[str] | None,
    run_options: Any,
) -> tuple[list[Any], float]:
    """`run_ort` on a worker, with the seconds it took by ``clock``."""
    start = clock()
    results = run_ort(session, feeds, names, run_options)
    return results, clock() - start
