"""How a session run reaches onnxruntime and back: one hop through a session worker that
wakes the loop itself, or inline on the loop thread within the environment's inline
budget (CPU-only runs, decided per kind from measured times, one overrun per kind)."""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import weakref
from typing import Any

import anyio
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from _models import model_of, reference, value_info  # noqa: E402
from onnx import helper as h  # noqa: E402

import aioep  # noqa: E402
import aioep._session.direct as direct_mod  # noqa: E402
import aioep._session.run as run_mod  # noqa: E402
from aioep import DeviceType  # noqa: E402
from aioep._plugin.wake import LoopWaker  # noqa: E402

pytestmark = pytest.mark.anyio

SIM = "SimExecutionProvider"


def mlp(width: int = 16) -> Any:
    """x[batch, width] -> MatMul, Add, Relu -> MatMul: a model onnxruntime runs whole."""
    rng = np.random.default_rng(3)
    w1 = onnx.numpy_helper.from_array(rng.standard_normal((width, width)).astype("f4"), "w1")
    b1 = onnx.numpy_helper.from_array(rng.standard_normal(width).astype("f4"), "b1")
    w2 = onnx.numpy_helper.from_array(rng.standard_normal((width, width)).astype("f4"), "w2")
    nodes = [
        h.make_node("MatMul", ["x", "w1"], ["a"]),
        h.make_node("Add", ["a", "b1"], ["b"]),
        h.make_node("Relu", ["b"], ["c"]),
        h.make_node("MatMul", ["c", "w2"], ["y"]),
    ]
    return model_of(
        nodes,
        [value_info("x", ["batch", width])],
        [value_info("y", ["batch", width])],
        [w1, b1, w2],
    )


def x_of(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 16)).astype(np.float32)


