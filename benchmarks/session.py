"""Session benchmarks: every figure a ratio against a named baseline measured in the same
phase, interleaved with aioep's runs (short blocks, ABAB..., see ``_interleave.py``).

On the host (onnxruntime's CPU execution provider, ``intra_op_num_threads=1`` on both
sides, each side its own onnxruntime session of the same model):

(a) ``await session.run({"x": x})`` on a 2-layer MLP (x[8,256] -> MatMul 256x256, Add,
    Relu -> MatMul 256x256, Add), and onnxruntime's form ``await session.run(None, ...)``,
    vs the fair floor, the same hop around ``ort.run`` (a persistent thread runs it and
    completes an asyncio future with ``call_soon_threadsafe``; target <= 1.2x), vs
    ``await asyncio.to_thread(ort.run)`` (the naive alternative), and beside them
    ``ort.run`` inline on the loop + ``await asyncio.sleep(0)`` (no hop at all: what the
    inline path costs at best);
(b) the same on a tiny model (x[1,16] -> Add -> Relu, ~10 us in onnxruntime), cheap
    enough to run inline within the default inline budget;
(c) 50 concurrent runs of the MLP (``asyncio.gather``): throughput vs 50 gathered
    ``to_thread(ort.run)`` (target >= 1.2x), and vs the floor for concurrency: a pool
    of persistent threads, as many as aioep's session workers, each running ``ort.run``
    and completing a future with ``call_soon_threadsafe``.

(a)-(c) run three times: with the environment's default inline budget, with
``inline_budget_us=0`` (every run hops to a worker: the hop path alone) and with
``inline_budget_us=250`` (the MLP runs inline too), so both paths are shown; each section
records how many runs went inline and how many overran the budget.

(d) 32 concurrent requests vs the same 32 one after another on ``light_squeezenet``
    (onnx's test data, CPU EP, ``intra_op_num_threads=1``), aioep and onnxruntime in
    ``to_thread`` in rotation: concurrent throughput aioep / onnxruntime (target >= 0.95x)
    and the event loop's max lag during aioep's concurrent runs (a 1 ms ticker; target
    <= 10 ms);
(e) the sim EP with ``latency_us=200`` and ``bandwidth_gbps`` 2, then 1: 32 requests
    (4 MiB upload, Mul/Add/Relu, 4 MiB download), each on its own stream, concurrently
    vs one after another, alternated (target >= 1.6x throughput: one request's copies
    overlap another's copies and compute, bounded by the host's free cores);
(f) WebGPU, when an adapter is there (``onnxruntime-ep-webgpu``;
    ``ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1`` is set if unset): per-request latency of
    ``light_squeezenet`` and ``light_resnet50`` with the input on the device, aioep vs
    onnxruntime's IOBinding with the same device-resident input in ``to_thread`` (target
    <= 1.1x) and vs plain ``InferenceSession.run`` on a host input; and two chained models,
    the intermediate kept on the device (aioep) vs handed over as a host array by two
    ``to_thread`` runs (target <= 0.8x). onnxruntime's WebGPU calls hold the same device
    lock as aioep's (its EP crashes when device work from several threads overlaps).

Latencies are per-operation medians (min and p99 printed too); a ratio is a ratio of
medians from one phase. Results go to ``benchmarks/results/session.json``;
``benchmarks/summarize.py`` gives the min and median of each ratio over several runs.

Usage: ``python benchmarks/session.py [--quick] [--only-mlp] [--json PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import gc
import json
import os
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from _interleave import FloorThread, interleave, line, machine, ratios, summary, verdict
from onnx import TensorProto as TP
from onnx import helper as h

import aioep

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "session.json"
LIGHT = Path(onnx.__file__).resolve().parent / "backend" / "test" / "data" / "light"
WEBGPU = "WebGpuExecutionProvider"
N_REQUESTS = 32
N_CONCURRENT = 50
LARGE_BUDGET_US = 250.0
BUDGETS = (
    ("budget_default", None, "the default inline budget"),
    ("budget_0", 0.0, "inline_budget_us=0"),
    ("budget_250", LARGE_BUDGET_US, f"inline_budget_us={LARGE_BUDGET_US:g}"),
)

OURS = "aioep: await session.run({'x': x})"
OURS_ORT = "aioep: await session.run(None, {'x': x})"
FLOOR = "floor: ort.run on a persistent thread + call_soon_threadsafe"
NAIVE = "naive: await asyncio.to_thread(ort.run)"
INLINE = "inline: ort.run + await asyncio.sleep(0)"
OURS_50 = f"aioep: gather of {N_CONCURRENT} session.run"
NAIVE_50 = f"naive: gather of {N_CONCURRENT} to_thread(ort.run)"
FLOOR_50 = f"floor: {N_CONCURRENT} ort.run on a pool of persistent threads"


def _model(nodes: list[Any], x: list[int], y: list[int], inits: list[Any], name: str) -> Any:
    graph = h.make_graph(
        nodes,
        name,
        [h.make_tensor_value_info("x", TP.FLOAT, x)],
        [h.make_tensor_value_info("y", TP.FLOAT, y)],
        inits,
    )
    # IR 10: what every supported onnxruntime loads (onnx's default may be newer).
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=10)


def mlp(batch: int = 8, width: int = 256) -> Any:
    """x[batch, width] -> MatMul w0, Add b0, Relu -> MatMul w1, Add b1 -> y[batch, width]."""
    rng = np.random.default_rng(0)
    inits = []
    for i in range(2):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits += [
            onnx.numpy_helper.from_array(w, f"w{i}"),
            onnx.numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), f"b{i}"),
        ]
    nodes = [
        h.make_node("MatMul", ["x", "w0"], ["m0"]),
        h.make_node("Add", ["m0", "b0"], ["a0"]),
        h.make_node("Relu", ["a0"], ["r0"]),
        h.make_node("MatMul", ["r0", "w1"], ["m1"]),
        h.make_node("Add", ["m1", "b1"], ["y"]),
    ]
    return _model(nodes, [batch, width], [batch, width], inits, "mlp")


def tiny(width: int = 16) -> Any:
    """x[1, width] -> Add c -> Relu -> y[1, width]."""
    c = onnx.numpy_helper.from_array(np.linspace(-1, 1, width, dtype=np.float32), "c")
    nodes = [h.make_node("Add", ["x", "c"], ["a"]), h.make_node("Relu", ["a"], ["y"])]
    return _model(nodes, [1, width], [1, width], [c], "tiny")


def ort_session(model: Any) -> Any:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def budget_counts(env: Any) -> dict[str, Any]:
    budget = getattr(env, "inline_budget", None)  # None before aioep had one
    return {
        "inline_runs": None if budget is None else budget.inline_runs,
        "overruns": None if budget is None else budget.overruns,
    }


def session_workers(session: Any) -> int | None:
    """How many worker threads aioep's session runs on (None: not known to this aioep)."""
    workers = getattr(session, "_workers", None)
    size = getattr(workers, "max_workers", None)
    return int(size) if size is not None else None


