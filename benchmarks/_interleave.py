"""Interleaved timing for the benchmarks: aioep and its baselines measured in one phase.

Every contender runs in short blocks, ABAB..., the order rotated each round, so that load
drift on a shared machine hits them all alike; each operation is timed on its own. The
summary of a contender is its median (and min, p99) per operation; a ratio is always a
ratio of medians measured in the same phase, and names its baseline.

``FloorThread`` is the fair floor of a thread hop: a persistent worker thread that does
the same work and completes an asyncio future with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import os
import platform
import queue
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

Op = Callable[[], Awaitable[object]]


async def interleave(
    contenders: dict[str, Op], *, rounds: int, block: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Time each contender's ``await op()``, in blocks of ``block``, for ``rounds`` rounds.

    An op that returns a float has timed itself (a latency measured inside it): that value
    is its sample. The first ``warmup`` rounds are run and thrown away. Returns name ->
    seconds per op.
    """
    names = list(contenders)
    samples: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter
    for r in range(warmup + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            op = contenders[name]
            out = samples[name]
            for _ in range(block):
                t0 = clock()
                value = await op()
                t1 = clock()
                if r >= warmup:
                    out.append(value if type(value) is float else t1 - t0)
    return samples


def summary(values: list[float]) -> dict[str, float]:
    """Median, min, p99 and mean in microseconds, and the count."""
    ordered = sorted(values)
    return {
        "median_us": statistics.median(ordered) * 1e6,
        "min_us": ordered[0] * 1e6,
        "p99_us": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6,
        "mean_us": statistics.fmean(ordered) * 1e6,
        "n": len(ordered),
    }


def ratios(stats: dict[str, dict[str, float]], ours: str, baselines: list[str]) -> dict[str, float]:
    """``ours`` median / each baseline's median, keyed ``"<ours> / <baseline>"``."""
    return {f"{ours} / {b}": stats[ours]["median_us"] / stats[b]["median_us"] for b in baselines}


class FloorThread:
    """Persistent worker threads (one unless ``threads`` says more) on one queue: each runs
    ``work()`` for a request, then completes the request's asyncio future with
    ``loop.call_soon_threadsafe`` (one hop each way). Several are the floor of concurrent
    hops."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, work: Callable[[], object], threads: int = 1
    ) -> None:
        self._loop = loop
        self._work = work
        self._jobs: queue.SimpleQueue[asyncio.Future[None] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"floor-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        get, work, call = self._jobs.get, self._work, self._loop.call_soon_threadsafe
        while True:
            fut = get()
            if fut is None:
                return
            work()
            call(fut.set_result, None)

    async def hop(self) -> None:
        """Hand the work to a thread and await its completion."""
        fut = self._loop.create_future()
        self._jobs.put(fut)
        await fut

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": platform.platform(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def line(label: str, stats: dict[str, float]) -> str:
    """One printed row: median, min and p99 in microseconds."""
    return (
        f"  {label:<52} median {stats['median_us']:8.1f} us  min {stats['min_us']:8.1f}  "
        f"p99 {stats['p99_us']:8.1f}"
    )


def verdict(value: float, target: float, *, at_most: bool = True) -> str:
    ok = value <= target if at_most else value >= target
    return "ok" if ok else "MISSED"
