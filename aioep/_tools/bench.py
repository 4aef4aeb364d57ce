"""``python -m aioep bench``: copy and wake micro-benchmarks with their baselines side by side.

Per device pair (``host->host``, ``host->sim:0``, ``sim:0->host`` ...) it measures

* copy bandwidth by transfer size: ``await copy_tensors(..., stream=s)`` against
  ``numpy.copyto`` of the same bytes (the host memcpy ceiling), timed directly and
  alternated with aioep's runs;
* 4 KiB copy latency: ``await copy_tensors`` against its fair floor, the same copy with
  the same number of thread hops (``numpy.copyto`` + ``await asyncio.sleep(0)`` where
  aioep copies inline; a persistent thread doing the ``numpy.copyto`` and completing an
  asyncio future with ``call_soon_threadsafe`` where it hops), and against the naive
  ``await anyio.to_thread.run_sync(numpy.copyto, ...)``; the three are interleaved;
* wake latency per device: from the moment the device's stream thread completes a
  copy to the moment the awaiting task runs, against a persistent thread that calls
  ``loop.call_soon_threadsafe`` after the same memcpy, sample by sample in turn.

It runs under asyncio (the baselines are asyncio's). The numbers are for
comparing on one machine in one run; they are not a benchmark suite.

Every series of timings (aioep's and each baseline's) is a `pyperf.Benchmark`:
pyperf computes the statistics (best value, median), and ``--pyperf FILE.json``
writes them all as a pyperf suite for ``python -m pyperf stats|hist|compare_to``.
pyperf's own `pyperf.Runner` does not fit: it measures one function per
worker *process* and parses the command line itself, while ``bench`` must time
awaits on devices that one process's environment opened, and print aioep and its
baseline side by side from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import queue
import sys
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt

from .._base.errors import InvalidArgument
from .._base.types import DeviceType, MemoryType
from .._environment.environment import Environment
from .._plugin.device import EpDevice
from .._plugin.stream import SyncStream
from .._plugin.tensor import Tensor
from .bench_report import (
    LATENCY_BYTES,
    BandwidthPoint,
    BenchReport,
    KiB,
    LatencyPoint,
    MiB,
    format_report,
    plot_report,
    size_label,
)

if TYPE_CHECKING:
    import pyperf

__all__ = [
    "BandwidthPoint",
    "BenchReport",
    "LatencyPoint",
    "add_parser",
    "format_report",
    "main",
    "parse_backend_options",
    "plot_report",
    "run_bench",
]

DEFAULT_SIZES = (4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB)
QUICK_SIZES = (4 * KiB, MiB)
WAKE_BYTES = MiB  # big enough that the copy finishes on the stream's thread, not inline


def _label(dev: EpDevice) -> str:
    if dev.hardware.type is DeviceType.CPU:
        return "host"
    short = dev.ep_name.removesuffix("ExecutionProvider").lower() or dev.ep_name
    return f"{short}:{dev.hardware.device_id}"


def _matches(dev: EpDevice, wanted: str) -> bool:
    w = wanted.lower()
    return w in (_label(dev), dev.ep_name.lower()) or _label(dev).split(":")[0] == w


def _pick_devices(env: Environment, wanted: str | None) -> list[EpDevice]:
    chosen: list[EpDevice] = []
    seen_eps: set[str] = set()
    for dev in env.ep_devices():
        if dev.memory_info(MemoryType.DEFAULT) is None:
            continue
        if wanted is None:
            if dev.ep_name in seen_eps:  # the first device of each EP is enough by default
                continue
        elif not _matches(dev, wanted):
            continue
        seen_eps.add(dev.ep_name)
        chosen.append(dev)
    if wanted is not None and not chosen:
        names = sorted(
            {_label(d) for d in env.ep_devices()} | {d.ep_name for d in env.ep_devices()}
        )
        raise InvalidArgument(f"bench --device {wanted!r}: no such device; choose from {names}")
    return chosen


def _benchmark(
    report: BenchReport, name: str, values: Sequence[float], warmups: Sequence[float]
) -> pyperf.Benchmark:
    """``values`` (seconds) as a pyperf benchmark named ``name``, kept in ``report``."""
    import pyperf

    run = pyperf.Run(
        [max(v, 1e-12) for v in values],  # pyperf takes positive values; a clock tick is 0
        warmups=[(1, max(w, 0.0)) for w in warmups],
        metadata={"name": name, "unit": "second", "loops": 1},
        collect_metadata=False,
    )
    bench = pyperf.Benchmark([run])
    report.benchmarks.append(bench)
    return bench


async def _interleaved(
    report: BenchReport,
    contenders: Sequence[tuple[str, Callable[[], Awaitable[object]]]],
    *,
    rounds: int,
    block: int,
) -> list[pyperf.Benchmark]:
    """Time each contender's ``await fn()`` in blocks of ``block``, in turn (the order
    rotated each round) for ``rounds`` rounds after one warm-up round: load drift on the
    machine hits them all alike. One pyperf benchmark per contender, in order."""
    samples: list[list[float]] = [[] for _ in contenders]
    warmups: list[list[float]] = [[] for _ in contenders]
    clock = time.perf_counter
    order = list(range(len(contenders)))
    for r in range(rounds + 1):
        shift = r % len(order)
        for k in order[shift:] + order[:shift]:
            fn = contenders[k][1]
            out = samples[k] if r else warmups[k]
            for _ in range(block):
                t0 = clock()
                await fn()
                out.append(clock() - t0)
    return [
        _benchmark(report, name, values, warmups[k][:1])
        for k, ((name, _), values) in enumerate(zip(contenders, samples))
    ]


class _HopThread:
    """The fair floor of a thread hop: a persistent thread that runs ``work()`` for each
    request and completes the request's future with ``loop.call_soon_threadsafe``."""

    def __init__(self, work: Callable[[], object]) -> None:
        self._loop = asyncio.get_running_loop()
        self._work = work
        self._jobs: queue.SimpleQueue[asyncio.Future[float] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bench-floor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        get, work, call = self._jobs.get, self._work, self._loop.call_soon_threadsafe
        while True:
            fut = get()
            if fut is None:
                return
            work()
            call(fut.set_result, time.perf_counter())

    async def hop(self) -> float:
        """Run the work on the thread; returns when the thread finished it (perf_counter)."""
        fut: asyncio.Future[float] = self._loop.create_future()
        self._jobs.put(fut)
        return await fut

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def _pairs(
    env: Environment, dev: EpDevice, nbytes: int
) -> list[tuple[str, Tensor | npt.NDArray[np.uint8], Tensor | npt.NDArray[np.uint8]]]:
    """(label, source, destination) for each direction between the host and ``dev``."""
    info = dev.memory_info(MemoryType.DEFAULT)
    assert info is not None
    host = np.ones(nbytes, np.uint8)
    if dev.hardware.type is DeviceType.CPU:
        return [("host->host", host, env.empty(nbytes, np.uint8, info))]
    on_dev = env.empty(nbytes, np.uint8, info)
    back = np.zeros(nbytes, np.uint8)
    name = _label(dev)
    return [(f"host->{name}", host, on_dev), (f"{name}->host", on_dev, back)]


def _copyto_seconds(dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8]) -> float:
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