def _section(
    samples: dict[str, list[float]], ours: list[str], baselines: list[str]
) -> dict[str, Any]:
    stats = {n: summary(v) for n, v in samples.items()}
    out: dict[str, float] = {}
    for name in ours:
        out.update(ratios(stats, name, baselines))
    return {"stats": stats, "ratios": out}


async def latency(
    model: Any, x: np.ndarray, budget_us: float | None, rounds: int, block: int
) -> dict[str, Any]:
    """(a) / (b): one model, aioep's two forms vs the floor, to_thread and inline."""
    loop = asyncio.get_running_loop()
    base = ort_session(model)
    feeds = {"x": x}
    want = base.run(None, feeds)[0]
    floor = FloorThread(loop, lambda: base.run(None, feeds))
    kwargs = {} if budget_us is None else {"inline_budget_us": budget_us}
    try:
        async with aioep.Environment(autoload=False, **kwargs) as env:
            host = env.ep_devices(device_type=aioep.DeviceType.CPU)[0]
            session = await env.create_session(model, [host], {"intra_op_num_threads": 1})
            got = (await session.run({"x": x}))["y"].numpy()
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

            async def ours() -> None:
                await session.run({"x": x})

            async def ours_ort() -> None:
                await session.run(None, {"x": x})

            async def naive() -> None:
                await asyncio.to_thread(base.run, None, feeds)

            async def inline() -> None:
                base.run(None, feeds)
                await asyncio.sleep(0)

            samples = await interleave(
                {OURS: ours, OURS_ORT: ours_ort, FLOOR: floor.hop, NAIVE: naive, INLINE: inline},
                rounds=rounds,
                block=block,
            )
            out = _section(samples, [OURS, OURS_ORT], [FLOOR, NAIVE, INLINE])
            out.update(budget_counts(env))
            await session.aclose()
    finally:
        floor.close()
    return out


