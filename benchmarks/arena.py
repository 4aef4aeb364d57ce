"""Arena figures: allocation speed and fragmentation of aioep's BFC arena, against
``numpy.empty``, measured interleaved.

What each side does. Every figure is an allocate-and-give-back pair on the calling
thread (no thread hop on either side):

- ``numpy.empty(n, uint8)``, then dropped: numpy asks its allocator for ``n`` bytes
  (glibc ``malloc``; below 1 KiB numpy's own small-block cache) and never touches the
  pages. Above glibc's mmap threshold (dynamic, at most 32 MiB) every pair is an
  ``mmap`` and a ``munmap`` of untouched pages; below it, sizes the heap top cannot hold
  move the break (``brk``) both ways.
- ``arena.alloc(n).free()``: aioep's arena over the host allocator (what the arena
  figures of issue 33 measure). It never touches the pages either: after the first
  request its regions stay mapped, so a pair is bookkeeping only.
- ``env.empty(4096, uint8, arena_info)``, then dropped: the public constructor of an
  uninitialised tensor from the environment's shared host arena (shape and dtype
  checks, the arena pair, the Tensor, and the release when the last reference goes),
  against ``numpy.empty(4096, uint8)`` dropped.

Pages: neither side touches memory in the pair figures, so neither pays page faults.
The 64 MiB case is printed twice, labelled: untouched on both sides (numpy's figure is
then mostly ``mmap``/``munmap``), and with one byte written in every 4 KiB page on both
sides (numpy's fresh mapping faults every page in; the arena's region was faulted in
once). Neither is a headline figure.

Interleaving: each figure runs ``--rounds`` rounds; a round times one batch of each
side back to back (the order alternates between rounds), so both see the same machine
state. Times are the thread's CPU time (user and kernel: page faults and ``mmap`` count,
time the core spent on other processes does not; the machine these figures come from
is shared), with the wall-clock ratio recorded beside each figure. Each round gives a
ratio; the figure is the median of those ratios, with the least favourable round
("worst") and each side's per-pair median and minimum beside it.
Rates are "x numpy.empty's rate" (above 1: the arena is faster); ``env.empty`` is a
cost ratio ("x numpy.empty's time", as issue 33 states it).

Fragmentation (no timing): a serving-like trace, many requests in flight, each running
a stack of layers whose activations depend on the request's sequence length; a layer
frees the activation two layers back. Peak bytes reserved / peak bytes in use, with in
use counted as requested bytes (stricter; targets <= 1.5 with the default options,
<= 1.2 with ``arena.extend_strategy = same_as_requested``) and as ORT's rounded chunk
bytes.

GPU (only where the CUDA backend and CuPy exist): the same mixed pairs, the CUDA
arena against CuPy's memory pool, interleaved; otherwise "skipped" with the reason.

Targets (issue 33): mixed 64 B-64 MiB >= 1.0x numpy.empty's rate, steady 4 KiB >=
0.25x, ``env.empty`` 4 KiB <= 12x numpy.empty's time; fragmentation as above.

Usage: ``python benchmarks/arena.py [--quick] [--rounds N] [--json PATH]``; results go
to ``benchmarks/results/arena.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import aioep
from aioep._environment.host import HostAllocator
from aioep._memory.arena import ArenaAllocator, ArenaConfig

MIB = 1 << 20
PAGE = 4096
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "arena.json"

Batch = Callable[[], None]


def mixed_sizes(count: int, seed: int = 1) -> list[int]:
    """``count`` sizes drawn log-uniformly from 64 B to 64 MiB (the first version's mix)."""
    rng = random.Random(seed)
    lo, hi = math.log2(64), math.log2(64 * MIB)
    return [int(2 ** rng.uniform(lo, hi)) for _ in range(count)]


# -- the pairs -----------------------------------------------------------------------------------


def numpy_pairs(sizes: list[int]) -> Batch:
    def run() -> None:
        empty, u8 = np.empty, np.uint8
        for n in sizes:
            a = empty(n, u8)
            del a

    return run


def numpy_touched_pairs(sizes: list[int]) -> Batch:
    def run() -> None:
        empty, u8 = np.empty, np.uint8
        for n in sizes:
            a = empty(n, u8)
            a[::PAGE] = 1  # one byte in every page: a fresh mapping faults each page in
            del a

    return run


def arena_pairs(arena: aioep.Allocator, sizes: list[int]) -> Batch:
    def run() -> None:
        alloc = arena.alloc
        for n in sizes:
            alloc(n).free()

    return run


def arena_touched_pairs(arena: aioep.Allocator, sizes: list[int]) -> Batch:
    def run() -> None:
        alloc = arena.alloc
        for n in sizes:
            buf = alloc(n)
            aioep.Tensor(buf, (n,), "uint8").numpy()[::PAGE] = 1
            buf.free()

    return run


def env_empty_drops(env: aioep.Environment, info: aioep.MemoryInfo, count: int) -> Batch:
    def run() -> None:
        empty, u8 = env.empty, np.uint8
        for _ in range(count):
            t = empty(4096, u8, info)
            del t

    return run


# -- interleaved timing --------------------------------------------------------------------------


def interleave(
    ours: Batch, baseline: Batch, pairs: int, rounds: int, *, cost: bool = False
) -> dict[str, Any]:
    """Time ``rounds`` batches of each side back to back (alternating which goes first);
    per-pair times in µs and the per-round ratios.

    Each batch is timed by the thread's CPU time (``time.thread_time_ns``: the work
    done, user and kernel, without the time other processes on a shared machine held
    the core) and by the wall clock; the CPU-time ratio is the figure, the wall-clock
    one is recorded beside it. ``cost``: the ratio is ours' time / the baseline's (how
    many times dearer); otherwise the baseline's time / ours (our rate as a multiple of
    the baseline's).
    """
    ours()  # warm up both: caches, the arena's working set, glibc's thresholds
    baseline()
    cpu: dict[Batch, list[float]] = {ours: [], baseline: []}
    wall: dict[Batch, list[float]] = {ours: [], baseline: []}
    for r in range(rounds):
        for fn in (ours, baseline) if r % 2 == 0 else (baseline, ours):
            start_cpu, start_wall = time.thread_time_ns(), time.perf_counter_ns()
            fn()
            cpu[fn].append((time.thread_time_ns() - start_cpu) / 1e3 / pairs)
            wall[fn].append((time.perf_counter_ns() - start_wall) / 1e3 / pairs)

    def ratios(times: dict[Batch, list[float]]) -> list[float]:
        pairs_of = zip(times[ours], times[baseline], strict=True)
        return [(o / b) if cost else (b / o) for o, b in pairs_of]

    by_cpu, by_wall = ratios(cpu), ratios(wall)
    return {
        "pairs_per_batch": pairs,
        "rounds": rounds,
        "ratio": "aioep time / numpy time" if cost else "numpy time / aioep time (rate ratio)",
        "ratio_median": statistics.median(by_cpu),
        "ratio_worst": max(by_cpu) if cost else min(by_cpu),
        "ratio_best": min(by_cpu) if cost else max(by_cpu),
        "wall_ratio_median": statistics.median(by_wall),
        "aioep_us_median": statistics.median(cpu[ours]),
        "aioep_us_min": min(cpu[ours]),
        "numpy_us_median": statistics.median(cpu[baseline]),
        "numpy_us_min": min(cpu[baseline]),
        "ratios": by_cpu,
        "wall_ratios": by_wall,
    }


def pair_figures(quick: bool, rounds: int) -> dict[str, Any]:
    count = 5_000 if quick else 20_000
    sizes = mixed_sizes(count)
    arena = ArenaAllocator(HostAllocator())
    out: dict[str, Any] = {"mixed_sizes": f"{count} sizes, log-uniform 64 B .. 64 MiB, seed 1"}
    out["mixed"] = interleave(arena_pairs(arena, sizes), numpy_pairs(sizes), count, rounds)
    steady = [4096] * count
    out["steady_4k"] = interleave(arena_pairs(arena, steady), numpy_pairs(steady), count, rounds)
    big = [64 * MIB] * (20 if quick else 100)
    out["big_64m_untouched"] = interleave(
        arena_pairs(arena, big), numpy_pairs(big), len(big), rounds
    )
    touched = big[:5] if quick else big[:20]
    out["big_64m_touched"] = interleave(
        arena_touched_pairs(arena, touched), numpy_touched_pairs(touched), len(touched), rounds
    )
    out["arena_stats"] = arena.stats()
    arena.close()
    return out


def env_empty_figure(quick: bool, rounds: int) -> dict[str, Any]:
    count = 5_000 if quick else 20_000
    env = aioep.Environment(autoload=False).open()
    try:
        host = env.ep_devices(ep_name="host")[0]
        arena = env.create_shared_allocator(
            host, aioep.MemoryType.DEFAULT, aioep.AllocatorType.ARENA
        )
        assert isinstance(arena, ArenaAllocator)
        info = arena.memory_info
        out = interleave(
            env_empty_drops(env, info, count),
            numpy_pairs([4096] * count),
            count,
            rounds,
            cost=True,
        )
        out["allocator"] = repr(arena)
        return out
    finally:
        env.close()


# -- fragmentation -------------------------------------------------------------------------------


def serving_trace(quick: bool, config: ArenaConfig) -> dict[str, Any]:
    """Requests of a small transformer-like model, interleaved step by step."""
    rng = random.Random(7)
    hidden, layers = 1024, 12
    in_flight = 16
    total_requests = 64 if quick else 256
    arena = ArenaAllocator(HostAllocator(), config)
    peak_requested = 0
    live_requested = 0
    started = 0
    active: list[dict[str, Any]] = []
    while started < total_requests or active:
        while len(active) < in_flight and started < total_requests:
            seq = rng.choice((16, 32, 64, 128, 256, 512, 1024)) + rng.randrange(16)
            batch = rng.choice((1, 2, 4))
            active.append({"tokens": seq * batch, "layer": 0, "acts": []})
            started += 1
        req = active[rng.randrange(len(active))]
        tokens = req["tokens"]
        # One layer: attention scores (tokens x tokens/batch), MLP 4x hidden, output.
        for nbytes in (tokens * hidden * 4, tokens * 4 * hidden * 4, tokens * 64 * 4):
            buf = arena.alloc(nbytes)
            req["acts"].append(buf)
            live_requested += nbytes
            peak_requested = max(peak_requested, live_requested)
        while len(req["acts"]) > 6:  # activations two layers back are dead
            old = req["acts"].pop(0)
            live_requested -= old.nbytes
            old.free()
        req["layer"] += 1
        if req["layer"] == layers:
            for buf in req["acts"]:
                live_requested -= buf.nbytes
                buf.free()
            active.remove(req)
    stats = arena.stats()
    arena.close()
    return {
        "config": {k: int(v) for k, v in vars(config).items()},
        "requests": total_requests,
        "in_flight": in_flight,
        "peak_reserved_bytes": stats["MaxTotalAllocated"],
        "peak_in_use_requested_bytes": peak_requested,
        "peak_in_use_rounded_bytes": stats["MaxInUse"],
        "ratio_vs_requested": stats["MaxTotalAllocated"] / peak_requested,
        "ratio_vs_rounded": stats["MaxTotalAllocated"] / stats["MaxInUse"],
        "extensions": stats["NumArenaExtensions"],
    }


# -- GPU -----------------------------------------------------------------------------------------


def gpu_figure(quick: bool, rounds: int) -> dict[str, Any]:
    """The same mixed pairs on GPU memory, aioep's arena vs CuPy's default memory pool.

    The arena is the environment's shared ARENA allocator for the CUDA device's DEFAULT
    memory (``env.create_shared_allocator``), so this is the path a user gets.
    """
    try:
        import cupy  # type: ignore[import-not-found]
    except ImportError:
        return {"skipped": "CuPy is not installed"}
    env = aioep.Environment(backends=["cuda"]).open()
    try:
        devices = env.ep_devices(ep_name="CUDAExecutionProvider")
        if not devices:
            why = env.load_errors.get("cuda", "the CUDA backend offers no device")
            return {"skipped": f"no GPU: {why}"}
        dev = devices[0]
        arena = env.create_shared_allocator(dev, aioep.MemoryType.DEFAULT)
        assert isinstance(arena, ArenaAllocator)
        count = 5_000 if quick else 20_000
        sizes = mixed_sizes(count)
        device_id = arena.memory_info.device.device_id
        with cupy.cuda.Device(device_id):
            pool = cupy.get_default_memory_pool()

            def cupy_pairs() -> None:
                malloc = pool.malloc
                for n in sizes:
                    p = malloc(n)
                    del p

            out = interleave(arena_pairs(arena, sizes), cupy_pairs, count, rounds)
            out["ratio"] = "CuPy pool time / aioep time (rate ratio)"
            out["device"] = repr(dev)
            pool.free_all_blocks()
        env.release_shared_allocator(dev, aioep.MemoryType.DEFAULT)
        return out
    finally:
        env.close()


# -- report --------------------------------------------------------------------------------------


def _rate_row(name: str, fig: dict[str, Any], target: str) -> tuple[str, str, str]:
    value = (
        f"{fig['ratio_median']:.2f}x numpy.empty's rate (worst round {fig['ratio_worst']:.2f}x,"
        f" wall clock {fig['wall_ratio_median']:.2f}x; aioep {fig['aioep_us_median']:.2f}"
        f" µs/pair, min {fig['aioep_us_min']:.2f}; numpy.empty {fig['numpy_us_median']:.2f},"
        f" min {fig['numpy_us_min']:.2f})"
    )
    return name, value, target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer pairs and requests")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (odd)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    rounds = args.rounds or (5 if args.quick else 11)

    pairs = pair_figures(args.quick, rounds)
    empty = env_empty_figure(args.quick, rounds)
    traces = {
        "default": serving_trace(args.quick, ArenaConfig()),
        "same_as_requested": serving_trace(
            args.quick, ArenaConfig.from_options({"arena.extend_strategy": "same_as_requested"})
        ),
    }
    rows = [
        _rate_row("arena alloc(n).free(), mixed 64 B-64 MiB", pairs["mixed"], ">= 1.0x"),
        _rate_row("arena alloc(n).free(), steady 4 KiB", pairs["steady_4k"], ">= 0.25x"),
        (
            "env.empty(4096, uint8) from the arena, dropped",
            f"{empty['ratio_median']:.1f}x numpy.empty's time (worst round "
            f"{empty['ratio_worst']:.1f}x, wall clock {empty['wall_ratio_median']:.1f}x; aioep "
            f"{empty['aioep_us_median']:.2f} µs, min "
            f"{empty['aioep_us_min']:.2f}; numpy.empty {empty['numpy_us_median']:.2f}, min "
            f"{empty['numpy_us_min']:.2f})",
            "<= 12x",
        ),
        (
            "fragmentation, peak reserved / peak requested, default",
            f"{traces['default']['ratio_vs_requested']:.3f}",
            "<= 1.5",
        ),
        (
            "the same, arena.extend_strategy = same_as_requested",
            f"{traces['same_as_requested']['ratio_vs_requested']:.3f}",
            "<= 1.2",
        ),
    ]
    print(
        f"{rounds} interleaved rounds per figure, thread CPU time; every pair runs on the "
        "calling thread on both sides; no side touches pages unless said"
    )
    width = max(len(r[0]) for r in rows)
    for name, value, target in rows:
        print(f"{name:<{width}} | {value} | target {target}")
    for key, label in (
        ("big_64m_untouched", "64 MiB pairs, pages untouched on both sides (numpy: mmap+munmap)"),
        ("big_64m_touched", "64 MiB pairs, one byte per 4 KiB page written on both sides"),
    ):
        print("  " + " | ".join(_rate_row(label, pairs[key], "no target")[:2]))
    for name, trace in traces.items():
        print(
            f"  serving trace, {name}: peak reserved {trace['peak_reserved_bytes'] / MIB:.1f} MiB"
            f" / peak in use {trace['peak_in_use_requested_bytes'] / MIB:.1f} MiB requested "
            f"-> {trace['ratio_vs_requested']:.3f} ({trace['ratio_vs_rounded']:.3f} vs rounded),"
            f" {trace['extensions']} extensions"
        )
    gpu = gpu_figure(args.quick, rounds)
    if "skipped" in gpu:
        print(f"  GPU, arena vs CuPy memory pool: skipped: {gpu['skipped']}")
    else:
        print(
            f"  GPU mixed pairs: {gpu['ratio_median']:.2f}x CuPy pool's rate (worst round "
            f"{gpu['ratio_worst']:.2f}x; aioep {gpu['aioep_us_median']:.2f} µs/pair, CuPy "
            f"{gpu['numpy_us_median']:.2f})"
        )

    result = {
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "numpy": np.__version__,
        },
        "quick": args.quick,
        "pairs": pairs,
        "env_empty_4k": empty,
        "fragmentation": traces,
        "gpu": gpu,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
