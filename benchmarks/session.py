"""Session figures. Every figure is measured side by side with its baseline in one run
and printed as a ratio against it.

On the host device (a small MLP):

(a) per-call latency of ``await session.run(...)`` vs
    ``await asyncio.to_thread(onnxruntime.InferenceSession.run, ...)`` on the same model
    with the same session options (target: ratio <= 1.2x);
(b) throughput of 32 concurrent requests (``asyncio.gather``) vs the same 32 run one
    after another, for aioep and for the to_thread baseline.

Both contenders use one onnxruntime CPU session each with ``intra_op_num_threads=1``
(so concurrency, not intra-op threading, is what (b) measures).

Issue 17's figures:

(c) per-request latency of ``light_squeezenet`` and ``light_resnet50`` (onnx's test data)
    on WebGPU: aioep with the input already on the device vs onnxruntime's IOBinding with
    the same device-resident input in ``to_thread`` (target <= 1.1x), and vs plain
    ``InferenceSession.run`` with a host numpy input (reported: the copies saved). A
    request ends when its output is on the host: WebGPU queues work, and
    ``run_with_iobinding`` returns before the device has finished, so every contender
    reads its (4 KB) output back; inputs differ only in where they start;
(d) two chained models on WebGPU, the first's output feeding the second, host input in
    and host output out: aioep keeps the intermediate on the device, the onnxruntime
    baseline (two ``to_thread`` runs) hands it over as a host array (target <= 0.8x).
    Two chains: light_squeezenet cut in two after fire5 (a 746 KB intermediate), and a
    1x1-conv stem (3->64 channels) feeding a global-average-pool head (a 12.8 MB
    intermediate around little compute);
(e) 32 concurrent requests vs the same 32 one after another, aioep and
    onnxruntime-in-``to_thread`` side by side, on light_squeezenet with the CPU EP
    (``intra_op_num_threads=1``): concurrent throughput ratio aioep / onnxruntime
    (target >= 0.95x) and the event loop's max lag during aioep's concurrent runs
    (a 1 ms ticker; target <= 10 ms). On the CPU EP because WebGPU runs of one device
    are serialised on both sides (its EP crashes on overlapping device work), and 32
    WebGPU squeezenet runs take ~10 s on a software adapter;
(f) the sim EP with ``latency_us=200`` and ``bandwidth_gbps`` 2, then 1: 32 requests
    (4 MiB upload, Mul/Add/Relu, 4 MiB download), each on its own stream, concurrently
    vs one after another (target >= 1.6x throughput: one request's copies overlap
    another's copies and compute). The sim's copies are memcpys and its kernels numpy,
    on the host's cores: the overlap this can show is bounded by the free cores.

WebGPU needs ``onnxruntime-ep-webgpu`` and an adapter (``ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1``
is set if unset, so a software adapter such as lavapipe counts); without one (c) and (d)
are skipped and say why. onnxruntime's WebGPU calls hold the same device lock as aioep's
(ORT's WebGPU EP crashes when device work from several threads overlaps).

Latencies are medians over interleaved rounds (the order of the contenders rotates each
round); throughputs are medians over repetitions. Results go to
``benchmarks/results/session.json``.

Usage: ``python benchmarks/session.py [--quick] [--json PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper as h

import aioep

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "session.json"
LIGHT = Path(onnx.__file__).resolve().parent / "backend" / "test" / "data" / "light"
WEBGPU = "WebGpuExecutionProvider"
N_REQUESTS = 32


def mlp(batch: int = 8, width: int = 64, depth: int = 3) -> Any:
    """x[batch, width] -> depth x (MatMul, Add, Relu) -> MatMul -> y[batch, 10]."""
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(depth):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits += [
            onnx.numpy_helper.from_array(w, f"w{i}"),
            onnx.numpy_helper.from_array(np.zeros(width, np.float32), f"b{i}"),
        ]
        nodes += [
            h.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]),
            h.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
            h.make_node("Relu", [f"a{i}"], [f"r{i}"]),
        ]
        prev = f"r{i}"
    inits.append(
        onnx.numpy_helper.from_array(rng.standard_normal((width, 10)).astype(np.float32), "wo")
    )
    nodes.append(h.make_node("MatMul", [prev, "wo"], ["y"]))
    graph = h.make_graph(
        nodes,
        "mlp",
        [h.make_tensor_value_info("x", TP.FLOAT, [batch, width])],
        [h.make_tensor_value_info("y", TP.FLOAT, [batch, 10])],
        inits,
    )
    # IR 10: what every supported onnxruntime loads (onnx's default may be newer).
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=10)


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


async def host_mlp(quick: bool) -> dict[str, Any]:
    """Figures (a) and (b)."""
    model = mlp()
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    baseline = ort.InferenceSession(
        model.SerializeToString(), so, providers=["CPUExecutionProvider"]
    )
    rounds, calls = (5, 200) if quick else (15, 400)

    async with aioep.Environment(autoload=False) as env:
        host = env.ep_devices(device_type=aioep.DeviceType.CPU)[0]
        session = await env.create_session(model, [host], {"intra_op_num_threads": 1})
        want = baseline.run(None, {"x": x})[0]
        got = (await session.run({"x": x}))["y"].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

        async def aioep_call() -> Any:
            return await session.run({"x": x})

        async def ort_call() -> Any:
            return await asyncio.to_thread(baseline.run, None, {"x": x})

        for fn in (aioep_call, ort_call):  # warm up threads and sessions
            await per_call(fn, 50)
        a_lat: list[float] = []
        o_lat: list[float] = []
        for _ in range(rounds):  # interleave so drift hits both alike
            a_lat.append(statistics.median(await per_call(aioep_call, calls // rounds)))
            o_lat.append(statistics.median(await per_call(ort_call, calls // rounds)))
        a_med, o_med = statistics.median(a_lat), statistics.median(o_lat)

        n = 32
        reps = 5 if quick else 20
        thr: dict[str, dict[str, float]] = {}
        for name, fn in (("aioep", aioep_call), ("to_thread", ort_call)):
            seq = min([await burst(fn, n, False) for _ in range(reps)])
            con = min([await burst(fn, n, True) for _ in range(reps)])
            thr[name] = {
                "sequential_req_per_s": n / seq,
                "concurrent_req_per_s": n / con,
                "concurrent_vs_sequential": seq / con,
            }
        await session.aclose()

    return {
        "model": "MLP x[8,64] -> 3 x (MatMul 64x64, Add, Relu) -> MatMul 64x10, float32",
        "latency": {
            "aioep_session_run_us": a_med * 1e6,
            "ort_run_in_to_thread_us": o_med * 1e6,
            "ratio": a_med / o_med,
            "target_ratio_max": 1.2,
        },
        "throughput_32_requests": thr,
    }


# --- shared helpers for figures (c)-(f) ---------------------------------------------------


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


# --- (c), (d), WebGPU (e): WebGPU ---------------------------------------------------------


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
    """(c) one model: device-resident input in aioep vs ORT IOBinding vs ORT host input."""
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
        "ratio_vs_iobinding": med["aioep"] / med["ort_iobinding"],
        "target_ratio_vs_iobinding_max": 1.1,
        "ratio_vs_host_run": med["aioep"] / med["ort_host"],
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
    """(d) m1's output ``mid`` feeds m2: kept on the device (aioep) vs a host array (ORT)."""
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
        "ratio": med["aioep"] / med["ort"],
        "target_ratio_max": 0.8,
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