async def gathered(
    model: Any, x: np.ndarray, budget_us: float | None, rounds: int, block: int
) -> dict[str, Any]:
    """(c): 50 gathered runs of aioep vs 50 gathered to_thread runs vs the floor pool."""
    loop = asyncio.get_running_loop()
    base = ort_session(model)
    feeds = {"x": x}
    kwargs = {} if budget_us is None else {"inline_budget_us": budget_us}
    async with aioep.Environment(autoload=False, **kwargs) as env:
        host = env.ep_devices(device_type=aioep.DeviceType.CPU)[0]
        session = await env.create_session(model, [host], {"intra_op_num_threads": 1})
        threads = session_workers(session) or min(32, (os.cpu_count() or 1) + 4)
        pool = FloorThread(loop, lambda: base.run(None, feeds), threads)
        try:

            async def ours() -> None:
                await asyncio.gather(*(session.run({"x": x}) for _ in range(N_CONCURRENT)))

            async def naive() -> None:
                await asyncio.gather(
                    *(asyncio.to_thread(base.run, None, feeds) for _ in range(N_CONCURRENT))
                )

            async def floor() -> None:
                await asyncio.gather(*(pool.hop() for _ in range(N_CONCURRENT)))

            samples = await interleave(
                {OURS_50: ours, NAIVE_50: naive, FLOOR_50: floor}, rounds=rounds, block=block
            )
        finally:
            pool.close()
        counts = budget_counts(env)
        await session.aclose()
    stats = {n: summary(v) for n, v in samples.items()}
    per_s = {n: N_CONCURRENT / (s["median_us"] * 1e-6) for n, s in stats.items()}
    return {
        "stats": stats,
        "runs_per_s": per_s,
        "threads": threads,
        "ratios": {
            f"throughput {OURS_50} / {NAIVE_50}": per_s[OURS_50] / per_s[NAIVE_50],
            f"throughput {OURS_50} / {FLOOR_50}": per_s[OURS_50] / per_s[FLOOR_50],
        },
        **counts,
    }


async def host_figures(quick: bool) -> dict[str, Any]:
    """(a)-(c), at each budget of `BUDGETS`."""
    rng = np.random.default_rng(1)
    x_mlp = rng.standard_normal((8, 256)).astype(np.float32)
    x_tiny = rng.standard_normal((1, 16)).astype(np.float32)
    rounds, block = (15, 20) if quick else (40, 25)
    c_rounds, c_block = (8, 3) if quick else (20, 5)
    out: dict[str, Any] = {
        "mlp": "x[8,256] -> MatMul 256x256, Add, Relu -> MatMul 256x256, Add, float32",
        "tiny": "x[1,16] -> Add, Relu, float32",
    }
    for key, budget, _ in BUDGETS:
        part: dict[str, Any] = {}
        part["mlp"] = await latency(mlp(), x_mlp, budget, rounds, block)
        part["mlp"]["target"] = 1.2
        part["tiny"] = await latency(tiny(), x_tiny, budget, rounds, block)
        part["concurrent_50"] = await gathered(mlp(), x_mlp, budget, c_rounds, c_block)
        part["concurrent_50"]["target"] = 1.2
        out[key] = part
    return out