async def _bench_device(
    env: Environment,
    dev: EpDevice,
    stream: SyncStream | None,
    report: BenchReport,
    sizes: Sequence[int],
    quick: bool,
) -> None:
    reps, rounds, block = (2, 3, 5) if quick else (5, 20, 10)
    for nbytes in sizes:
        a = np.ones(nbytes, np.uint8)
        b = np.empty_like(a)
        size = size_label(nbytes)
        pairs = _pairs(env, dev, nbytes)
        copies: list[list[float]] = [[] for _ in pairs]
        warm: list[list[float]] = [[] for _ in pairs]
        base: list[float] = []
        base_warm = [_copyto_seconds(b, a)]  # first touch of b's pages
        for k, (_, src, dst) in enumerate(pairs):
            t0 = time.perf_counter()
            await env.copy_tensors([src], [dst], stream)
            warm[k].append(time.perf_counter() - t0)
        # numpy.copyto timed directly (no coroutine around it), alternated with aioep's runs.
        for _ in range(reps):
            base.append(_copyto_seconds(b, a))
            for k, (_, src, dst) in enumerate(pairs):
                t0 = time.perf_counter()
                await env.copy_tensors([src], [dst], stream)
                copies[k].append(time.perf_counter() - t0)
        name = f"copy {size}: numpy.copyto (beside {_label(dev)})"
        best_base = min(_benchmark(report, name, base, base_warm).get_values())
        for k, (label, _, _) in enumerate(pairs):
            bench = _benchmark(report, f"copy {size}: {label}", copies[k], warm[k])
            t = min(bench.get_values())  # best of N: the bandwidth the path can reach
            report.bandwidth.append(
                BandwidthPoint(label, nbytes, nbytes / t / 1e9, nbytes / best_base / 1e9)
            )

    a4 = np.ones(LATENCY_BYTES, np.uint8)
    b4 = np.empty_like(a4)
    floor = _HopThread(lambda: np.copyto(b4, a4))

    async def to_thread() -> None:
        await anyio.to_thread.run_sync(np.copyto, b4, a4)

    async def copyto_sleep0() -> None:
        np.copyto(b4, a4)
        await asyncio.sleep(0)

    size = size_label(LATENCY_BYTES)
    try:
        for label, src, dst in _pairs(env, dev, LATENCY_BYTES):

            async def small(src: Any = src, dst: Any = dst) -> None:
                await env.copy_tensors([src], [dst], stream)

            # The fair floor does what aioep does: no hop where the copy ran inline.
            probe = env.copy_tensors([src], [dst], stream)
            inline = probe.done()
            await probe
            floor_name = "numpy.copyto + sleep(0)" if inline else "thread + call_soon_threadsafe"
            ours, fair, naive = await _interleaved(
                report,
                [
                    (f"latency {size}: {label}", small),
                    (
                        f"latency {size}: {floor_name} (beside {label})",
                        copyto_sleep0 if inline else floor.hop,
                    ),
                    (f"latency {size}: to_thread (beside {label})", to_thread),
                ],
                rounds=rounds,
                block=block,
            )
            report.copy_latency.append(
                LatencyPoint(
                    label,
                    ours.median() * 1e6,
                    fair.median() * 1e6,
                    floor_name,
                    naive.median() * 1e6,
                    "to_thread",
                )
            )
        if stream is not None:
            label = _label(dev)
            ours_s, theirs_s = await _wake_latency(env, dev, stream, 20 if quick else 200)
            # The first sample of each is a warm-up (thread start-up, first wake of the loop).
            ours_us = math.nan
            if ours_s:
                warm_s, timed = (ours_s[:1], ours_s[1:]) if len(ours_s) > 1 else ([], ours_s)
                ours_us = _benchmark(report, f"wake: {label}", timed, warm_s).median() * 1e6
            name = f"wake: call_soon_threadsafe (beside {label})"
            theirs_us = _benchmark(report, name, theirs_s[1:], theirs_s[:1]).median() * 1e6
            report.wake_latency.append(
                LatencyPoint(label, ours_us, theirs_us, "call_soon_threadsafe")
            )
    finally:
        floor.close()


