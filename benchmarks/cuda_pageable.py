"""Pageable host memory on CUDA: aioep's staged copies vs CuPy and PyTorch, side by side.

Measured in one run, on one device:

* ``await copy_tensors([numpy_array], [gpu_tensor], stream=s)`` (H2D) and the way back (D2H)
  of ``--size`` bytes (default 1 GiB) of plain pageable numpy memory, through the staged
  path (pinned chunks, worker threads) with the backend's staging options;
* the same copies unstaged (``staging_chunks=0``: the driver's own pageable copies);
* CuPy ``ndarray.set`` / ``ndarray.get`` and PyTorch ``.cuda()`` / ``.cpu()`` of the same
  array, where installed (skipped, with the reason recorded, where not);
* the event loop's largest lag while aioep's copies run (a 1 ms ticker);
* the peak pinned staging memory against its configured bound.

Targets (issue 26, judged on a GPU only): H2D >= 2.5x CuPy ``set`` and PyTorch ``.cuda()``;
D2H >= 1.4x CuPy ``get``; loop lag <= 2 ms; peak staging memory <= the bound.

``--emulator`` runs on the emulated driver of ``tests/cuda_emulator`` (a test double, not a
GPU; implies ``--quick``): it reports the staged path's cost against the unstaged path there,
which says nothing about a GPU (reported, not judged). ``--sweep`` also measures a few staging
configurations (chunk size x threads), to choose the defaults on a GPU.

Writes ``benchmarks/results/cuda_pageable.json`` (or ``--json PATH``). Run:
``python benchmarks/cuda_pageable.py [--quick] [--emulator] [--sweep] [--size BYTES]``.
Without a GPU (and without ``--emulator``) it prints "skipped: no GPU" and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

MiB, GiB = 1 << 20, 1 << 30
RESULTS = Path(__file__).parent / "results" / "cuda_pageable.json"
_CHILD = "AIOEP_PAGEABLE_BENCH_CHILD"
TARGETS = {"h2d_vs_cupy": 2.5, "h2d_vs_torch": 2.5, "d2h_vs_cupy": 1.4, "max_lag_ms": 2.0}


def _gpu_available() -> bool:
    try:
        from aioep_cuda._driver import check, load_driver

        drv = load_driver()
        return int(check(drv.cuDeviceGetCount(), "cuDeviceGetCount")) > 0
    except Exception:
        return False


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


async def _timed(fn: Callable[[], Awaitable[Any]], reps: int) -> float:
    """Median seconds of ``reps`` runs after one warm-up."""
    await fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _Ticker:
    """The event loop's largest lag: a 1 ms sleep that wakes late by that much."""

    def __init__(self) -> None:
        self.lag = 0.0
        self._stop = False
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while not self._stop:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lag = max(self.lag, time.perf_counter() - t0 - 0.001)

    async def __aenter__(self) -> _Ticker:
        self._task = asyncio.ensure_future(self._run())
        await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop = True
        assert self._task is not None
        await self._task


async def _aioep(
    src: np.ndarray[Any, Any], out: np.ndarray[Any, Any], options: dict[str, Any], reps: int
) -> dict[str, Any]:
    """H2D and D2H of ``src`` through aioep with ``options``; lag and staging memory."""
    import aioep

    async with aioep.Environment(backends=["cuda"], backend_options={"cuda": options}) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        mem = gpu.memory_info(aioep.MemoryType.DEFAULT)
        assert mem is not None
        dev = env.empty(src.shape, src.dtype, mem)
        async with env.create_sync_stream(gpu) as stream, _Ticker() as ticker:
            h2d = await _timed(lambda: env.copy_tensors([src], [dev], stream=stream), reps)
            d2h = await _timed(lambda: env.copy_tensors([dev], [out], stream=stream), reps)
        ok = bool(np.array_equal(out, src))
        dev.buffer.free()
        factory = gpu.factory
        stager = factory.staging.stager(factory.devices[gpu.hardware.device_id])
        stats = stager.stats()
        return {
            "options": options,
            "h2d_s": h2d,
            "d2h_s": d2h,
            "h2d_GBps": _gbps(src.nbytes, h2d),
            "d2h_GBps": _gbps(src.nbytes, d2h),
            "bytes_ok": ok,
            "max_lag_ms": ticker.lag * 1e3,
            "staging": stats,
            "device": dict(gpu.hardware.metadata),
        }