class OrtCalls:
    """`run_ort` as the session calls it, recording the thread of each call, with a fake
    clock (``direct_mod.perf_counter`` and ``thread_time``) that a call advances by ``cost``
    seconds: the inline decisions then depend on the costs the test sets, not on the
    machine's speed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.threads: list[int] = []
        self.cost = 1e-6
        self.now = 0.0
        self.hold: threading.Event | None = None  # set: calls wait for it
        self.entered = threading.Event()
        self.barrier: threading.Barrier | None = None
        self.results: list[list[Any]] = []
        self.returned = threading.Event()
        real = direct_mod.run_ort

        def run_ort(session: Any, feeds: Any, *rest: Any) -> Any:
            self.threads.append(threading.get_ident())
            self.entered.set()
            if self.hold is not None:
                assert self.hold.wait(30)
            if self.barrier is not None:
                self.barrier.wait(30)  # raises BrokenBarrierError if the runs did not overlap
            self.now += self.cost
            out = real(session, feeds, *rest)
            self.results.append(out)
            self.returned.set()
            return out

        monkeypatch.setattr(direct_mod, "run_ort", run_ort)  # a run of the whole model
        monkeypatch.setattr(run_mod, "run_ort", run_ort)  # a CPU step among EP steps
        monkeypatch.setattr(direct_mod, "perf_counter", lambda: self.now)
        monkeypatch.setattr(direct_mod, "thread_time", lambda: self.now)

    def on_loop(self, loop_thread: int) -> int:
        return sum(t == loop_thread for t in self.threads)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> OrtCalls:
    return OrtCalls(monkeypatch)


async def cpu_session(env: aioep.Environment, opts: dict[str, Any] | None = None) -> Any:
    host = env.ep_devices(device_type=DeviceType.CPU)[0]
    return await env.create_session(mlp(), [host], opts or {"intra_op_num_threads": 1})


# -- one hop ---------------------------------------------------------------------------------


async def test_a_run_hops_once_the_worker_waking_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    wakes: list[str] = []
    real_wake = LoopWaker.wake

    def counted_wake(self: LoopWaker, waiter: Any) -> None:
        wakes.append(threading.current_thread().name)
        real_wake(self, waiter)

    futures: list[object] = []
    real_init = concurrent.futures.Future.__init__

    def counted_init(self: Any) -> None:
        futures.append(self)
        real_init(self)

    x = x_of(4)
    want = reference(mlp(), {"x": x})["y"]
    async with (
        aioep.Environment(autoload=False, inline_budget_us=0) as env,
        await cpu_session(env) as sess,
    ):
        await sess.run({"x": x})  # threads started, modules imported
        monkeypatch.setattr(LoopWaker, "wake", counted_wake)
        monkeypatch.setattr(concurrent.futures.Future, "__init__", counted_init)
        for _ in range(5):
            got = await sess.run({"x": x})
            np.testing.assert_array_equal(got["y"].numpy(), want)
            (y,) = await sess.run(None, {"x": x})
            np.testing.assert_array_equal(y, want)
        monkeypatch.undo()
    assert futures == []  # no concurrent.futures future made, nothing chained
    assert len(wakes) == 10  # one wake-up per run ...
    assert all(name.startswith("aioep-session") for name in wakes)  # ... by the worker itself


async def test_concurrent_runs_overlap(calls: OrtCalls) -> None:
    async with (
        aioep.Environment(autoload=False, inline_budget_us=0) as env,
        await cpu_session(env) as sess,
    ):
        assert sess._workers.max_workers >= 2
        calls.barrier = threading.Barrier(2)  # each run waits inside onnxruntime for the other
        xs = [x_of(3, seed) for seed in range(2)]
        got: dict[int, np.ndarray] = {}

        async def one(i: int) -> None:
            got[i] = (await sess.run({"x": xs[i]}))["y"].numpy()

        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(one, i)
    for i in range(2):
        np.testing.assert_array_equal(got[i], reference(mlp(), {"x": xs[i]})["y"])


async def test_cancelled_run_keeps_its_inputs_and_computes_bit_exact(calls: OrtCalls) -> None:
    async with (
        aioep.Environment(autoload=False, inline_budget_us=0) as env,
        await cpu_session(env) as sess,
    ):
        x = x_of(5, seed=7)
        expected = reference(mlp(), {"x": x.copy()})["y"]
        ref = weakref.ref(x)
        calls.hold = threading.Event()
        with anyio.move_on_after(30) as scope:
            async with anyio.create_task_group() as tg:

                async def run(feed: np.ndarray) -> None:
                    await sess.run({"x": feed})

                tg.start_soon(run, x)
                del x
                assert await anyio.to_thread.run_sync(calls.entered.wait, 30)
                tg.cancel_scope.cancel()  # the awaiting task goes; the run goes on
        assert not scope.cancelled_caught
        gc.collect()
        assert ref() is not None  # the worker still holds the input
        calls.hold.set()
        assert await anyio.to_thread.run_sync(calls.returned.wait, 30)
        (y,) = calls.results[0]
        np.testing.assert_array_equal(y, expected)  # computed from the intact input
        calls.hold = None
        # The session is unharmed: the next run is bit-exact.
        again = await sess.run({"x": x_of(5, seed=7)})
        np.testing.assert_array_equal(again["y"].numpy(), expected)
        for _ in range(100):  # the worker drops the input once its run is done
            gc.collect()
            if ref() is None:
                break
            await anyio.sleep(0.01)
        assert ref() is None


# -- the inline bound ------------------------------------------------------------------------


async def test_cheap_kind_runs_inline_after_its_trial(calls: OrtCalls) -> None:
    loop_thread = threading.get_ident()
    x = x_of(2)
    want = reference(mlp(), {"x": x})["y"]
    async with (
        aioep.Environment(autoload=False, inline_budget_us=20) as env,
        await cpu_session(env) as sess,
    ):
        calls.cost = 5e-6
        for _ in range(direct_mod.TRIAL_RUNS):
            np.testing.assert_array_equal((await sess.run({"x": x}))["y"].numpy(), want)
        assert calls.on_loop(loop_thread) == 0  # the trial runs on workers
        assert sess._runner.direct_runs.inline_kinds() == {((2, 16),): True}
        for _ in range(5):
            np.testing.assert_array_equal((await sess.run({"x": x}))["y"].numpy(), want)
            (y,) = await sess.run(None, {"x": x})
            np.testing.assert_array_equal(y, want)
        assert calls.on_loop(loop_thread) == 10
        # The first run on the loop thread is onnxruntime's set-up of it, not timed.
        assert env.inline_budget.inline_runs == 9
        assert env.inline_budget.overruns == 0


async def test_the_first_inline_run_of_a_session_is_not_held_against_its_kind(
    calls: OrtCalls,
) -> None:
    """onnxruntime's first run of a session on a thread sets the thread up (hundreds of
    microseconds for a tiny model): the loop pays it once per session; the kind stays."""
    loop_thread = threading.get_ident()
    async with (
        aioep.Environment(autoload=False, inline_budget_us=20) as env,
        await cpu_session(env) as sess,
    ):
        calls.cost = 5e-6
        for _ in range(direct_mod.TRIAL_RUNS):
            await sess.run({"x": x_of(2)})
        calls.cost = 300e-6
        await sess.run({"x": x_of(2)})  # the warm-up
        calls.cost = 5e-6
        for _ in range(5):
            await sess.run({"x": x_of(2)})
        assert calls.on_loop(loop_thread) == 6
        assert env.inline_budget.overruns == 0
        assert sess._runner.direct_runs.inline_kinds() == {((2, 16),): True}
        calls.cost = 300e-6  # now an overrun: only one, and the kind leaves the loop
        for _ in range(3):
            await sess.run({"x": x_of(2)})
        assert calls.on_loop(loop_thread) == 7
        assert env.inline_budget.overruns == 1


async def test_a_kind_that_overruns_leaves_the_loop_for_good(calls: OrtCalls) -> None:
    loop_thread = threading.get_ident()
    async with (
        aioep.Environment(autoload=False, inline_budget_us=20) as env,
        await cpu_session(env) as sess,
    ):
        small, large = x_of(2), x_of(64)
        calls.cost = 5e-6
        for _ in range(direct_mod.TRIAL_RUNS):
            await sess.run({"x": small})
            await sess.run({"x": large})
        assert sess._runner.direct_runs.inline_kinds() == {((2, 16),): True, ((64, 16),): True}
        await sess.run({"x": small})  # the loop thread's warm-up run of the session
        want = reference(mlp(), {"x": large})["y"]
        calls.cost = 100e-6  # the large kind now costs more than the budget
        for cost in (100e-6, 1e-6):  # cheap again later: it stays off the loop anyway
            calls.cost = cost
            for _ in range(2 * direct_mod.TRIAL_RUNS):
                got = await sess.run({"x": large})
                np.testing.assert_array_equal(got["y"].numpy(), want)
        assert env.inline_budget.overruns == 1  # at most one overrun for the kind
        assert calls.on_loop(loop_thread) == 2
        assert sess._runner.direct_runs.inline_kinds()[((64, 16),)] is False
        # The other kind is untouched: it still runs inline.
        await sess.run({"x": small})
        assert calls.on_loop(loop_thread) == 3
        assert env.inline_budget.overruns == 1


@pytest.mark.parametrize("threads", [1, 2])
async def test_a_preempted_loop_thread_is_not_the_runs_overrun(
    calls: OrtCalls, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    """With ``intra_op_num_threads=1`` a run is timed in its thread's CPU time: a wall-clock
    stall (the loop thread preempted) does not move the kind off the loop. With more
    threads onnxruntime's own threads compute too: the wall clock decides."""
    loop_thread = threading.get_ident()
    async with (
        aioep.Environment(autoload=False, inline_budget_us=20) as env,
        await cpu_session(env, {"intra_op_num_threads": threads}) as sess,
    ):
        calls.cost = 5e-6
        for _ in range(direct_mod.TRIAL_RUNS):
            await sess.run({"x": x_of(2)})
        wall = [0.0]

        def stalled() -> float:  # each reading 1 ms later than the last
            wall[0] += 1e-3
            return wall[0]

        await sess.run({"x": x_of(2)})  # the loop thread's warm-up run of the session
        monkeypatch.setattr(direct_mod, "perf_counter", stalled)
        for _ in range(5):
            await sess.run({"x": x_of(2)})
        if threads == 1:
            assert calls.on_loop(loop_thread) == 6
            assert env.inline_budget.overruns == 0
        else:
            assert calls.on_loop(loop_thread) == 2
            assert env.inline_budget.overruns == 1