def _stamp(into: list[tuple[float, int]]) -> None:
    into.append((time.perf_counter(), threading.get_ident()))


async def _wake_latency(
    env: Environment, dev: EpDevice, stream: SyncStream, n: int
) -> tuple[list[float], list[float]]:
    """Times (s) from a thread finishing a copy to the awaiting task running: aioep's stream
    thread, and a persistent thread calling ``call_soon_threadsafe`` after the same memcpy,
    sample by sample in turn. aioep's list is empty when every copy completed inline."""
    _, src, dst = _pairs(env, dev, WAKE_BYTES)[0]
    a = np.ones(WAKE_BYTES, np.uint8)
    b = np.empty_like(a)
    floor = _HopThread(lambda: np.copyto(b, a))
    ours: list[float] = []
    theirs: list[float] = []
    here = threading.get_ident()
    try:
        for _ in range(n + 1):
            stamp: list[tuple[float, int]] = []
            fut = env.copy_tensors([src], [dst], stream)
            fut.notification.impl.add_done_callback(functools.partial(_stamp, stamp))
            await fut
            woke = time.perf_counter()
            if stamp and stamp[0][1] != here:  # completed on the device thread, not inline
                ours.append(woke - stamp[0][0])
            stamped = await floor.hop()
            theirs.append(time.perf_counter() - stamped)
    finally:
        floor.close()
    return ours, theirs