def _cupy(src: np.ndarray[Any, Any], out: np.ndarray[Any, Any], reps: int) -> dict[str, Any]:
    try:
        import cupy

        d = cupy.empty(src.shape, src.dtype)

        def h2d() -> None:
            d.set(src)
            cupy.cuda.Device().synchronize()

        def d2h() -> None:
            d.get(out=out)
            cupy.cuda.Device().synchronize()

        h, g = _time_sync(h2d, reps), _time_sync(d2h, reps)
        return {
            "set_s": h,
            "get_s": g,
            "set_GBps": _gbps(src.nbytes, h),
            "get_GBps": _gbps(src.nbytes, g),
            "version": cupy.__version__,
        }
    except Exception as exc:  # not installed, or no runtime for it (the emulator)
        return {"skipped": f"{type(exc).__name__}: {exc}"}


def _torch(src: np.ndarray[Any, Any], reps: int) -> dict[str, Any]:
    try:
        import torch

        host = torch.from_numpy(src)
        dev = host.cuda()

        def h2d() -> None:
            host.cuda()
            torch.cuda.synchronize()

        def d2h() -> None:
            dev.cpu()
            torch.cuda.synchronize()

        h, g = _time_sync(h2d, reps), _time_sync(d2h, reps)
        return {
            "cuda_s": h,
            "cpu_s": g,
            "cuda_GBps": _gbps(src.nbytes, h),
            "cpu_GBps": _gbps(src.nbytes, g),
            "version": torch.__version__,
        }
    except Exception as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"}


def _time_sync(fn: Callable[[], None], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ratios(results: dict[str, Any]) -> dict[str, Any]:
    staged = results["aioep_staged"]
    out: dict[str, Any] = {
        "h2d_vs_unstaged": staged["h2d_GBps"] / results["aioep_unstaged"]["h2d_GBps"],
        "d2h_vs_unstaged": staged["d2h_GBps"] / results["aioep_unstaged"]["d2h_GBps"],
    }
    cupy, torch = results["cupy"], results["torch"]
    if "skipped" not in cupy:
        out["h2d_vs_cupy"] = staged["h2d_GBps"] / cupy["set_GBps"]
        out["d2h_vs_cupy"] = staged["d2h_GBps"] / cupy["get_GBps"]
    if "skipped" not in torch:
        out["h2d_vs_torch"] = staged["h2d_GBps"] / torch["cuda_GBps"]
        out["d2h_vs_torch"] = staged["d2h_GBps"] / torch["cpu_GBps"]
    return out


def _judge(results: dict[str, Any]) -> dict[str, str]:
    """Each target: "pass", "FAIL", or why it was not judged."""
    if results["emulated"]:
        return {k: "not judged: the emulated driver is not a GPU" for k in TARGETS}
    if results["quick"]:
        return {k: "not judged: --quick sizes" for k in TARGETS}
    ratios, staged = results["ratios"], results["aioep_staged"]
    verdict: dict[str, str] = {}
    for key, target in TARGETS.items():
        if key == "max_lag_ms":
            verdict[key] = "pass" if staged["max_lag_ms"] <= target else "FAIL"
        elif key in ratios:
            verdict[key] = "pass" if ratios[key] >= target else "FAIL"
        else:
            verdict[key] = "not measured: baseline skipped (see its entry)"
    stats = staged["staging"]
    verdict["staging_within_bound"] = (
        "pass" if stats["peak_bytes"] <= stats["bound_bytes"] else "FAIL"
    )
    verdict["bytes_ok"] = "pass" if staged["bytes_ok"] else "FAIL"
    return verdict


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    size = args.size
    reps = 2 if args.quick else 5
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, size, dtype=np.uint8)  # pageable
    out = np.zeros_like(src)
    staged_opts: dict[str, Any] = {}
    for key in ("chunk_bytes", "chunks", "threads"):
        value = getattr(args, key)
        if value is not None:
            staged_opts[f"staging_{key}"] = value
    results: dict[str, Any] = {
        "bytes": size,
        "quick": args.quick,
        "emulated": args.emulator,
        "reps": reps,
        "cpu_count": os.cpu_count(),
    }
    results["aioep_staged"] = await _aioep(src, out, staged_opts, reps)
    out[...] = 0
    results["aioep_unstaged"] = await _aioep(src, out, {"staging_chunks": 0}, reps)
    results["cupy"] = _cupy(src, out, reps)
    results["torch"] = _torch(src, reps)
    if args.sweep:
        sweep = []
        for chunk in (16 * MiB, 32 * MiB, 64 * MiB):
            for threads in (4, 8, 16):
                opts = {"staging_chunk_bytes": min(chunk, size), "staging_threads": threads}
                r = await _aioep(src, out, opts, reps)
                sweep.append({k: r[k] for k in ("options", "h2d_GBps", "d2h_GBps", "bytes_ok")})
        results["sweep"] = sweep
    results["ratios"] = _ratios(results)
    results["verdict"] = _judge(results)
    return results


