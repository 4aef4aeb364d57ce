"""Host->host copy figures for aioep's built-in host device.

Prints, in one run:

(a) 1 GiB ``await aioep.copy_tensors`` bandwidth vs single-threaded ``numpy.copyto``
    (target: ratio >= 1.3x on a 2-core machine);
(b) the event loop's maximum lag, seen by a 1 ms ticker task, during that copy
    (target: <= 5 ms; a blocking copy stalls the loop for the whole copy);
(c) 4 KiB ``await aioep.copy_tensors([array], [array])``, which runs inline on the loop
    (within the inline budget), vs the fair floor, the same copy with no hop:
    ``numpy.copyto`` + ``await asyncio.sleep(0)`` (target: median <= 2.5x); the naive
    ``await asyncio.to_thread(numpy.copyto, ...)`` (a thread hop) is printed beside it.
    The three are interleaved in one phase (``_interleave.py``).

Destination pages are touched before every timed copy, for both contenders, so
the figures measure copying rather than first-touch page faults. Bandwidth is the
best of several repetitions (alternating aioep and numpy), the lag a median. Results go
to ``benchmarks/results/host_copy.json``.

Usage: ``python benchmarks/host_copy.py [--quick] [--json PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from _interleave import interleave, line, machine, ratios, summary

import aioep

GIB = 1 << 30
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "host_copy.json"


def _prefault(a: np.ndarray[Any, Any]) -> None:
    # Write every page so the timed copy never takes a first-touch fault.
    a.view(np.uint8)[:: os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096] = 1


async def timed_aioep_copy(src: aioep.Tensor, dst: aioep.Tensor) -> tuple[float, float]:
    """One awaited copy: (seconds, the event loop's max lag seen by a 1 ms ticker meanwhile)."""
    stop = asyncio.Event()
    max_lag = [0.0]

    async def ticker() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            max_lag[0] = max(max_lag[0], time.perf_counter() - t - 0.001)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)  # let the ticker settle into its rhythm
    max_lag[0] = 0.0
    t0 = time.perf_counter()
    await aioep.copy_tensors([src], [dst])
    elapsed = time.perf_counter() - t0
    stop.set()
    await tick
    return elapsed, max_lag[0]


async def large_copy(
    src_t: aioep.Tensor, dst_t: aioep.Tensor, reps: int
) -> tuple[list[float], list[float], list[float]]:
    """Alternate numpy.copyto and aioep reps (so both see the same machine load)."""
    src, dst = src_t.numpy(), dst_t.numpy()
    numpy_s: list[float] = []
    aioep_s: list[float] = []
    lags: list[float] = []
    for _ in range(reps):
        _prefault(dst)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        numpy_s.append(time.perf_counter() - t0)
        _prefault(dst)
        elapsed, lag = await timed_aioep_copy(src_t, dst_t)
        aioep_s.append(elapsed)
        lags.append(lag)
        if not np.array_equal(src[:: 1 << 16], dst[:: 1 << 16]):
            raise SystemExit("host copy produced wrong bytes")
    return numpy_s, aioep_s, lags


SMALL = "aioep: await copy_tensors (inline)"
FLOOR = "floor: numpy.copyto + await sleep(0)"
NAIVE = "naive: await asyncio.to_thread(numpy.copyto)"


async def small_latency(nbytes: int, rounds: int, block: int) -> dict[str, Any]:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)

    async def ours() -> None:
        await aioep.copy_tensors([src], [dst])

    async def floor() -> None:
        np.copyto(dst, src)
        await asyncio.sleep(0)

    async def naive() -> None:
        await asyncio.to_thread(np.copyto, dst, src)

    samples = await interleave(
        {SMALL: ours, FLOOR: floor, NAIVE: naive}, rounds=rounds, block=block
    )
    assert np.array_equal(src, dst)
    stats = {name: summary(v) for name, v in samples.items()}
    return {"stats": stats, "ratios": ratios(stats, SMALL, [FLOOR, NAIVE])}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    size = (64 << 20) if args.quick else GIB
    reps = 3 if args.quick else 5
    async with aioep.Environment(autoload=False) as env:
        src_t = env.empty(size, np.uint8)
        dst_t = env.empty(size, np.uint8)
        src = src_t.numpy()
        src[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)  # touches every page
        dst = dst_t.numpy()

        numpy_s, aioep_s, lags = await large_copy(src_t, dst_t, reps)
        if not np.array_equal(src, dst):
            raise SystemExit("host copy produced wrong bytes")
        del src, dst, src_t, dst_t

        small = 4096
        rounds, block = (20, 20) if args.quick else (60, 40)
        small_copy = await small_latency(small, rounds, block)
        budget = getattr(env, "inline_budget", None)  # None before aioep had one
        small_copy.update(
            nbytes=small,
            target_ratio=2.5,
            inline_runs=None if budget is None else budget.inline_runs,
            overruns=None if budget is None else budget.overruns,
        )

    np_gbps = size / min(numpy_s) / 1e9
    ours_gbps = size / min(aioep_s) / 1e9
    ratio = ours_gbps / np_gbps
    median_ratio = statistics.median(numpy_s) / statistics.median(aioep_s)
    lag_ms = statistics.median(lags) * 1e3
    small_copy["met"] = small_copy["ratios"][f"{SMALL} / {FLOOR}"] <= 2.5
    return {
        "machine": machine(),
        "quick": args.quick,
        "large_copy": {
            "nbytes": size,
            "aioep_gbps": round(ours_gbps, 3),
            "numpy_copyto_gbps": round(np_gbps, 3),
            "ratio": round(ratio, 3),
            "median_ratio": round(median_ratio, 3),
            "numpy_copyto_s": [round(x, 4) for x in numpy_s],
            "aioep_s": [round(x, 4) for x in aioep_s],
            "target_ratio": 1.3,
            "met": ratio >= 1.3,
        },
        "loop_lag": {
            "median_ms": round(lag_ms, 3),
            "max_ms": round(max(lags) * 1e3, 3),
            "per_rep_ms": [round(x * 1e3, 3) for x in lags],
            "target_ms": 5.0,
            "met": lag_ms <= 5.0,
        },
        "small_copy": small_copy,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB instead of 1 GiB, fewer reps")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    r = asyncio.run(main_async(args))
    big, lag, small = r["large_copy"], r["loop_lag"], r["small_copy"]

    def mark(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    mib = big["nbytes"] >> 20
    print(f"aioep host copy benchmark ({r['machine']['cpus']} CPUs, numpy {np.__version__})")
    print(
        f"(a) {mib} MiB host->host: aioep {big['aioep_gbps']:.2f} GB/s vs numpy.copyto "
        f"{big['numpy_copyto_gbps']:.2f} GB/s (best of {len(big['aioep_s'])}) -> "
        f"{big['ratio']:.2f}x, median {big['median_ratio']:.2f}x (target >= 1.3x: {mark(big['met'])})"
    )
    print(
        f"(b) event-loop max lag during the copy (1 ms ticker): median over reps "
        f"{lag['median_ms']:.2f} ms, worst {lag['max_ms']:.2f} ms (target <= 5 ms: {mark(lag['met'])})"
    )
    print(
        f"(c) 4 KiB latency, interleaved (inline runs {small['inline_runs']}, overruns {small['overruns']}):"
    )
    for name, stats in small["stats"].items():
        print(line(name, stats))
    for i, (name, ratio) in enumerate(small["ratios"].items()):
        goal = f" (target <= 2.5x: {mark(small['met'])})" if i == 0 else ""
        print(f"    ratio {name}: {ratio:.2f}x{goal}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(r, indent=2) + "\n")
    print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
