"""CUDA backend figures (needs an NVIDIA GPU; prints "skipped: no GPU" and exits 0 without one).

1. Pinned H2D / D2H bandwidth for 1 GiB, aioep vs CuPy (or raw cuda.bindings when CuPy is
   missing) doing the same copy in the same run. Target: >= 0.95x.
2. Wake latency after a 4 KiB pinned copy, medians: ``await stream`` with the default wake
   (a bounded poll, then the host function), ``wake="hostfn"`` and ``wake="poll"``;
   awaiting the copy's own future (with a stream and without one) measured side by side
   with ``await stream`` in one run; ``await asyncio.to_thread(cuEventSynchronize)`` and
   numba-cuda's ``await stream.async_done()`` as baselines. Targets: default wake <= 0.5x
   to_thread; the future <= 1.2x ``await stream`` and <= 0.5x to_thread.
3. Event-loop max lag while 8 GiB of copies are in flight. Target: <= 2 ms.
4. 1000 concurrent awaiters on 8 streams: thread count constant.

Writes benchmarks/results/cuda_copy.json (or ``--json PATH``) after every step: a step that
fails (an optional baseline whose library breaks, say) records its error under ``errors``
and the other figures are still measured; a crash keeps what was written. Exit status 1
when a step other than the numba comparison failed. ``--resume`` carries on from the JSON of
a run that died (``check-gpu`` does that): the step it died in is recorded as failed. Run:
``python benchmarks/cuda_copy.py [--quick] [--json PATH]``; ``--quick`` uses small sizes
(16 MiB copies, 64 MiB in flight, 50 latency samples) for a smoke test, e.g. on the
emulated driver that ``python -m aioep check-gpu --emulator`` uses; its figures are not the
targets' figures.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MiB, GiB = 1 << 20, 1 << 30
RESULTS = Path(__file__).parent / "results" / "cuda_copy.json"


@dataclass(frozen=True)
class Sizes:
    """How big the measurements are."""

    copy_bytes: int = GiB  # one pinned copy in the bandwidth figure
    flight_chunk: int = GiB // 2  # 16 of these are in flight in the loop-lag figure
    latency_samples: int = 300


FULL = Sizes()
QUICK = Sizes(copy_bytes=16 * MiB, flight_chunk=4 * MiB, latency_samples=50)


def _gpu_available() -> bool:
    try:
        from aioep_cuda._driver import check, load_driver

        drv = load_driver()
        return int(check(drv.cuDeviceGetCount(), "cuDeviceGetCount")) > 0
    except Exception:
        return False


@contextlib.contextmanager
def _primary_context() -> Iterator[Any]:
    """Device 0's primary context, current on this thread for the block (raw driver calls need
    a current context; aioep only pushes its own around each call)."""
    from aioep_cuda._driver import check, ctx_current, driver

    drv = driver()
    dev = check(drv.cuDeviceGet(0), "cuDeviceGet")
    ctx = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    try:
        with ctx_current(ctx):
            yield ctx
    finally:
        drv.cuDevicePrimaryCtxRelease(dev)


def _baseline_bandwidth(
    host_ptr: int, dev_ptr: int, nbytes: int, reps: int
) -> tuple[str, float, float]:
    """(name, H2D GB/s, D2H GB/s) of the same pinned copies done by CuPy or raw driver calls."""
    try:
        import cupy  # type: ignore[import-not-found]

        stream = cupy.cuda.Stream(non_blocking=True)
        rt = cupy.cuda.runtime

        def run(kind: int, dst: int, src: int) -> float:
            t0 = time.perf_counter()
            for _ in range(reps):
                rt.memcpyAsync(dst, src, nbytes, kind, stream.ptr)
            stream.synchronize()
            return nbytes * reps / (time.perf_counter() - t0) / 1e9

        run(rt.memcpyHostToDevice, dev_ptr, host_ptr)  # warm-up
        return (
            "cupy",
            run(rt.memcpyHostToDevice, dev_ptr, host_ptr),
            run(rt.memcpyDeviceToHost, host_ptr, dev_ptr),
        )
    except ImportError:
        from aioep_cuda._driver import check, driver

        drv = driver()
        with _primary_context():
            s = check(drv.cuStreamCreate(1), "cuStreamCreate")

            def run_raw(dst: int, src: int) -> float:
                t0 = time.perf_counter()
                for _ in range(reps):
                    check(drv.cuMemcpyAsync(dst, src, nbytes, s), "cuMemcpyAsync")
                check(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
                return nbytes * reps / (time.perf_counter() - t0) / 1e9

            run_raw(dev_ptr, host_ptr)
            out = ("cuda.bindings", run_raw(dev_ptr, host_ptr), run_raw(host_ptr, dev_ptr))
            drv.cuStreamDestroy(s)
        return out


async def _bandwidth(env: Any, gpu: Any, results: dict[str, Any], sizes: Sizes) -> None:
    import aioep

    nbytes = sizes.copy_bytes
    pinned = gpu.memory_info(aioep.MemoryType.HOST_ACCESSIBLE)
    host = env.empty((nbytes,), "uint8", pinned)
    host.numpy()[:] = 7
    dev = env.empty((nbytes,), "uint8", gpu.memory_info(aioep.MemoryType.DEFAULT))
    reps = 5
    async with env.create_sync_stream(gpu) as stream:
        await env.copy_tensors([host], [dev], stream=stream)  # warm-up

        async def run(src: Any, dst: Any) -> float:
            t0 = time.perf_counter()
            for _ in range(reps):
                env.copy_tensors([src], [dst], stream=stream)
            await stream
            return nbytes * reps / (time.perf_counter() - t0) / 1e9

        h2d, d2h = await run(host, dev), await run(dev, host)
    name, base_h2d, base_d2h = _baseline_bandwidth(host.data_ptr, dev.data_ptr, nbytes, reps)
    results["bandwidth"] = {
        "bytes": nbytes,
        "baseline": name,
        "h2d_gbps": h2d,
        "d2h_gbps": d2h,
        "baseline_h2d_gbps": base_h2d,
        "baseline_d2h_gbps": base_d2h,
        "h2d_ratio": h2d / base_h2d,
        "d2h_ratio": d2h / base_d2h,
        "target": ">= 0.95",
    }


async def _latency(env: Any, gpu: Any, n: int = 300) -> float:
    """Median ``await stream`` after a 4 KiB pinned H2D copy (the await alone), in us."""
    import aioep

    pinned = gpu.memory_info(aioep.MemoryType.HOST_ACCESSIBLE)
    src = env.empty((4096,), "uint8", pinned)
    dst = env.empty((4096,), "uint8", gpu.memory_info(aioep.MemoryType.DEFAULT))
    samples = []
    async with env.create_sync_stream(gpu) as stream:
        for _ in range(n):
            env.copy_tensors([src], [dst], stream=stream)
            t0 = time.perf_counter()
            await stream
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


async def _future_latency(env: Any, gpu: Any, n: int = 300) -> dict[str, float]:
    """Medians, in us, interleaved in one run so drift hits each alike, of waking after a
    4 KiB pinned H2D copy: ``await stream`` after the copy; awaiting the copy's own future
    (made with a stream, and without one); each also timed from before the
    ``copy_tensors`` call (``*_call``: enqueueing included)."""
    import aioep

    pinned = gpu.memory_info(aioep.MemoryType.HOST_ACCESSIBLE)
    src = env.empty((4096,), "uint8", pinned)
    dst = env.empty((4096,), "uint8", gpu.memory_info(aioep.MemoryType.DEFAULT))
    kinds = ("await_stream", "future_streamed", "future_unstreamed")
    waits: dict[str, list[float]] = {k: [] for k in kinds}
    calls: dict[str, list[float]] = {k: [] for k in kinds}
    async with env.create_sync_stream(gpu) as stream:
        await env.copy_tensors([src], [dst])  # warm-up: the un-streamed path's own stream
        for _ in range(n):
            for kind in kinds:
                t0 = time.perf_counter()
                if kind == "await_stream":
                    env.copy_tensors([src], [dst], stream=stream)
                    t1 = time.perf_counter()
                    await stream
                else:
                    future = env.copy_tensors(
                        [src], [dst], stream=stream if kind == "future_streamed" else None
                    )
                    t1 = time.perf_counter()
                    await future
                t2 = time.perf_counter()
                waits[kind].append(t2 - t1)
                calls[kind].append(t2 - t0)
    out = {k: statistics.median(v) * 1e6 for k, v in waits.items()}
    out.update({f"{k}_call": statistics.median(v) * 1e6 for k, v in calls.items()})
    return out


def _to_thread_latency(n: int = 300) -> float:
    from aioep_cuda._driver import check, driver

    drv = driver()
    with _primary_context() as ctx:
        s = check(drv.cuStreamCreate(1), "cuStreamCreate")
        ev = check(drv.cuEventCreate(2), "cuEventCreate")
        h = check(drv.cuMemHostAlloc(4096, 0), "cuMemHostAlloc")
        d = check(drv.cuMemAlloc(4096), "cuMemAlloc")

        def synchronize() -> None:
            check(drv.cuEventSynchronize(ev), "cuEventSynchronize")

        async def main() -> float:
            # to_thread's workers get the context current once, as a CUDA app's threads would.
            asyncio.get_running_loop().set_default_executor(
                concurrent.futures.ThreadPoolExecutor(
                    initializer=lambda: check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
                )
            )
            samples = []
            for _ in range(n):
                check(drv.cuMemcpyAsync(d, h, 4096, s), "cuMemcpyAsync")
                check(drv.cuEventRecord(ev, s), "cuEventRecord")
                t0 = time.perf_counter()
                await asyncio.to_thread(synchronize)
                samples.append(time.perf_counter() - t0)
            return statistics.median(samples) * 1e6

        try:
            return asyncio.run(main())
        finally:
            drv.cuMemFree(d)
            drv.cuMemFreeHost(h)
            drv.cuEventDestroy(ev)
            drv.cuStreamDestroy(s)


def _numba_latency(n: int = 300) -> float | None:
    try:
        from numba import cuda  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        stream = cuda.stream()
        host = cuda.pinned_array(4096, dtype=np.uint8)
        dev = cuda.device_array(4096, dtype=np.uint8)
    except Exception:
        return None

    async def main() -> float:
        samples = []
        for _ in range(n):
            dev.copy_to_device(host, stream=stream)
            t0 = time.perf_counter()
            await stream.async_done()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples) * 1e6

    return asyncio.run(main())


async def _loop_lag(env: Any, gpu: Any, results: dict[str, Any], sizes: Sizes) -> None:
    import aioep

    chunk = sizes.flight_chunk
    pinned = gpu.memory_info(aioep.MemoryType.HOST_ACCESSIBLE)
    host = env.empty((2 * chunk,), "uint8", pinned)
    devs = [
        env.empty((chunk,), "uint8", gpu.memory_info(aioep.MemoryType.DEFAULT)) for _ in range(2)
    ]
    streams = [env.create_sync_stream(gpu) for _ in range(4)]
    lag = 0.0
    stop = False

    async def ticker() -> None:
        nonlocal lag
        while not stop:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lag = max(lag, time.perf_counter() - t0 - 0.001)

    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    futures = []
    for i in range(16):  # 16 x 512 MiB = 8 GiB (full sizes)
        src = aioep.Tensor(host.buffer, (chunk,), "uint8", byte_offset=(i % 2) * chunk)
        futures.append(env.copy_tensors([src], [devs[i % 2]], stream=streams[i % 4]))
    await asyncio.gather(*futures)
    elapsed = time.perf_counter() - t0
    stop = True
    await tick
    for s in streams:
        await s.aclose()
    results["loop_lag"] = {
        "bytes": 16 * chunk,
        "seconds": elapsed,
        "max_lag_ms": lag * 1e3,
        "target": "<= 2 ms",
    }


async def _awaiters(env: Any, gpu: Any, results: dict[str, Any]) -> None:
    import aioep

    streams = [env.create_sync_stream(gpu) for _ in range(8)]
    data = np.ones(4096, dtype=np.uint8)
    bufs = [env.empty((4096,), "uint8", gpu.memory_info(aioep.MemoryType.DEFAULT)) for _ in streams]
    for s, b in zip(streams, bufs):
        await env.copy_tensors([data], [b], stream=s)
    before = threading.active_count()
    peak = before

    async def waiter(i: int) -> None:
        nonlocal peak
        env.copy_tensors([data], [bufs[i % 8]], stream=streams[i % 8])
        await streams[i % 8]
        peak = max(peak, threading.active_count())

    t0 = time.perf_counter()
    await asyncio.gather(*(waiter(i) for i in range(1000)))
    results["awaiters"] = {
        "count": 1000,
        "streams": 8,
        "threads_before": before,
        "threads_peak": peak,
        "threads_after": threading.active_count(),
        "seconds": time.perf_counter() - t0,
        "constant": peak == before == threading.active_count(),
    }
    for s in streams:
        await s.aclose()


class _Results:
    """The figures so far, written to the JSON file after every step: a step that fails
    records its error under ``errors`` and the others go on; a crash keeps what was
    written (``running`` names the step it happened in, ``done`` the steps finished), and
    ``--resume`` carries on after it."""

    def __init__(self, path: Path, sizes: str, *, resume: bool = False) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "sizes": sizes,
            "errors": {},
            "running": None,
            "done": [],
            "latency_us": {},
        }
        if resume and path.is_file():
            previous = json.loads(path.read_text())
            if previous.get("sizes") == sizes:
                self.data.update(previous)
                crashed = previous.get("running")
                if crashed:  # the process died in it: record that, never run it again
                    self.data["errors"][crashed] = "the process died during this step"
                    self.data["running"] = None
                    self.data["done"].append(crashed)
                self.data["resumed"] = self.data.get("resumed", 0) + 1
        path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        tmp.replace(self.path)

    def run(self, name: str, fn: Callable[[], None]) -> None:
        """Run step ``name`` unless an earlier run finished it (or died in it)."""
        if name in self.data["done"]:
            return
        self.data["running"] = name
        self.write()
        print(f"{name} ...", file=sys.stderr, flush=True)
        try:
            fn()
        except Exception as exc:
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}"
            print(f"{name} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        finally:
            self.data["running"] = None
            self.data["done"].append(name)
            self.write()


async def _with_env(wake: str | None, fn: Any) -> Any:
    import aioep

    options = {"cuda": {"wake": wake}} if wake else None
    async with aioep.Environment(backends=["cuda"], backend_options=options) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        return await fn(env, gpu)


def _ratios(lat: dict[str, Any]) -> None:
    base = lat.get("to_thread_event_sync")
    if "aioep_default" in lat and base:
        lat["ratio_vs_to_thread"] = lat["aioep_default"] / base
    if "await_stream" in lat:
        future = max(lat["future_streamed"], lat["future_unstreamed"])
        lat["future_vs_await_stream"] = future / lat["await_stream"]
        if base:
            lat["future_vs_to_thread"] = future / base
    if lat.get("numba_async_done") and "aioep_default" in lat:
        lat["ratio_vs_numba"] = lat["aioep_default"] / lat["numba_async_done"]
    lat["targets"] = (
        "default wake <= 0.5x to_thread; the future (the slower of streamed and un-streamed) "
        "<= 1.2x await stream and <= 0.5x to_thread; numba for comparison"
    )


def _run_all(out: _Results, sizes: Sizes) -> None:
    data = out.data
    lat: dict[str, Any] = data["latency_us"]
    n = sizes.latency_samples

    def on_env(fn: Any, wake: str | None = None) -> Callable[[], None]:
        return lambda: asyncio.run(_with_env(wake, fn))

    async def device(env: Any, gpu: Any) -> None:
        data["device"] = dict(gpu.hardware.metadata)

    async def latency(env: Any, gpu: Any) -> None:
        # The default wake: the future and `await stream` measured side by side.
        lat.update(await _future_latency(env, gpu, n))
        lat["aioep_default"] = lat["await_stream"]

    async def latency_hostfn(env: Any, gpu: Any) -> None:
        lat["aioep_hostfn"] = await _latency(env, gpu, n)

    async def latency_poll(env: Any, gpu: Any) -> None:
        lat["aioep_poll"] = await _latency(env, gpu, n)

    def to_thread() -> None:
        lat["to_thread_event_sync"] = _to_thread_latency(n)

    async def awaiters(env: Any, gpu: Any) -> None:
        await _awaiters(env, gpu, data)

    async def bandwidth(env: Any, gpu: Any) -> None:
        await _bandwidth(env, gpu, data, sizes)

    async def loop_lag(env: Any, gpu: Any) -> None:
        await _loop_lag(env, gpu, data, sizes)

    def numba() -> None:
        lat["numba_async_done"] = _numba_latency(n)

    steps: list[tuple[str, Callable[[], None]]] = [
        ("device", on_env(device)),
        ("latency", on_env(latency)),
        ("latency_hostfn", on_env(latency_hostfn, "hostfn")),
        ("latency_poll", on_env(latency_poll, "poll")),
        ("to_thread", to_thread),
        ("awaiters", on_env(awaiters)),
        ("bandwidth", on_env(bandwidth)),
        ("loop_lag", on_env(loop_lag)),
        # Optional baselines last: a library that breaks (numba-cuda 0.30's async_done with
        # cuda-bindings 13) costs only its own figure.
        ("numba", numba),
    ]
    for name, fn in steps:
        out.run(name, fn)
        _ratios(lat)
        out.write()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"output (default {RESULTS})")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="carry on from the JSON of a run that died: skip the steps it finished and the "
        "one it died in (recorded as failed)",
    )
    args = parser.parse_args(argv)
    if not _gpu_available():
        print("skipped: no GPU")
        return 0
    sizes = "quick" if args.quick else "full"
    out = _Results(args.json, sizes, resume=args.resume)
    _run_all(out, QUICK if args.quick else FULL)
    print(json.dumps(out.data, indent=2, default=str))
    figures_failed = [k for k in out.data["errors"] if k != "numba"]  # numba: a comparison
    return 1 if figures_failed else 0


if __name__ == "__main__":
    sys.exit(main())