async def per_call(fn: Any, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return times


async def burst(fn: Any, n: int, concurrent: bool) -> float:
    t0 = time.perf_counter()
    if concurrent:
        await asyncio.gather(*(fn() for _ in range(n)))
    else:
        for _ in range(n):
            await fn()
    return time.perf_counter() - t0


# --- shared helpers for figures (d)-(f) ---------------------------------------------------


def light_model(name: str) -> tuple[Any, str, str]:
    """onnx's test model ``name`` with its data input (not an initializer) and first output."""
    model = onnx.load(str(LIGHT / f"{name}.onnx"))
    inits = {i.name for i in model.graph.initializer}
    data = next(i.name for i in model.graph.input if i.name not in inits)
    return model, data, model.graph.output[0].name


def ort_bytes(model: Any) -> bytes:
    """``model`` serialised with its IR version capped for onnxruntime (as aioep does)."""
    m = copy.deepcopy(model)
    m.ir_version = min(m.ir_version, 10)
    return m.SerializeToString()


def split(model: Any, data: str, cut: str, out: str) -> tuple[Any, Any]:
    """``model`` cut at value ``cut``: (data -> cut, cut -> out)."""
    m = copy.deepcopy(model)
    m.ir_version = 10
    inits = {i.name for i in m.graph.initializer}
    keep = [i for i in m.graph.input if i.name not in inits]  # old models list weights too
    del m.graph.input[:]
    m.graph.input.extend(keep)
    ex = onnx.utils.Extractor(onnx.shape_inference.infer_shapes(m))
    return ex.extract_model([data], [cut]), ex.extract_model([cut], [out])


def stem_and_head() -> tuple[Any, Any]:
    """x[1,3,224,224] -> Conv 1x1 (3->64) -> Relu -> y[1,64,224,224] (12.8 MB); y ->
    GlobalAveragePool -> z[1,64,1,1]: little compute around a big intermediate."""
    w1 = (np.random.default_rng(2).standard_normal((64, 3, 1, 1)) / 2).astype(np.float32)
    f = TP.FLOAT
    stem = h.make_graph(
        [h.make_node("Conv", ["x", "w1"], ["c"]), h.make_node("Relu", ["c"], ["y"])],
        "stem",
        [h.make_tensor_value_info("x", f, [1, 3, 224, 224])],
        [h.make_tensor_value_info("y", f, [1, 64, 224, 224])],
        [onnx.numpy_helper.from_array(w1, "w1")],
    )
    head = h.make_graph(
        [h.make_node("GlobalAveragePool", ["y"], ["z"])],
        "head",
        [h.make_tensor_value_info("y", f, [1, 64, 224, 224])],
        [h.make_tensor_value_info("z", f, [1, 64, 1, 1])],
    )
    ops = [h.make_opsetid("", 17)]
    return (
        h.make_model(stem, opset_imports=ops, ir_version=10),
        h.make_model(head, opset_imports=ops, ir_version=10),
    )


def scale_shift_relu(rows: int = 16384, width: int = 64) -> Any:
    """x[rows, width] -> Mul -> Add -> Relu -> y[rows, width] (4 MiB in, 4 MiB out)."""
    graph = h.make_graph(
        [
            h.make_node("Mul", ["x", "s"], ["m"]),
            h.make_node("Add", ["m", "b"], ["a"]),
            h.make_node("Relu", ["a"], ["y"]),
        ],
        "scale_shift_relu",
        [h.make_tensor_value_info("x", TP.FLOAT, [rows, width])],
        [h.make_tensor_value_info("y", TP.FLOAT, [rows, width])],
        [
            onnx.numpy_helper.from_array(np.full(width, 0.5, np.float32), "s"),
            onnx.numpy_helper.from_array(np.full(width, 0.1, np.float32), "b"),
        ],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=10)


Call = Callable[[], Awaitable[Any]]


async def interleaved(contenders: dict[str, Call], rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each contender over ``rounds`` interleaved rounds of
    ``calls`` calls each; the contenders' order rotates every round."""
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name] += await per_call(contenders[name], calls)
    return {n: statistics.median(t) for n, t in times.items()}


async def with_loop_lag(work: Callable[[], Awaitable[float]]) -> tuple[float, float]:
    """Run ``work`` while a ticker sleeps 1 ms at a time: (work's result, max overshoot s)."""
    done = False
    lag = 0.0

    async def ticker() -> None:
        nonlocal lag
        while not done:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lag = max(lag, time.perf_counter() - t0 - 0.001)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        result = await work()
    finally:
        done = True
        await task
    return result, lag


async def concurrency(contenders: dict[str, Call], reps: int) -> dict[str, dict[str, float]]:
    """32 requests one after another vs concurrently, per contender, interleaved."""
    seq: dict[str, list[float]] = {n: [] for n in contenders}
    con: dict[str, list[float]] = {n: [] for n in contenders}
    lag: dict[str, list[float]] = {n: [] for n in contenders}
    names = list(contenders)
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = contenders[name]
            seq[name].append(await burst(fn, N_REQUESTS, False))
            t, worst = await with_loop_lag(lambda fn=fn: burst(fn, N_REQUESTS, True))
            con[name].append(t)
            lag[name].append(worst)
    out = {}
    for name in names:
        s, c = statistics.median(seq[name]), statistics.median(con[name])
        out[name] = {
            "sequential_req_per_s": N_REQUESTS / s,
            "concurrent_req_per_s": N_REQUESTS / c,
            "concurrent_vs_sequential": s / c,
            "loop_lag_max_ms": max(lag[name]) * 1e3,
            "loop_lag_median_of_max_ms": statistics.median(lag[name]) * 1e3,
        }
    return out


def webgpu_lock() -> Any:
    """The device lock aioep holds around onnxruntime's WebGPU calls (a fresh lock if the
    ort backend's registry is not where this benchmark expects it)."""
    with contextlib.suppress(Exception):
        from aioep_ort import _registry

        for reg in list(_registry._registrations.values()):
            if any(d.ep_name == WEBGPU for d in reg.devices):
                return reg.device_lock
    return threading.RLock()


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-3, atol=1e-4)