# --- (e) CPU EP ----------------------------------------------------------------------------


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
        res = await concurrency({"aioep": aioep_call, "ort_to_thread": ort_call}, 3 if quick else 8)
        await sess.aclose()
    return res


# --- (f) sim EP: copy/compute overlap across streams --------------------------------------


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
        "ratio": s / c,
        "target_ratio_min": 1.6,
    }


async def main(quick: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "onnxruntime": ort.__version__,
        },
        "quick": quick,
    }
    results.update(await host_mlp(quick))
    results["webgpu"] = await webgpu_figures(quick)
    results["cpu_concurrency_32"] = await cpu_concurrency(quick)
    results["sim_overlap_32"] = [
        await sim_overlap(quick, {"bandwidth_gbps": gbps, "latency_us": 200}) for gbps in (2, 1)
    ]
    results["seconds"] = time.perf_counter() - t0
    return results


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(results: dict[str, Any]) -> None:
    lat = results["latency"]
    print(
        f"(a) per-call: aioep session.run {lat['aioep_session_run_us']:.1f} us, "
        f"ORT run in to_thread {lat['ort_run_in_to_thread_us']:.1f} us, "
        f"ratio {lat['ratio']:.2f}x (target <= 1.2x)"
    )
    for name, t in results["throughput_32_requests"].items():
        print(
            f"(b) {name}: 32 sequential {t['sequential_req_per_s']:.0f} req/s, "
            f"32 concurrent {t['concurrent_req_per_s']:.0f} req/s "
            f"({t['concurrent_vs_sequential']:.2f}x)"
        )
    wg = results["webgpu"]
    if "skipped" in wg:
        print(f"(c), (d) skipped: {wg['skipped']}")
    else:
        print(f"WebGPU device: {wg['adapter']}")
        for name, r in wg["latency"].items():
            off = (
                f"; not on WebGPU: {', '.join(r['nodes_not_on_webgpu'])}"
                if r["nodes_not_on_webgpu"]
                else ""
            )
            print(
                f"(c) {name}: aioep device input {r['aioep_device_input_ms']:.1f} ms, "
                f"ORT IOBinding device input {r['ort_iobinding_device_input_in_to_thread_ms']:.1f} ms "
                f"-> {r['ratio_vs_iobinding']:.2f}x (target <= 1.1x: "
                f"{verdict(r['ratio_vs_iobinding'] <= 1.1)}); "
                f"ORT run host input {r['ort_run_host_input_in_to_thread_ms']:.1f} ms "
                f"-> {r['ratio_vs_host_run']:.2f}x [{r['calls_per_contender']} calls each{off}]"
            )
        for name, r in wg["chain"].items():
            print(
                f"(d) chain {name} ({r['intermediate']}): aioep on device "
                f"{r['aioep_on_device_ms']:.1f} ms, ORT host arrays "
                f"{r['ort_host_arrays_in_to_thread_ms']:.1f} ms -> {r['ratio']:.2f}x "
                f"(target <= 0.8x: {verdict(r['ratio'] <= 0.8)}) [{r['calls_per_contender']} calls each]"
            )
    conc = [("CPU EP, light_squeezenet", results["cpu_concurrency_32"])]
    for where, c in conc:
        for name, t in c.items():
            print(
                f"(e) {where}, {name}: 32 sequential {t['sequential_req_per_s']:.1f} req/s, "
                f"32 concurrent {t['concurrent_req_per_s']:.1f} req/s "
                f"({t['concurrent_vs_sequential']:.2f}x), loop lag max "
                f"{t['loop_lag_max_ms']:.2f} ms (median of maxima {t['loop_lag_median_of_max_ms']:.2f} ms)"
            )
        ratio = c["aioep"]["concurrent_req_per_s"] / c["ort_to_thread"]["concurrent_req_per_s"]
        c["aioep_vs_ort_concurrent_throughput"] = ratio
        lag = c["aioep"]["loop_lag_max_ms"]
        print(
            f"(e) {where}: aioep / ORT-in-threads concurrent throughput {ratio:.2f}x "
            f"(target >= 0.95x: {verdict(ratio >= 0.95)}); aioep loop lag max {lag:.2f} ms "
            f"(target <= 10 ms: {verdict(lag <= 10)})"
        )
    for s in results["sim_overlap_32"]:
        print(
            f"(f) sim bandwidth {s['options']['bandwidth_gbps']} GB/s, latency "
            f"{s['options']['latency_us']} us ({s['throttled_copy_ms']:.2f} ms a copy): "
            f"32 sequential {s['sequential_req_per_s']:.1f} req/s, 32 concurrent on "
            f"per-request streams {s['concurrent_req_per_s']:.1f} req/s -> {s['ratio']:.2f}x "
            f"(target >= 1.6x: {verdict(s['ratio'] >= 1.6)})"
        )
    print(f"total {results['seconds']:.0f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args()
    results = asyncio.run(main(args.quick))
    report(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
