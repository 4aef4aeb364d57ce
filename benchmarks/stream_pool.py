"""Stream pool benchmark: what ``Environment(stream_pool_size=...)`` should default to.

Each request uploads a host array to a sim device and downloads it again on one stream,
awaiting the download. R requests run at once, each on

* its own stream (``async with env.create_sync_stream(dev)``: one sim worker thread per
  request, made and joined per request): the baseline, the same work with the same hops;
* a stream borrowed from ``env.pooled_stream(dev)`` with pools of 1, 2, 4, 8 and 16 streams.

Two sim profiles: ``free`` (no latency or bandwidth limit: small copies run inline on an
idle stream, the rest on the stream's thread) and ``device`` (``latency_us=20``,
``bandwidth_gbps=8``, the serving example's: every copy waits on the stream's thread and
copies in one direction take turns on the device's copy engine). Variants run interleaved,
round after round; each figure is the median over rounds of requests per second, printed
with its ratio to the baseline of the same round, and the most streams (on the sim, worker
threads) the requests used at once.

With ``--backend cuda`` the requests run on CUDA device 0 instead (pageable host arrays,
staged as a server's inputs are), through pools of up to 32 streams: a CUDA stream costs no
thread of its own.

Run: ``python benchmarks/stream_pool.py [--quick] [--backend cuda]``; writes
``benchmarks/results/stream_pool.json`` (``stream_pool_cuda.json``).
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
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import numpy as np

import aioep
from aioep import MemoryType

RESULTS = Path(__file__).parent / "results"
POOL_SIZES = {"sim": (1, 2, 4, 8, 16), "cuda": (1, 2, 4, 8, 16, 32)}
PROFILES: dict[str, dict[str, dict[str, float]]] = {
    "sim": {"free": {}, "device": {"latency_us": 20, "bandwidth_gbps": 8}},
    "cuda": {"device": {}},
}
LIBRARIES = {"sim": "aioep_sim:SimFactory", "cuda": "aioep_cuda:CudaFactory"}
PER_REQUEST = "stream per request"


class Variant:
    """One way to give each request a stream, in an environment of its own."""

    def __init__(self, name: str, env: aioep.Environment, dev: aioep.EpDevice) -> None:
        self.name = name
        self.env = env
        self.dev = dev
        self.rates: list[float] = []
        self.ratios: list[float] = []
        self.peak_streams = 0

    def stream(self) -> AbstractAsyncContextManager[aioep.SyncStream]:
        if self.name == PER_REQUEST:
            return self.env.create_sync_stream(self.dev)
        return self.env.pooled_stream(self.dev)


async def burst(v: Variant, requests: int, nbytes: int) -> float:
    """Run ``requests`` requests at once; requests per second."""
    info = v.dev.memory_info(MemoryType.DEFAULT)
    assert info is not None
    n = nbytes // 8
    src = [np.full(n, i, np.int64) for i in range(requests)]
    out = [np.empty(n, np.int64) for _ in range(requests)]
    handles: set[int] = set()
    open_now = [0, 0]  # streams open now, the most at once

    async def one(i: int) -> None:
        async with v.stream() as s:
            handles.add(s.handle)
            open_now[0] += 1
            open_now[1] = max(open_now)
            on_device = v.env.empty(n, np.int64, info, stream=s)
            v.env.copy_tensors([src[i]], [on_device], s)
            await v.env.copy_tensors([on_device], [out[i]], s)
            del on_device
            open_now[0] -= 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    elapsed = time.perf_counter() - t0
    for i in range(requests):
        if not (out[i] == i).all():
            raise AssertionError(f"request {i} read back the wrong bytes")
    # A pool's streams are shared: count them; one stream per request: the most open at once.
    peak = open_now[1] if v.name == PER_REQUEST else len(handles)
    v.peak_streams = max(v.peak_streams, peak)
    return requests / elapsed


async def open_variants(backend: str, profile: dict[str, float]) -> list[Variant]:
    variants = []
    for name, size in [(PER_REQUEST, 1), *((f"pool of {k}", k) for k in POOL_SIZES[backend])]:
        env = await aioep.Environment(autoload=False, stream_pool_size=size).__aenter__()
        options = {"num_devices": 1, **profile} if backend == "sim" else None
        (dev, *_) = env.register_library(backend, LIBRARIES[backend], options)
        variants.append(Variant(name, env, dev))
    return variants


async def measure(
    backend: str,
    profile: dict[str, float],
    nbytes: int,
    requests: int,
    rounds: int,
    say: Callable[[str], None],
) -> dict[str, Any]:
    variants = await open_variants(backend, profile)
    try:
        for v in variants:  # warm up: pools filled, arenas grown, threads started
            await burst(v, requests, nbytes)
        for r in range(rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            rates = {v.name: await burst(v, requests, nbytes) for v in order}
            for v in variants:
                v.rates.append(rates[v.name])
                v.ratios.append(rates[v.name] / rates[PER_REQUEST])
    finally:
        for v in variants:
            await v.env.aclose()
    out: dict[str, Any] = {}
    for v in variants:
        out[v.name] = {
            "requests_per_s": statistics.median(v.rates),
            "ratio_to_stream_per_request": statistics.median(v.ratios),
            "peak_streams": v.peak_streams,
        }
        say(
            f"    {v.name:<19} {statistics.median(v.rates):9.0f} req/s  "
            f"{statistics.median(v.ratios):5.2f}x  streams {v.peak_streams:4d}"
        )
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    requests = 64 if args.quick else args.requests
    rounds = 3 if args.quick else args.rounds
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "quick": args.quick,
        "backend": args.backend,
        "requests": requests,
        "rounds": rounds,
        "results": {},
    }
    for profile_name, profile in PROFILES[args.backend].items():
        for nbytes in (4 << 10, 1 << 20):
            label = f"{args.backend} {profile_name}, {nbytes >> 10} KiB"
            print(f"{label}: {requests} concurrent upload+download requests, {rounds} rounds")
            out["results"][label] = await measure(
                args.backend, profile, nbytes, requests, rounds, print
            )
    suffix = "" if args.backend == "sim" else f"_{args.backend}"
    path = Path(args.json) if args.json else RESULTS / f"stream_pool{suffix}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 requests, 3 rounds")
    parser.add_argument("--requests", type=int, default=256, help="concurrent requests")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per variant")
    parser.add_argument("--backend", choices=sorted(LIBRARIES), default="sim")
    parser.add_argument("--json", help="where to write the results (default: benchmarks/results)")
    asyncio.run(main(parser.parse_args()))
