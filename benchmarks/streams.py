"""Stream and copy-latency benchmarks: each ratio against a baseline measured in the same phase.

Every figure interleaves aioep's runs with its baselines' (short blocks, ABAB..., see
``_interleave.py``) and prints medians; a ratio always names its baseline. Where the fair
floor (the same work with the same number of thread hops) and the naive alternative
differ, both are printed.

(a) notification wake: a persistent thread completes a notification -> the awaiting task
    runs, vs the same thread calling ``loop.call_soon_threadsafe(fut.set_result, None)``
    (target: median <= 1.1x);
(b) ``await copy_tensors`` of 4 KiB host -> sim on a stream, with ``bandwidth_gbps`` set
    high so the copy runs on the stream's worker thread, vs the fair floor (a persistent
    thread that does a 4 KiB ``numpy.copyto`` and completes an asyncio future with
    ``call_soon_threadsafe``) and vs ``await asyncio.to_thread(numpy.copyto, ...)``
    (target: <= 1.25x the floor);
(c) the same copy without a stream (the sim's own streams run it), same baselines
    (target: <= 1.25x the floor);
(d) the same copy on a stream at default sim options, where it runs inline on an idle
    stream, vs ``numpy.copyto`` + ``await asyncio.sleep(0)`` (no hop either; no target);
(e) ``await stream`` on an idle stream vs ``await asyncio.sleep(0)`` (target <= 1.5x);
(f) copy-engine overlap: with ``bandwidth_gbps`` set, a 256 MiB host->device copy on one
    stream and a 256 MiB device->host copy on another, together, vs both one after the
    other on one stream (target <= 0.6x).

Run: ``python benchmarks/streams.py [--quick] [--json PATH]``; writes
``benchmarks/results/streams.json`` by default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _interleave import FloorThread, interleave, line, machine, ratios, summary, verdict

import aioep
from aioep import MemoryType
from aioep.abc import HostNotification
from aioep_sim import SimFactory

RESULTS = Path(__file__).parent / "results" / "streams.json"
FLOOR = "floor: persistent thread + call_soon_threadsafe"
NAIVE = "naive: await asyncio.to_thread"


# -- (a) wake latency --------------------------------------------------------------------------


async def wake_latency(rounds: int, block: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
    stamps: dict[str, float] = {}

    def signaller() -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            kind, target = job
            time.sleep(200e-6)  # let the loop park in its selector, as in real use
            stamps["t0"] = time.perf_counter()
            if kind == "aioep":
                target.set()  # what a stream worker does when it reaches a mark
            else:
                loop.call_soon_threadsafe(target.set_result, None)

    thread = threading.Thread(target=signaller, daemon=True)
    thread.start()

    async def ours() -> float:
        impl = HostNotification()
        note = aioep.Notification(impl)
        jobs.put(("aioep", impl))
        await note
        return time.perf_counter() - stamps["t0"]

    async def base() -> float:
        fut: asyncio.Future[None] = loop.create_future()
        jobs.put(("base", fut))
        await fut
        return time.perf_counter() - stamps["t0"]

    names = {"aioep: await notification": ours, "bare call_soon_threadsafe": base}
    samples = await interleave(names, rounds=rounds, block=block)
    jobs.put(None)
    thread.join()
    stats = {name: summary(v) for name, v in samples.items()}
    return {
        "stats": stats,
        "ratios": ratios(stats, "aioep: await notification", ["bare call_soon_threadsafe"]),
        "target": 1.1,
    }


# -- (b), (c), (d), (e): 4 KiB copies and the idle stream ----------------------------------------


def _section(samples: dict[str, list[float]], ours: str, baselines: list[str]) -> dict[str, Any]:
    stats = {n: summary(v) for n, v in samples.items()}
    return {"stats": stats, "ratios": ratios(stats, ours, baselines)}


async def device_copies(
    env: aioep.Environment, baselines: dict[str, Any], rounds: int, block: int
) -> dict[str, Any]:
    """(b) and (c): 4 KiB copies that run on a sim thread, with the baselines interleaved."""
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    src = np.arange(1024, dtype=np.float32)
    dst = env.empty(1024, "float32", dev.memory_info(MemoryType.DEFAULT))
    out: dict[str, Any] = {}
    async with env.create_sync_stream(dev) as s:

        async def streamed() -> None:
            await aioep.copy_tensors([src], [dst], stream=s)

        async def unstreamed() -> None:
            await aioep.copy_tensors([src], [dst])

        for key, name, op in (
            ("worker_path", "aioep: await copy_tensors(stream=s)", streamed),
            ("unstreamed", "aioep: await copy_tensors()", unstreamed),
        ):
            samples = await interleave({name: op, **baselines}, rounds=rounds, block=block)
            out[key] = _section(samples, name, list(baselines))
            out[key]["target"] = 1.25
    back = np.zeros_like(src)
    await aioep.copy_tensors([dst], [back])
    assert np.array_equal(back, src)
    return out


async def inline_and_idle(env: aioep.Environment, rounds: int, block: int) -> dict[str, Any]:
    """(d) and (e): the inline copy on an idle stream, and awaiting the idle stream."""
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    src = np.arange(1024, dtype=np.float32)
    host_dst = np.empty_like(src)
    dst = env.empty(1024, "float32", dev.memory_info(MemoryType.DEFAULT))

    async def copyto_sleep0() -> None:
        np.copyto(host_dst, src)
        await asyncio.sleep(0)

    async def sleep0() -> None:
        await asyncio.sleep(0)

    out: dict[str, Any] = {}
    async with env.create_sync_stream(dev) as s:

        async def inline() -> None:
            await aioep.copy_tensors([src], [dst], stream=s)

        async def idle() -> None:
            await s

        name, floor = "aioep: await copy_tensors(stream=s), inline", "numpy.copyto + await sleep(0)"
        samples = await interleave({name: inline, floor: copyto_sleep0}, rounds=rounds, block=block)
        out["inline"] = _section(samples, name, [floor])
        budget = getattr(env, "inline_budget", None)  # None before aioep had one
        out["inline"]["inline_runs"] = None if budget is None else budget.inline_runs
        out["inline"]["overruns"] = None if budget is None else budget.overruns
        name, floor = "aioep: await stream (idle)", "await asyncio.sleep(0)"
        samples = await interleave({name: idle, floor: sleep0}, rounds=rounds, block=block)
        out["idle_stream"] = _section(samples, name, [floor])
        out["idle_stream"]["target"] = 1.5
    return out


async def copies(rounds: int, block: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    src = np.arange(1024, dtype=np.float32)  # 4 KiB
    host_dst = np.empty_like(src)
    floor = FloorThread(loop, lambda: np.copyto(host_dst, src))

    async def to_thread() -> None:
        await asyncio.to_thread(np.copyto, host_dst, src)

    out: dict[str, Any] = {}
    try:
        # A bandwidth limit (4 ns for 4 KiB here) makes every copy a device copy: it runs on
        # a sim thread (the stream's worker, or the device's own stream without one).
        async with aioep.Environment(autoload=False) as env:
            env.register_library("sim", SimFactory, {"bandwidth_gbps": 1000, "num_devices": 1})
            baselines = {FLOOR: floor.hop, NAIVE: to_thread}
            out.update(await device_copies(env, baselines, rounds, block))
        async with aioep.Environment(autoload=False) as env:
            env.register_library("sim", SimFactory, {"num_devices": 1})
            out.update(await inline_and_idle(env, rounds, block))
    finally:
        floor.close()
    return out


# -- (f) overlap -------------------------------------------------------------------------------


async def overlap(nbytes: int, bandwidth_gbps: float, repeats: int) -> dict[str, Any]:
    opts = {"bandwidth_gbps": bandwidth_gbps, "memory_bytes": 4 * nbytes, "num_devices": 1}
    async with aioep.Environment(autoload=False) as env:
        env.register_library("sim", SimFactory, opts)
        dev = env.ep_devices(ep_name="SimExecutionProvider")[0]
        info = dev.memory_info(MemoryType.DEFAULT)
        host_src = np.full(nbytes, 1, np.uint8)
        host_dst = np.zeros(nbytes, np.uint8)
        d_up = env.empty(nbytes, "uint8", info)
        d_down = env.empty(nbytes, "uint8", info)
        await aioep.copy_tensors([np.full(nbytes, 2, np.uint8)], [d_down])  # touch the pages
        await aioep.copy_tensors([host_src], [d_up])
        seq: list[float] = []
        par: list[float] = []
        async with env.create_sync_stream(dev) as s1, env.create_sync_stream(dev) as s2:
            await aioep.copy_tensors([d_down], [host_dst], stream=s2)  # touch host_dst's pages
            for _ in range(repeats):
                t0 = time.perf_counter()
                aioep.copy_tensors([host_src], [d_up], stream=s1)
                await aioep.copy_tensors([d_down], [host_dst], stream=s1)
                seq.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                up = aioep.copy_tensors([host_src], [d_up], stream=s1)
                down = aioep.copy_tensors([d_down], [host_dst], stream=s2)
                await up
                await down
                par.append(time.perf_counter() - t0)
        assert (host_dst == 2).all()
        del d_up, d_down
    ideal = nbytes / (bandwidth_gbps * 1e9)
    return {
        "nbytes": nbytes,
        "bandwidth_gbps": bandwidth_gbps,
        "engine_time_per_copy_ms": ideal * 1e3,
        "sequential_one_stream_ms": statistics.median(seq) * 1e3,
        "together_two_streams_ms": statistics.median(par) * 1e3,
        "ratios": {"two streams / one stream": statistics.median(par) / statistics.median(seq)},
        "target": 0.6,
    }


def report(title: str, section: dict[str, Any]) -> None:
    print(title)
    for name, stats in section["stats"].items():
        print(line(name, stats))
    target = section.get("target")
    for i, (name, ratio) in enumerate(section["ratios"].items()):
        goal = f" (target <= {target}x: {verdict(ratio, target)})" if target and i == 0 else ""
        print(f"    ratio {name}: {ratio:.2f}x{goal}")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    rounds, block = (20, 20) if args.quick else (60, 40)
    size = (32 if args.quick else 256) << 20
    out: dict[str, Any] = {"machine": machine(), "quick": args.quick}
    out["wake"] = await wake_latency(rounds, block)
    report("(a) notification wake latency", out["wake"])
    c = await copies(rounds, block)
    out.update(c)
    report(
        "(b) 4 KiB host->sim copy on a stream, worker path (bandwidth_gbps=1000)", c["worker_path"]
    )
    report("(c) 4 KiB host->sim copy without a stream (bandwidth_gbps=1000)", c["unstreamed"])
    report("(d) 4 KiB host->sim copy on an idle stream at default options (inline)", c["inline"])
    report("(e) await an idle stream", c["idle_stream"])
    out["overlap"] = o = await overlap(size, args.bandwidth, 1 if args.quick else 3)
    print(
        f"(f) overlap {size >> 20} MiB each at {args.bandwidth} GB/s: one stream "
        f"{o['sequential_one_stream_ms']:.0f} ms, two streams {o['together_two_streams_ms']:.0f} ms"
    )
    ratio = o["ratios"]["two streams / one stream"]
    print(
        f"    ratio two streams / one stream: {ratio:.2f}x (target <= 0.6x: {verdict(ratio, 0.6)})"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (fewer rounds, 32 MiB)")
    parser.add_argument("--bandwidth", type=float, default=2.0, help="sim copy-engine GB/s for (f)")
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write the results")
    asyncio.run(main(parser.parse_args()))
