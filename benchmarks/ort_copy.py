"""H2D/D2H bandwidth through aioep's ort backend vs ``onnxruntime.copy_tensors`` called
directly, and the event loop's worst lag while a 256 MiB copy runs.

Needs ``onnxruntime-ep-webgpu`` and a Vulkan driver (``.ci/install-webgpu.sh``); the
software adapter is enabled here. The WebGPU queue is asynchronous (an H2D copy
returns before the device is done), so every timed copy ends with a small
read-back that waits for the queue, the same one on both sides.

    python benchmarks/ort_copy.py [--mib 64] [--lag-mib 256] [--repeat 5]

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
    import onnxruntime_ep_webgpu as webgpu

    n = args.mib << 20
    results: dict[str, Any] = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
        "onnxruntime": ort.__version__,
        "device": "WebGPU EP 0.4.0 on Mesa lavapipe (software Vulkan)",
        "copy_mib": args.mib,
        "repeat": args.repeat,
    }
    async with aioep.Environment(autoload=False) as env:
        options = {"chunk_bytes": args.chunk_kib << 10} if args.chunk_kib is not None else None
        (dev,) = env.register_library("webgpu", webgpu.get_library_path(), options)
        mi = dev.memory_info(aioep.MemoryType.DEFAULT)
        omi = dev.ort_device.memory_info(ort.OrtDeviceMemoryType.DEFAULT)
        results["chunk_bytes"] = dev.factory.options.chunk_bytes
        host = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
        back = np.empty_like(host)
        small_h = np.empty(4, np.uint8)

        # Every device object lives in `o`, cleared before the environment closes: an
        # OrtValue must never outlive its library's registration.
        o = SimpleNamespace()
        o.x = env.empty(n, np.uint8, mi)
        o.small = env.empty(4, np.uint8, mi)

        async def a_h2d() -> None:
            await aioep.copy_tensors([host], [o.x])
            await aioep.copy_tensors([o.small], [small_h])

        async def a_d2h() -> None:
            await aioep.copy_tensors([o.x], [back])

        # direct onnxruntime (in a worker thread, as a user would from async code)
        o.d = ort.OrtValue.ortvalue_from_shape_and_type((n,), np.uint8, memory_info=omi)
        o.d_small = ort.OrtValue.ortvalue_from_shape_and_type((4,), np.uint8, memory_info=omi)
        o.h_ov = ort.OrtValue.ortvalue_from_numpy(host)
        o.b_ov = ort.OrtValue.ortvalue_from_numpy(back)
        o.s_ov = ort.OrtValue.ortvalue_from_numpy(small_h)

        def r_h2d() -> None:
            ort.copy_tensors([o.h_ov], [o.d], None)
            ort.copy_tensors([o.d_small], [o.s_ov], None)

        async def o_h2d() -> None:
            await anyio.to_thread.run_sync(r_h2d)

        async def o_d2h() -> None:
            await anyio.to_thread.run_sync(lambda: ort.copy_tensors([o.d], [o.b_ov], None))

        for fn in (a_h2d, a_d2h, o_h2d, o_d2h):  # warm up: the first copy each way is slow
            await fn()
        series: dict[str, list[float]] = {k: [] for k in ("a_h2d", "o_h2d", "a_d2h", "o_d2h")}
        for _ in range(args.repeat):  # interleaved, so drift hits both sides alike
            for name, fn in (
                ("a_h2d", a_h2d),
                ("o_h2d", o_h2d),
                ("a_d2h", a_d2h),
                ("o_d2h", o_d2h),
            ):
                series[name] += await _timed(fn, 1)
        await aioep.copy_tensors([o.x], [back])
        assert np.array_equal(back, host)
        for direction in ("h2d", "d2h"):
            a_med = statistics.median(series[f"a_{direction}"])
            o_med = statistics.median(series[f"o_{direction}"])
            a_best = min(series[f"a_{direction}"])
            o_best = min(series[f"o_{direction}"])
            results[direction] = {
                "aioep_gbps": round(n / a_med / 1e9, 3),
                "onnxruntime_gbps": round(n / o_med / 1e9, 3),
                "ratio": round(o_med / a_med, 3),
                "ratio_best_of": round(o_best / a_best, 3),
                "aioep_s": [round(t, 4) for t in series[f"a_{direction}"]],
                "onnxruntime_s": [round(t, 4) for t in series[f"o_{direction}"]],
            }
        o.__dict__.clear()

        # event-loop lag during a large copy
        m = args.lag_mib << 20
        big = np.random.default_rng(1).integers(0, 255, m, dtype=np.uint8)
        big_back = np.empty_like(big)
        o.y = env.empty(m, np.uint8, mi)
        o.dy = ort.OrtValue.ortvalue_from_shape_and_type((m,), np.uint8, memory_info=omi)
        o.big_ov = ort.OrtValue.ortvalue_from_numpy(big)
        o.big_back_ov = ort.OrtValue.ortvalue_from_numpy(big_back)
        lag: dict[str, Any] = {"copy_mib": args.lag_mib}
        for label, fn in (
            ("aioep_h2d", lambda: aioep.copy_tensors([big], [o.y])),
            ("aioep_d2h", lambda: aioep.copy_tensors([o.y], [big_back])),
            (
                "onnxruntime_to_thread_h2d",
                lambda: anyio.to_thread.run_sync(ort.copy_tensors, [o.big_ov], [o.dy], None),
            ),
            (
                "onnxruntime_to_thread_d2h",
                lambda: anyio.to_thread.run_sync(ort.copy_tensors, [o.dy], [o.big_back_ov], None),
            ),
        ):
            worst, elapsed = 0.0, 0.0
            for _ in range(args.lag_repeat):
                w, e = await _with_lag(fn)
                worst, elapsed = max(worst, w), max(elapsed, e)
            lag[label] = {"max_lag_ms": round(worst * 1e3, 2), "copy_s": round(elapsed, 3)}
        assert np.array_equal(big_back, big)
        results["loop_lag"] = lag
        o.__dict__.clear()
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--lag-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--lag-repeat", type=int, default=2)
    parser.add_argument("--chunk-kib", type=int, default=None, help="backend chunk_bytes / 1024")
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
            f"ratio {r['ratio']} (median), {r['ratio_best_of']} (best of {out['repeat']})"
        )
    for key, r in out["loop_lag"].items():
        if isinstance(r, dict):
            print(f"loop lag {key}: {r['max_lag_ms']} ms over a {r['copy_s']} s copy")
    print(f"wrote {RESULTS}")