async def run_bench(
    *,
    device: str | None = None,
    quick: bool = False,
    sizes: Sequence[int] | None = None,
    backend_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> BenchReport:
    """Run the benchmarks in a fresh environment (must run under asyncio).

    Args:
        device: only devices whose label (``host``, ``sim:0``) or EP name matches;
            default: the first device of each EP.
        quick: two sizes and few repetitions (a smoke test, a second or two).
        sizes: transfer sizes in bytes (default: 4 KiB to 64 MiB).
        backend_options: passed to [`Environment`][aioep.Environment], e.g. ``{"sim":
            {"bandwidth_gbps": 8}}``.

    Raises:
        ModuleNotFoundError: pyperf is not installed (``pip install "aioep[bench]"``).
    """
    try:
        import pyperf  # noqa: F401  (the statistics and the --pyperf suite)
    except ImportError as exc:
        raise ModuleNotFoundError(
            'python -m aioep bench measures with pyperf: pip install "aioep[bench]"'
        ) from exc
    report = BenchReport(quick=quick)
    chosen_sizes = tuple(sizes or (QUICK_SIZES if quick else DEFAULT_SIZES))
    env = Environment(backend_options=backend_options)
    with warnings.catch_warnings():
        # A backend that cannot start is listed in the report (load_errors), not raised.
        warnings.simplefilter("ignore", RuntimeWarning)
        env.open()
    try:
        report.load_errors = dict(env.load_errors)
        for dev in _pick_devices(env, device):
            report.devices.append(f"{_label(dev)} ({dev.ep_name})")
            try:
                stream: SyncStream | None = env.create_sync_stream(dev)
            except NotImplementedError:
                stream = None
            try:
                await _bench_device(env, dev, stream, report, chosen_sizes, quick)
            finally:
                if stream is not None:
                    await stream.aclose()
    finally:
        await env.aclose()
    return report


def parse_backend_options(items: Sequence[str]) -> dict[str, dict[str, str]]:
    """``["sim.bandwidth_gbps=8"]`` -> ``{"sim": {"bandwidth_gbps": "8"}}``.

    Raises:
        InvalidArgument: an item is not ``BACKEND.KEY=VALUE``.
    """
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        backend, dot, name = key.partition(".")
        if not (sep and dot and backend and name):
            raise InvalidArgument(
                f"backend option {item!r}: expected BACKEND.KEY=VALUE, e.g. sim.bandwidth_gbps=8"
            )
        out.setdefault(backend, {})[name] = value
    return out


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to an argparse subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="copy and wake micro-benchmarks against their baselines",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument(
        "--device", metavar="NAME", help="only this device: host, sim, sim:1, cuda:0 or an EP name"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write bandwidth vs size (needs matplotlib)")
    p.add_argument(
        "--pyperf",
        metavar="FILE.json",
        help="write every timing series as a pyperf suite (python -m pyperf stats FILE.json)",
    )
    p.add_argument("--quick", action="store_true", help="two sizes, few repetitions (a smoke test)")
    p.add_argument(
        "-o",
        "--backend-option",
        action="append",
        default=[],
        metavar="BACKEND.KEY=VALUE",
        help="a backend option, e.g. -o sim.bandwidth_gbps=8 -o sim.latency_us=20 (repeatable)",
    )
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """Run ``bench`` with parsed arguments; returns the exit status."""
    options = parse_backend_options(args.backend_option)
    try:
        report = anyio.run(
            lambda: run_bench(device=args.device, quick=args.quick, backend_options=options),
            backend="asyncio",
        )
    except ModuleNotFoundError as exc:
        print(f"aioep bench: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    if args.pyperf:
        report.dump_pyperf(args.pyperf)
        if not args.json:
            print(f"\npyperf suite written to {args.pyperf}")
    if args.plot:
        plot_report(report, args.plot)
        if not args.json:
            print(f"\nplot written to {args.plot}")
    return 0