# --- (f): WebGPU ---------------------------------------------------------


class WebGpu:
    """aioep's WebGPU device and the same device as onnxruntime sees it."""

    def __init__(self, env: Any, dev: Any) -> None:
        self.env = env
        self.dev = dev
        self.ort_devs = [d for d in ort.get_ep_devices() if d.ep_name == WEBGPU]
        self.lock = webgpu_lock()
        self.x = np.random.default_rng(4).standard_normal((1, 3, 224, 224)).astype(np.float32)

    def ort_session(self, model: Any) -> Any:
        so = ort.SessionOptions()
        so.add_provider_for_devices(self.ort_devs, {})
        with self.lock:
            return ort.InferenceSession(ort_bytes(model), sess_options=so)

    def drop(self, held: dict[str, Any]) -> None:
        """Release onnxruntime objects (sessions, OrtValues) under the device lock."""
        with self.lock:
            held.clear()
            gc.collect()


async def webgpu_latency(g: WebGpu, name: str, rounds: int, calls: int) -> dict[str, Any]:
    """(f) one model: device-resident input in aioep vs ORT IOBinding vs ORT host input."""
    model, data, oname = light_model(name)
    x, lock = g.x, g.lock
    sess = await g.env.create_session(model, [g.dev])
    x_dev = g.env.empty(x.shape, "float32", g.dev.memory_info())
    await aioep.copy_tensors([x], [x_dev])
    held: dict[str, Any] = {"s": g.ort_session(model)}
    mi = g.ort_devs[0].memory_info(ort.OrtDeviceMemoryType.DEFAULT)
    with lock:
        held["v"] = ort.OrtValue.ortvalue_from_shape_and_type(
            list(x.shape), np.float32, memory_info=mi
        )
        ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(x)], [held["v"]], None)
        held["io"] = held["s"].io_binding()
        held["io"].bind_ortvalue_input(data, held["v"])
        held["io"].bind_output(oname, "webgpu")

    def ort_bound() -> np.ndarray:
        with lock:
            held["s"].run_with_iobinding(held["io"])
            return held["io"].copy_outputs_to_cpu()[0]

    def ort_host() -> np.ndarray:
        with lock:
            return held["s"].run(None, {data: x})[0]

    async def aioep_resident() -> Any:
        return (await sess.run({data: x_dev}, output_location="host"))[oname]

    async def ort_iobinding() -> Any:
        return await asyncio.to_thread(ort_bound)

    async def ort_host_run() -> Any:
        return await asyncio.to_thread(ort_host)

    try:
        want = await ort_host_run()  # also warms each contender up (shader compiles)
        close((await aioep_resident()).numpy(), want)
        close(await ort_iobinding(), want)
        med = await interleaved(
            {"aioep": aioep_resident, "ort_iobinding": ort_iobinding, "ort_host": ort_host_run},
            rounds,
            calls,
        )
    finally:
        g.drop(held)
        await sess.aclose()
    return {
        "aioep_device_input_ms": med["aioep"] * 1e3,
        "ort_iobinding_device_input_in_to_thread_ms": med["ort_iobinding"] * 1e3,
        "ort_run_host_input_in_to_thread_ms": med["ort_host"] * 1e3,
        "ratios": {
            "aioep device input / ORT IOBinding device input in to_thread": med["aioep"]
            / med["ort_iobinding"],
            "aioep device input / ORT run host input in to_thread": med["aioep"] / med["ort_host"],
        },
        "target": 1.1,
        "calls_per_contender": rounds * calls,
        "nodes_not_on_webgpu": sorted(
            {
                f"{n.op_type} ({ep})"
                for n, ep in zip(model.graph.node, sess.assignment)
                if ep != WEBGPU
            }
        ),
    }


