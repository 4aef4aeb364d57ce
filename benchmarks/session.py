"""Session figures: a small MLP on the host device.

Prints, in one run:

(a) per-call latency of ``await session.run(...)`` vs
    ``await asyncio.to_thread(onnxruntime.InferenceSession.run, ...)`` on the same model
    with the same session options (target: ratio <= 1.2x);
(b) throughput of 32 concurrent requests (``asyncio.gather``) vs the same 32 run one
    after another, for aioep and for the to_thread baseline.

Both contenders use one onnxruntime CPU session each with ``intra_op_num_threads=1``
(so concurrency, not intra-op threading, is what (b) measures). Latencies are the
median over interleaved rounds. Results go to ``benchmarks/results/session.json``.

Usage: ``python benchmarks/session.py [--quick] [--json PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper as h

import aioep

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "session.json"


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


async def main(quick: bool) -> dict[str, Any]:
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
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "onnxruntime": ort.__version__,
        },
        "model": "MLP x[8,64] -> 3 x (MatMul 64x64, Add, Relu) -> MatMul 64x10, float32",
        "latency": {
            "aioep_session_run_us": a_med * 1e6,
            "ort_run_in_to_thread_us": o_med * 1e6,
            "ratio": a_med / o_med,
            "target_ratio_max": 1.2,
        },
        "throughput_32_requests": thr,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args()
    results = asyncio.run(main(args.quick))
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
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