async def test_a_kind_whose_trial_is_too_slow_never_runs_inline(calls: OrtCalls) -> None:
    loop_thread = threading.get_ident()
    async with (
        aioep.Environment(autoload=False, inline_budget_us=20) as env,
        await cpu_session(env) as sess,
    ):
        calls.cost = (direct_mod.TRIAL_FACTOR + 0.5) * 20e-6
        for _ in range(3 * direct_mod.TRIAL_RUNS):
            await sess.run({"x": x_of(2)})
        assert sess._runner.direct_runs.inline_kinds() == {((2, 16),): False}
        assert calls.on_loop(loop_thread) == 0
        assert env.inline_budget.inline_runs == env.inline_budget.overruns == 0


async def test_a_zero_budget_runs_nothing_inline(calls: OrtCalls) -> None:
    loop_thread = threading.get_ident()
    async with (
        aioep.Environment(autoload=False, inline_budget_us=0) as env,
        await cpu_session(env) as sess,
    ):
        calls.cost = 0.0
        for _ in range(3 * direct_mod.TRIAL_RUNS):
            await sess.run({"x": x_of(2)})
        assert calls.on_loop(loop_thread) == 0
        assert sess._runner.direct_runs.inline_kinds() == {}
        assert env.inline_budget.inline_runs == 0


