"""H2D/D2H bandwidth through aioep's ort backend vs ``onnxruntime.copy_tensors`` called
directly, and the event loop's worst lag while a 256 MiB copy runs.

Needs ``onnxruntime-ep-webgpu`` and a Vulkan driver (``.ci/install-webgpu.sh``); the
software adapter is enabled here. The WebGPU queue is asynchronous (an H2D copy
returns before the device is done), so every timed copy ends with a small
read-back that waits for the queue, the same one on both sides. Reps run back to
back, aioep and direct ORT alternating in order; ratios are direct time / aioep
time (median, best of, and the median of each rep's pair).

    python benchmarks/ort_copy.py [--mib 64] [--lag-mib 256] [--repeat 15]
        [--chunk-kib N | --chunk-ms MS]

Writes benchmarks/results/ort_copy.json.
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
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")

import anyio
import numpy as np

import aioep

RESULTS = Path(__file__).parent / "results" / "ort_copy.json"


async def _timed(fn: Any, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return times


class LagMonitor:
    """A task that sleeps 1 ms in a loop and records the worst gap between wake-ups."""

    def __init__(self) -> None:
        self.max_lag = 0.0
        self._stop = False

    async def run(self) -> None:
        last = time.perf_counter()
        while not self._stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.max_lag = max(self.max_lag, now - last - 0.001)
            last = now

    def stop(self) -> None:
        self._stop = True


async def _with_lag(coro_fn: Any) -> tuple[float, float]:
    mon = LagMonitor()
    task = asyncio.get_running_loop().create_task(mon.run())
    await asyncio.sleep(0.02)
    mon.max_lag = 0.0
    t0 = time.perf_counter()
    await coro_fn()
    elapsed = time.perf_counter() - t0
    await asyncio.sleep(0.01)
    mon.stop()
    await task
    return mon.max_lag, elapsed


async def main(args: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime as ort
    import onnxruntime_ep_webgpu as webgpu  # type: ignore[import-untyped]

    from aioep_ort import OrtFactory, OrtPluginDevice

    n = args.mib << 20
    results: dict[str, Any] = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "onnxruntime": ort.__version__,
        "device": "WebGPU EP 0.4.0 on Mesa lavapipe (software Vulkan)",
        "copy_mib": args.mib,
        "repeat": args.repeat,
        "load_avg_1m_before": round(os.getloadavg()[0], 2),
    }
    async with aioep.Environment(autoload=False) as env:
        options: dict[str, Any] = {}
        if args.chunk_kib is not None:
            options["chunk_bytes"] = args.chunk_kib << 10
        if args.chunk_ms is not None:
            options["chunk_ms"] = args.chunk_ms
        (dev,) = env.register_library("webgpu", webgpu.get_library_path(), options or None)
        assert isinstance(dev, OrtPluginDevice)
        assert isinstance(dev.factory, OrtFactory)
        factory = dev.factory
        mi = dev.memory_info(aioep.MemoryType.DEFAULT)
        omi = dev.ort_device.memory_info(ort.OrtDeviceMemoryType.DEFAULT)
        pacer = factory.pacer
        chunk = factory.options.chunk_bytes
        results["chunk_bytes"] = "auto" if chunk is None else chunk
        results["chunk_ms"] = factory.options.chunk_ms
        host = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
        back = np.empty_like(host)
        small_h = np.empty(4, np.uint8)

        # Every device object lives in `o`, cleared before the environment closes: an
        # OrtValue must never outlive its library's registration.
        o = SimpleNamespace()
        o.x = env.empty(n, np.uint8, mi)
        o.small = env.empty(4, np.uint8, mi)
        results["segment_bytes"] = factory.segment_bytes(o.x)

        # The same work on both sides: the same host arrays, the same read-back of 4 bytes
        # after an upload (WebGPU uploads return before the device is done), each step a
        # separate hand-off to a worker thread (aioep: its copy threads; direct ORT: what a
        # user of async code writes, anyio.to_thread).
        async def a_h2d() -> None:
            await aioep.copy_tensors([host], [o.x])
            await aioep.copy_tensors([o.small], [small_h])

        async def a_d2h() -> None:
            await aioep.copy_tensors([o.x], [back])

        o.d = ort.OrtValue.ortvalue_from_shape_and_type((n,), np.uint8, memory_info=omi)
        o.d_small = ort.OrtValue.ortvalue_from_shape_and_type((4,), np.uint8, memory_info=omi)
        o.h_ov = ort.OrtValue.ortvalue_from_numpy(host)
        o.b_ov = ort.OrtValue.ortvalue_from_numpy(back)
        o.s_ov = ort.OrtValue.ortvalue_from_numpy(small_h)

        async def o_h2d() -> None:
            await anyio.to_thread.run_sync(ort.copy_tensors, [o.h_ov], [o.d], None)
            await anyio.to_thread.run_sync(ort.copy_tensors, [o.d_small], [o.s_ov], None)

        async def o_d2h() -> None:
            await anyio.to_thread.run_sync(ort.copy_tensors, [o.d], [o.b_ov], None)

        sides = {"h2d": (a_h2d, o_h2d), "d2h": (a_d2h, o_d2h)}
        for _ in range(args.warmup):  # the first copy each way is slow (device warm-up)
            for a_fn, o_fn in sides.values():
                await a_fn()
                await o_fn()
        for direction, (a_fn, o_fn) in sides.items():
            a_s: list[float] = []
            o_s: list[float] = []
            for i in range(args.repeat):
                # Back to back, the order alternating per rep, so load and drift hit both.
                first, second = (a_fn, o_fn) if i % 2 == 0 else (o_fn, a_fn)
                t1 = (await _timed(first, 1))[0]
                t2 = (await _timed(second, 1))[0]
                a_t, o_t = (t1, t2) if i % 2 == 0 else (t2, t1)
                a_s.append(a_t)
                o_s.append(o_t)
            results[direction] = _compare(n, a_s, o_s)
        await aioep.copy_tensors([o.x], [back])
        assert np.array_equal(back, host)
        results["pacer_call_mib"] = {
            d: round(pacer.call_bytes(d) / (1 << 20), 1) for d in ("h2d", "d2h")
        }
        o.__dict__.clear()

        # Event-loop lag during a large copy, both directions, aioep and direct ORT
        # alternating; a task that sleeps 1 ms measures the worst gap between wake-ups.
        # The window ends when the copy returns (for uploads, before the device is done:
        # the read-back that would wait for it is a separate call, see the README).
        m = args.lag_mib << 20
        big = np.random.default_rng(1).integers(0, 255, m, dtype=np.uint8)
        big_back = np.empty_like(big)
        o.y = env.empty(m, np.uint8, mi)
        o.dy = ort.OrtValue.ortvalue_from_shape_and_type((m,), np.uint8, memory_info=omi)
        o.big_ov = ort.OrtValue.ortvalue_from_numpy(big)
        o.big_back_ov = ort.OrtValue.ortvalue_from_numpy(big_back)
        runs: dict[str, Any] = {
            "aioep_h2d": lambda: aioep.copy_tensors([big], [o.y]),
            "onnxruntime_to_thread_h2d": lambda: anyio.to_thread.run_sync(
                ort.copy_tensors, [o.big_ov], [o.dy], None
            ),
            "aioep_d2h": lambda: aioep.copy_tensors([o.y], [big_back]),
            "onnxruntime_to_thread_d2h": lambda: anyio.to_thread.run_sync(
                ort.copy_tensors, [o.dy], [o.big_back_ov], None
            ),
        }
        lags: dict[str, list[float]] = {k: [] for k in runs}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for fn in runs.values():
            await fn()

        async def drain() -> None:  # WebGPU uploads return early: wait for the queue
            await anyio.to_thread.run_sync(ort.copy_tensors, [o.d_small], [o.s_ov], None)

        o.d_small = ort.OrtValue.ortvalue_from_shape_and_type((4,), np.uint8, memory_info=omi)
        o.s_ov = ort.OrtValue.ortvalue_from_numpy(small_h)
        for i in range(args.lag_repeat):
            order = list(runs) if i % 2 == 0 else list(reversed(runs))
            for label in order:
                # Start each run on an idle device queue, so that no run waits (GIL held)
                # for the upload a previous run left queued.
                await drain()
                w, e = await _with_lag(runs[label])
                lags[label].append(w)
                times[label].append(e)
        big_back[:] = 0
        await aioep.copy_tensors([o.y], [big_back])
        assert np.array_equal(big_back, big)
        lag: dict[str, Any] = {"copy_mib": args.lag_mib, "repeat": args.lag_repeat}
        for label in runs:
            lag[label] = {
                "max_lag_ms": round(max(lags[label]) * 1e3, 2),
                "median_max_lag_ms": round(statistics.median(lags[label]) * 1e3, 2),
                "max_lag_ms_each": [round(x * 1e3, 1) for x in lags[label]],
                "copy_s_median": round(statistics.median(times[label]), 3),
            }
        for direction in ("h2d", "d2h"):
            a_t = statistics.median(times[f"aioep_{direction}"])
            o_t = statistics.median(times[f"onnxruntime_to_thread_{direction}"])
            lag[f"{direction}_ratio_with_ticker"] = round(o_t / a_t, 3)
        results["loop_lag"] = lag
        o.__dict__.clear()
    results["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    return results


def _compare(n: int, a_s: list[float], o_s: list[float]) -> dict[str, Any]:
    """Throughputs and ratios (direct ORT time / aioep time: > 1 means aioep is faster)."""
    a_med, o_med = statistics.median(a_s), statistics.median(o_s)
    return {
        "aioep_gbps": round(n / a_med / 1e9, 3),
        "onnxruntime_gbps": round(n / o_med / 1e9, 3),
        "ratio": round(o_med / a_med, 3),
        "ratio_best_of": round(min(o_s) / min(a_s), 3),
        "ratio_paired_median": round(statistics.median(o / a for a, o in zip(a_s, o_s)), 3),
        "aioep_s": [round(t, 4) for t in a_s],
        "onnxruntime_s": [round(t, 4) for t in o_s],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--lag-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lag-repeat", type=int, default=4)
    parser.add_argument(
        "--chunk-kib", type=int, default=None, help="fixed backend chunk_bytes / 1024 (0: none)"
    )
    parser.add_argument("--chunk-ms", type=float, default=None, help="backend chunk_ms (auto)")
    args = parser.parse_args()
    try:
        import onnxruntime_ep_webgpu  # noqa: F401
    except ImportError:
        sys.exit("needs onnxruntime-ep-webgpu: pip install -e 'backends/ort[webgpu]'")
    out = asyncio.run(main(args))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    for key in ("h2d", "d2h"):
        r = out[key]
        print(
            f"{key}: aioep {r['aioep_gbps']} GB/s, onnxruntime {r['onnxruntime_gbps']} GB/s, "
            f"ratio {r['ratio']} (median), {r['ratio_best_of']} (best of {out['repeat']}), "
            f"{r['ratio_paired_median']} (median of paired reps)"
        )
    print(
        f"chunk_bytes {out['chunk_bytes']}, chunk_ms {out['chunk_ms']}, "
        f"segment {out['segment_bytes'] >> 10} KiB, pacer call MiB {out['pacer_call_mib']}"
    )
    lag = out["loop_lag"]
    for key, r in lag.items():
        if isinstance(r, dict):
            print(
                f"loop lag {key}: max {r['max_lag_ms']} ms (each rep {r['max_lag_ms_each']}) "
                f"over a {r['copy_s_median']} s copy"
            )
    print(
        f"with the ticker running, {lag['copy_mib']} MiB: ratio h2d "
        f"{lag['h2d_ratio_with_ticker']}, d2h {lag['d2h_ratio_with_ticker']}"
    )
    print(f"load average {out['load_avg_1m_before']} -> {out['load_avg_1m_after']}")
    print(f"wrote {RESULTS}")