async def webgpu_chain(
    g: WebGpu, m1: Any, m2: Any, names: tuple[str, str, str], rounds: int, calls: int
) -> dict[str, Any]:
    """(f) m1's output ``mid`` feeds m2: kept on the device (aioep) vs a host array (ORT)."""
    i1, mid, o2 = names
    x, lock = g.x, g.lock
    a1 = await g.env.create_session(m1, [g.dev])
    a2 = await g.env.create_session(m2, [g.dev])
    held = {"s1": g.ort_session(m1), "s2": g.ort_session(m2)}

    def ort_run(which: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
        with lock:
            return held[which].run(None, feeds)[0]

    async def aioep_chain() -> Any:
        y = (await a1.run({i1: x}))[mid]  # stays on the device
        return (await a2.run({mid: y}, output_location="host"))[o2]

    async def ort_chain() -> Any:
        y = await asyncio.to_thread(ort_run, "s1", {i1: x})  # a host array
        return await asyncio.to_thread(ort_run, "s2", {mid: y})

    try:
        want = await ort_chain()
        close((await aioep_chain()).numpy(), want)
        y_host = await asyncio.to_thread(ort_run, "s1", {i1: x})
        med = await interleaved({"aioep": aioep_chain, "ort": ort_chain}, rounds, calls)
    finally:
        g.drop(held)
        await a1.aclose()
        await a2.aclose()
    return {
        "intermediate": f"{mid} {list(y_host.shape)} float32, {y_host.nbytes / 1e6:.2f} MB",
        "aioep_on_device_ms": med["aioep"] * 1e3,
        "ort_host_arrays_in_to_thread_ms": med["ort"] * 1e3,
        "ratios": {"aioep on device / ORT host arrays in to_thread": med["aioep"] / med["ort"]},
        "target": 0.8,
        "calls_per_contender": rounds * calls,
    }


async def webgpu_figures(quick: bool) -> dict[str, Any]:
    os.environ.setdefault("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")
    try:
        import onnxruntime_ep_webgpu as webgpu
    except ImportError as exc:
        return {"skipped": f"onnxruntime-ep-webgpu is not installed ({exc})"}
    out: dict[str, Any] = {}
    async with aioep.Environment(autoload=False) as env:
        try:
            (dev,) = env.register_library("webgpu", webgpu.get_library_path())
            probe = await env.create_session(light_model("light_squeezenet")[0], [dev])
            await probe.aclose()
        except (aioep.EpError, ValueError) as exc:
            return {"skipped": f"WebGPU is unusable here: {exc}"}
        g = WebGpu(env, dev)
        hw = g.ort_devs[0].device
        out["adapter"] = f"{hw.vendor} (vendor id {hw.vendor_id:#x}, device id {hw.device_id:#x})"
        out["latency"] = {
            "light_squeezenet": await webgpu_latency(
                g, "light_squeezenet", *((3, 1) if quick else (4, 2))
            ),
            "light_resnet50": await webgpu_latency(
                g, "light_resnet50", *((1, 1) if quick else (3, 1))
            ),
        }
        sq, data, oname = light_model("light_squeezenet")
        rounds, calls = (2, 2) if quick else (4, 2)
        out["chain"] = {
            "squeezenet_halves": await webgpu_chain(
                g, *split(sq, data, "r31", oname), (data, "r31", oname), rounds, calls
            ),
            "conv_stem_head": await webgpu_chain(
                g, *stem_and_head(), ("x", "y", "z"), rounds, calls
            ),
        }
    return out


# --- (d) CPU EP ----------------------------------------------------------------------------


async def cpu_concurrency(quick: bool) -> dict[str, Any]:
    model, data, _ = light_model("light_squeezenet")
    x = np.random.default_rng(5).standard_normal((1, 3, 224, 224)).astype(np.float32)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    baseline = ort.InferenceSession(ort_bytes(model), so, providers=["CPUExecutionProvider"])
    async with aioep.Environment(autoload=False) as env:
        host = env.ep_devices(device_type=aioep.DeviceType.CPU)[0]
        sess = await env.create_session(model, [host], {"intra_op_num_threads": 1})

        async def aioep_call() -> Any:
            return await sess.run({data: x})

        async def ort_call() -> Any:
            return await asyncio.to_thread(baseline.run, None, {data: x})

        want = (await ort_call())[0]
        close(next(iter((await aioep_call()).values())).numpy(), want)
        for fn in (aioep_call, ort_call):
            await per_call(fn, 3)
        res: dict[str, Any] = await concurrency(
            {"aioep": aioep_call, "ort_to_thread": ort_call}, 3 if quick else 8
        )
        await sess.aclose()
    res["ratios"] = {
        "concurrent throughput aioep / ORT in to_thread": res["aioep"]["concurrent_req_per_s"]
        / res["ort_to_thread"]["concurrent_req_per_s"]
    }
    res["target"] = 0.95
    return res


# --- (e) sim EP: copy/compute overlap across streams --------------------------------------


async def sim_overlap(quick: bool, opts: dict[str, float]) -> dict[str, Any]:
    model = scale_shift_relu()
    x = np.random.default_rng(6).standard_normal((16384, 64)).astype(np.float32)
    want = np.maximum(x * 0.5 + 0.1, 0)
    async with aioep.Environment(autoload=False) as env:
        (sim, *_) = env.register_library("sim", "aioep_sim:SimFactory", opts)
        sess = await env.create_session(model, [sim])
        assert set(sess.assignment) == {"SimExecutionProvider"}, sess.assignment
        mem = sim.memory_info()
        async with contextlib.AsyncExitStack() as stack:
            streams = [
                await stack.enter_async_context(env.create_sync_stream(sim))
                for _ in range(N_REQUESTS)
            ]

            async def request(s: Any) -> np.ndarray:
                x_dev = env.empty(x.shape, x.dtype, mem, stream=s)
                await aioep.copy_tensors([x], [x_dev], s)
                y = (await sess.run({"x": x_dev}, stream=s))["y"]
                result = np.empty(y.shape, y.dtype)
                await aioep.copy_tensors([y], [result], s)
                return result

            async def sequential() -> float:
                t0 = time.perf_counter()
                for s in streams:
                    await request(s)
                return time.perf_counter() - t0

            async def concurrent() -> float:
                t0 = time.perf_counter()
                await asyncio.gather(*(request(s) for s in streams))
                return time.perf_counter() - t0

            close(await request(streams[0]), want)
            seq, con = [], []
            for _ in range(3 if quick else 7):
                seq.append(await sequential())
                con.append(await concurrent())
        await sess.aclose()
    s, c = statistics.median(seq), statistics.median(con)
    per_copy = x.nbytes / (opts["bandwidth_gbps"] * 1e9) + opts["latency_us"] * 1e-6
    return {
        "options": opts,
        "request": "4 MiB upload, x[16384,64] * s + b -> Relu, 4 MiB download",
        "throttled_copy_ms": per_copy * 1e3,
        "sequential_req_per_s": N_REQUESTS / s,
        "concurrent_req_per_s": N_REQUESTS / c,
        "ratios": {"throughput concurrent / one after another": s / c},
        "target": 1.6,
    }


async def main(quick: bool, only_mlp: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "machine": {**machine(), "onnxruntime": ort.__version__},
        "quick": quick,
        "aioep": str(Path(aioep.__file__).parent),
    }
    results["host"] = await host_figures(quick)
    if not only_mlp:
        results["cpu_concurrency_32"] = await cpu_concurrency(quick)
        results["sim_overlap_32"] = {
            f"{gbps}_gbps": await sim_overlap(quick, {"bandwidth_gbps": gbps, "latency_us": 200})
            for gbps in (2, 1)
        }
        results["webgpu"] = await webgpu_figures(quick)
    results["seconds"] = time.perf_counter() - t0
    return results


def report_section(title: str, section: dict[str, Any], *, at_most: bool = True) -> None:
    print(title)
    for name, stats in section["stats"].items():
        print(line(name, stats))
    target = section.get("target")
    for i, (name, ratio) in enumerate(section["ratios"].items()):
        goal = ""
        if target and i == 0:
            sign = "<=" if at_most else ">="
            goal = f" (target {sign} {target}x: {verdict(ratio, target, at_most=at_most)})"
        print(f"    {name}: {ratio:.2f}x{goal}")
    if section.get("inline_runs") is not None:
        print(f"    inline runs {section['inline_runs']}, overruns {section['overruns']}")


def report(results: dict[str, Any]) -> None:
    print(f"aioep from {results['aioep']}; load average {results['machine']['load_average']}")
    host = results["host"]
    for key, _, label in BUDGETS:
        part = host[key]
        report_section(f"(a) MLP {host['mlp']}, {label}", part["mlp"])
        report_section(f"(b) tiny model {host['tiny']}, {label}", part["tiny"])
        c = part["concurrent_50"]
        report_section(
            f"(c) {N_CONCURRENT} concurrent MLP runs, {label} ({c['threads']} threads in the "
            "floor pool)",
            c,
            at_most=False,
        )
    if "cpu_concurrency_32" in results:
        c = results["cpu_concurrency_32"]
        for name in ("aioep", "ort_to_thread"):
            t = c[name]
            print(
                f"(d) light_squeezenet, {name}: 32 one after another "
                f"{t['sequential_req_per_s']:.1f} req/s, 32 concurrent "
                f"{t['concurrent_req_per_s']:.1f} req/s, loop lag max {t['loop_lag_max_ms']:.2f} ms"
            )
        ((name, ratio),) = c["ratios"].items()
        lag = c["aioep"]["loop_lag_max_ms"]
        print(
            f"    {name}: {ratio:.2f}x (target >= 0.95x: {verdict(ratio, 0.95, at_most=False)}); "
            f"aioep loop lag max {lag:.2f} ms (target <= 10 ms: {verdict(lag, 10)})"
        )
        for s in results["sim_overlap_32"].values():
            ((name, ratio),) = s["ratios"].items()
            print(
                f"(e) sim {s['options']['bandwidth_gbps']} GB/s, latency "
                f"{s['options']['latency_us']} us: 32 one after another "
                f"{s['sequential_req_per_s']:.1f} req/s, concurrent on per-request streams "
                f"{s['concurrent_req_per_s']:.1f} req/s\n    {name}: {ratio:.2f}x "
                f"(target >= 1.6x: {verdict(ratio, 1.6, at_most=False)})"
            )
        wg = results["webgpu"]
        if "skipped" in wg:
            print(f"(f) skipped: {wg['skipped'][:200]}")
        else:
            print(f"(f) WebGPU device: {wg['adapter']}")
            for name, r in [*wg["latency"].items(), *wg["chain"].items()]:
                for i, (what, ratio) in enumerate(r["ratios"].items()):
                    goal = f" (target <= {r['target']}x)" if i == 0 else ""
                    print(f"    {name}: {what}: {ratio:.2f}x{goal}")
    print(f"total {results['seconds']:.0f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--only-mlp", action="store_true", help="figures (a)-(c) only")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args()
    results = asyncio.run(main(args.quick, args.only_mlp))
    report(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