def _run_on_emulator(argv: Sequence[str]) -> int:
    """Re-run this script in a child process that loads the emulated driver."""
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "tests"))
    import cuda_emulator

    env = cuda_emulator.child_env(cuda_emulator.build())
    env[_CHILD] = "1"
    return subprocess.run([sys.executable, __file__, *argv], env=env, check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB (a smoke test)")
    parser.add_argument("--emulator", action="store_true", help="the emulated driver (--quick)")
    parser.add_argument("--sweep", action="store_true", help="also a few staging configurations")
    parser.add_argument("--size", type=int, default=None, help="bytes per copy (default 1 GiB)")
    parser.add_argument("--chunk-bytes", dest="chunk_bytes", type=int, default=None)
    parser.add_argument("--chunks", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"output (default {RESULTS})")
    args = parser.parse_args(argv)
    if args.emulator and os.environ.get(_CHILD) != "1":
        return _run_on_emulator(argv)
    args.quick = args.quick or args.emulator
    if args.size is None:
        args.size = 64 * MiB if args.quick else GiB
    if not _gpu_available():
        print("skipped: no GPU")
        return 0
    results = asyncio.run(_main(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    staged, unstaged = results["aioep_staged"], results["aioep_unstaged"]
    print(f"pageable {args.size / MiB:.0f} MiB, {'emulated driver' if args.emulator else 'GPU'}")
    print(
        f"  aioep staged   H2D {staged['h2d_GBps']:7.2f} GB/s  D2H {staged['d2h_GBps']:7.2f} GB/s"
        f"  loop lag {staged['max_lag_ms']:.2f} ms"
    )
    print(
        f"  aioep unstaged H2D {unstaged['h2d_GBps']:7.2f} GB/s  D2H {unstaged['d2h_GBps']:7.2f}"
        f" GB/s  loop lag {unstaged['max_lag_ms']:.2f} ms"
    )
    for name in ("cupy", "torch"):
        entry = results[name]
        if "skipped" in entry:
            print(f"  {name}: skipped ({entry['skipped']})")
        else:
            h, d = ("set", "get") if name == "cupy" else ("cuda", "cpu")
            print(
                f"  {name:14} H2D {entry[h + '_GBps']:7.2f} GB/s  D2H {entry[d + '_GBps']:7.2f} GB/s"
            )
    stats = staged["staging"]
    print(
        f"  staging: peak {stats['peak_bytes'] / MiB:.1f} MiB of a {stats['bound_bytes'] / MiB:.1f}"
        f" MiB bound ({stats['chunks']} x {stats['chunk_bytes'] / MiB:.1f} MiB, "
        f"{stats['threads']} threads)"
    )
    for key, value in results["ratios"].items():
        print(f"  ratio {key}: {value:.2f}x")
    for key, value in results["verdict"].items():
        print(f"  {key}: {value}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