async def test_device_ep_runs_never_run_inline(calls: OrtCalls) -> None:
    pytest.importorskip("aioep_sim")
    loop_thread = threading.get_ident()
    # Add on the sim, Exp (not the sim's) on onnxruntime's CPU EP: a run of two steps.
    model = model_of(
        [h.make_node("Add", ["x", "x"], ["a"]), h.make_node("Exp", ["a"], ["y"])],
        [value_info("x", [4])],
        [value_info("y", [4])],
    )
    async with aioep.Environment(autoload=False, inline_budget_us=1000) as env:
        sims = env.register_library("sim", "aioep_sim:SimFactory")
        async with await env.create_session(model, [sims[0]]) as sess:
            assert sess.assignment == (SIM, "CPUExecutionProvider")
            calls.cost = 0.0
            x = np.arange(4, dtype=np.float32)
            for _ in range(3 * direct_mod.TRIAL_RUNS):
                got = await sess.run({"x": x}, output_location="host")
                np.testing.assert_array_equal(got["y"].numpy(), reference(model, {"x": x})["y"])
            assert len(calls.threads) == 3 * direct_mod.TRIAL_RUNS  # the CPU step ran each time
            assert calls.on_loop(loop_thread) == 0
            assert sess._runner.direct_runs.inline_kinds() == {}


async def test_closing_a_session_drops_its_kinds_from_the_budget(calls: OrtCalls) -> None:
    async with aioep.Environment(autoload=False, inline_budget_us=20) as env:
        sess = await cpu_session(env)
        calls.cost = 5e-6
        for _ in range(direct_mod.TRIAL_RUNS + 2):  # the trial, the warm-up, one timed run
            await sess.run({"x": x_of(2)})
        assert env.inline_budget.inline_runs == 1
        assert "1 kinds" in repr(env.inline_budget)
        await sess.aclose()
        assert "0 kinds" in repr(env.inline_budget)
