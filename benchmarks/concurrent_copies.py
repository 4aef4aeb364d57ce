"""Many concurrent awaited copies: aioep's wake-ups against a thread parked per waiter.

1,000 tasks each copy 4 KiB from the host to the sim device on one of 8 streams (the sim's
``bandwidth_gbps`` set high, so every copy runs on its stream's worker thread) and wait for
it. aioep's tasks ``await`` the copy; the baseline's tasks wait the way a user without
awaitables would, ``await asyncio.to_thread(future.wait)`` in the default executor (one
parked thread per waiter, as many at once as the executor has threads). Both enqueue the
same copies on the same streams; only the waiting differs. Rounds of the two alternate
(ABAB...), and the figure is the ratio of their median throughputs (copies per second)
(target: aioep >= 1.2x the baseline).

Run: ``python benchmarks/concurrent_copies.py [--quick] [--json PATH]``; writes
``benchmarks/results/concurrent_copies.json`` by default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from _interleave import machine, verdict

import aioep
from aioep import MemoryType
from aioep_sim import SimFactory

RESULTS = Path(__file__).parent / "results" / "concurrent_copies.json"
OURS = "aioep: await copy_tensors(stream=s)"
BASE = "baseline: await asyncio.to_thread(future.wait)"


async def one_round(
    streams: list[aioep.SyncStream],
    sources: list[np.ndarray[Any, Any]],
    targets: list[aioep.Tensor],
    awaitable: bool,
) -> float:
    """Copies per second for one round of ``len(sources)`` concurrent copies."""

    async def ours(i: int) -> None:
        await aioep.copy_tensors([sources[i]], [targets[i]], stream=streams[i % len(streams)])

    async def base(i: int) -> None:
        fut = aioep.copy_tensors([sources[i]], [targets[i]], stream=streams[i % len(streams)])
        await asyncio.to_thread(fut.wait)

    task = ours if awaitable else base
    t0 = time.perf_counter()
    await asyncio.gather(*(task(i) for i in range(len(sources))))
    return len(sources) / (time.perf_counter() - t0)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    n, n_streams, rounds = (200, 8, 4) if args.quick else (1000, 8, 12)
    opts = {"bandwidth_gbps": 1000, "num_devices": 1}
    out: dict[str, Any] = {"machine": machine(), "quick": args.quick, "copies": n}
    async with aioep.Environment(autoload=False) as env:
        env.register_library("sim", SimFactory, opts)
        (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
        info = dev.memory_info(MemoryType.DEFAULT)
        rng = np.random.default_rng(0)
        sources = [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(n)]
        targets = [env.empty(4096, "uint8", info) for _ in range(n)]
        streams = [env.create_sync_stream(dev) for _ in range(n_streams)]
        try:
            rates: dict[str, list[float]] = {OURS: [], BASE: []}
            for r in range(rounds + 1):  # round 0 warms both up (threads, first touches)
                order = [(OURS, True), (BASE, False)]
                for name, awaitable in order if r % 2 else order[::-1]:
                    rate = await one_round(streams, sources, targets, awaitable)
                    if r:
                        rates[name].append(rate)
            # Every copy landed: read a few back.
            for i in range(0, n, max(1, n // 16)):
                back = np.zeros(4096, np.uint8)
                await aioep.copy_tensors([targets[i]], [back])
                assert np.array_equal(back, sources[i])
        finally:
            for s in streams:
                await s.aclose()
        del targets
    out["streams"] = n_streams
    out["copies_per_s"] = {
        name: {"median": statistics.median(v), "min": min(v), "max": max(v), "rounds": v}
        for name, v in rates.items()
    }
    ratio = statistics.median(rates[OURS]) / statistics.median(rates[BASE])
    out["ratios"] = {f"{OURS} / {BASE} (throughput)": ratio}
    out["target"] = 1.2
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 copies, fewer rounds")
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    args = parser.parse_args(argv)
    out = asyncio.run(main_async(args))
    print(
        f"{out['copies']} concurrent 4 KiB host->sim copies on {out['streams']} streams "
        "(worker path), copies per second, median of rounds (min-max):"
    )
    for name, rate in out["copies_per_s"].items():
        print(f"  {name:<52} {rate['median']:9.0f}  ({rate['min']:.0f}-{rate['max']:.0f})")
    for name, ratio in out["ratios"].items():
        print(
            f"    ratio {name}: {ratio:.2f}x (target >= 1.2x: {verdict(ratio, 1.2, at_most=False)})"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
