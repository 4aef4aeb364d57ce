"""The inline budget: which host work may run on the event loop, decided from measurements."""

from __future__ import annotations

import math
import threading
import time

import pytest

import aioep
from aioep._base.budget import (
    DEFAULT_INLINE_BUDGET_US,
    PROBE_BYTES,
    READMIT_RUNS,
    InlineBudget,
)

KIND = ("copy", "host", "host")


def _burn(seconds: float) -> None:
    """Work that costs ``seconds`` of CPU (and of wall time) on the calling thread."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.parametrize("bad", [-1, -0.5, 1e6, math.nan, math.inf, True, "20", None])
def test_the_budget_is_validated(bad: object) -> None:
    with pytest.raises(aioep.InvalidArgument, match="inline_budget_us") as info:
        InlineBudget(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(info.value)
    with pytest.raises(aioep.InvalidArgument, match="Environment: inline_budget_us"):
        aioep.Environment(inline_budget_us=bad)  # type: ignore[arg-type]


def test_the_default_budget_and_zero() -> None:
    assert aioep.Environment().inline_budget.budget == DEFAULT_INLINE_BUDGET_US * 1e-6
    assert aioep.Environment(inline_budget_us=0).inline_budget.budget == 0
    off = InlineBudget(0)
    assert not off.allows(KIND, 1)  # 0 runs nothing inline, not even a probe


def test_small_sizes_may_be_probed_larger_ones_grow_by_doubling() -> None:
    budget = InlineBudget(50)
    assert budget.allows(KIND, 4096)
    assert budget.allows(KIND, PROBE_BYTES)
    assert not budget.allows(KIND, 4 * PROBE_BYTES)  # never measured, nothing smaller was
    budget.record(KIND, PROBE_BYTES, 1e-6, inline=True)
    assert budget.allows(KIND, 2 * PROBE_BYTES)  # one doubling past a measured size
    assert not budget.allows(KIND, 4 * PROBE_BYTES)
    # A size measured off the loop within the budget may be tried inline too.
    budget.record(KIND, 64 * PROBE_BYTES, 10e-6, inline=False)
    assert budget.allows(KIND, 64 * PROBE_BYTES)
    assert not budget.allows(("another", "kind"), 64 * PROBE_BYTES)


def test_a_kind_that_exceeds_the_budget_once_stays_off_the_loop() -> None:
    budget = InlineBudget(100)
    ran_inline = 0
    for _ in range(20):
        if budget.allows(KIND, 1024):
            ran_inline += 1
            budget.run(KIND, 1024, _burn, 300e-6)  # three times the budget, in CPU time
        else:
            # Off the loop it still costs more than half the budget: never forgiven.
            budget.run_off_loop(KIND, 1024, _burn, 300e-6)
    assert ran_inline == 1
    assert budget.overruns == 1
    assert budget.inline_runs == 1
    # Larger sizes of the kind are off the loop too; smaller ones and other kinds are not.
    assert not budget.allows(KIND, 4096)
    assert budget.allows(KIND, 100)
    assert budget.allows(("other",), 1024)


def test_an_overrun_the_work_did_not_cause_is_forgiven_by_cheap_off_loop_runs() -> None:
    budget = InlineBudget(100)
    budget.record(KIND, 4096, 5e-3, inline=True)  # the loop thread was preempted, say
    assert not budget.allows(KIND, 4096)
    # Off-loop runs whose median CPU time is over the budget: it stays off the loop.
    for k in range(READMIT_RUNS):
        budget.record(KIND, 4096, 150e-6 if k % 3 else 1e-6, inline=False)
    assert not budget.allows(KIND, 4096)
    # Mostly cheap (one outlier is not the work's cost): forgiven after READMIT_RUNS.
    for k in range(READMIT_RUNS - 1):
        budget.record(KIND, 4096, 500e-6 if k == 2 else 5e-6, inline=False)
        assert not budget.allows(KIND, 4096)
    budget.record(KIND, 4096, 5e-6, inline=False)
    assert budget.allows(KIND, 4096)
    assert budget.allows(KIND, 8192)  # one doubling past it may be probed again


def test_inline_runs_report_their_failures_and_still_count() -> None:
    budget = InlineBudget(50)

    def fail() -> None:
        raise OSError("boom")

    with pytest.raises(OSError, match="boom"):
        budget.run(KIND, 8, fail)
    assert budget.inline_runs == 1
    assert budget.run(KIND, 8, lambda x: x + 1, 41) == 42


def test_records_from_many_threads() -> None:
    budget = InlineBudget(50)
    kinds = [("k", i) for i in range(8)]

    def worker(kind: object) -> None:
        for _ in range(500):
            budget.record(kind, 4096, 1e-6, inline=True)
            budget.record(kind, 4096, 1e-6, inline=False)

    threads = [threading.Thread(target=worker, args=(k,)) for k in kinds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert budget.inline_runs == 8 * 500
    assert all(budget.allows(k, 8192) for k in kinds)
    assert "InlineBudget 50 us" in repr(budget)
