"""Benchmark: load a large external-data model to the sim device with aioep.

Compares, in one run and on the same file:

- throughput of ``env.load_initializers`` (the sim's registered loader, and the
  built-in chunked loader that stages through pinned buffers) against a raw
  sequential ``readinto`` of the file, with the page cache warm and, where it
  can be dropped, cold;
- peak extra RSS during the load against ``onnx.load(..., load_external_data=True)``.

The sim device's memory is ordinary process memory, so RSS grows by the bytes
written to the "device". The extra RSS reported for aioep is therefore
``rss - baseline - resident device bytes`` (``mincore`` on the device blocks),
i.e. the host memory the load itself needs.

    python benchmarks/external_data.py --size-mib 1024
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import psutil

import aioep
from aioep._copies.chunked_loader import ChunkedExternalDataLoader

MIB = 1 << 20
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]


# (ratio name, loader run, baseline run): loader throughput / baseline throughput.
RATIOS = (
    ("sim_loader_vs_fresh", "sim_loader", "raw_readinto_fresh"),
    ("builtin_vs_fresh", "builtin", "raw_readinto_fresh"),
    ("sim_loader_steady_vs_reused", "sim_loader_steady", "raw_readinto"),
    ("builtin_steady_vs_reused", "builtin_steady", "raw_readinto"),
    ("sim_loader_steady_vs_touched", "sim_loader_steady", "raw_readinto_touched"),
    ("builtin_steady_vs_touched", "builtin_steady", "raw_readinto_touched"),
)


def ratios(seconds: dict[str, float]) -> dict[str, float]:
    """The RATIOS whose two runs were both measured, from their times in seconds."""
    return {
        name: round(seconds[base] / seconds[run], 3)
        for name, run, base in RATIOS
        if run in seconds and base in seconds
    }


def make_model(directory: Path, size: int, tensors: int) -> Path:
    """A model with ``tensors`` float32 initializers totalling ``size`` bytes in one file."""
    from onnx import TensorProto, helper

    per = (size // tensors) // 4 * 4
    data = directory / "weights.bin"
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, 16 * MIB, dtype=np.uint8)
    inits = []
    with open(data, "wb") as f:
        for i in range(tensors):
            offset = f.tell()
            left = per
            while left:
                n = min(left, block.nbytes)
                block[:8] = np.frombuffer(np.int64(offset + left).tobytes(), np.uint8)
                f.write(block[:n].data)
                left -= n
            t = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[per // 4])
            t.data_location = TensorProto.EXTERNAL
            for k, v in (("location", data.name), ("offset", str(offset)), ("length", str(per))):
                e = t.external_data.add()
                e.key, e.value = k, v
            inits.append(t)
    model = helper.make_model(helper.make_graph([], "big", [], [], inits))
    path = directory / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def drop_cache(path: Path) -> str:
    """Evict the file from the page cache; returns how (or 'unavailable')."""
    os.sync()
    how = []
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        how.append("drop_caches")
    except OSError:
        pass
    if hasattr(os, "posix_fadvise"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            how.append("fadvise_dontneed")
        finally:
            os.close(fd)
    return "+".join(how) or "unavailable"


def _resident(addr: int, length: int) -> int:
    """Bytes of [addr, addr+length) resident in RAM (mincore)."""
    start = addr & ~(PAGE - 1)
    end = addr + length
    pages = (end - start + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
        return 0
    return int(np.frombuffer(vec, np.uint8).__and__(1).sum()) * PAGE


@contextmanager
def rss_sampler(extra: Callable[[], int] = lambda: 0) -> Iterator[dict[str, float]]:
    """Sample ``rss - extra()`` in a thread; yields a dict that gets ``peak`` (bytes over start)."""
    proc = psutil.Process()
    out: dict[str, float] = {"peak": 0.0, "samples": 0}
    stop = threading.Event()
    base = proc.memory_info().rss - extra()

    def run() -> None:
        while True:
            value = proc.memory_info().rss - extra() - base
            out["peak"] = max(out["peak"], value)
            out["samples"] += 1
            if stop.wait(0.002):
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join()
        value = proc.memory_info().rss - extra() - base
        out["peak"] = max(out["peak"], value)


def raw_read(path: Path, chunk: int) -> float:
    """Sequential readinto of the whole file in ``chunk`` pieces; returns seconds."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return time.perf_counter() - t0


def raw_read_touched(path: Path, chunk: int) -> float:
    """Sequential readinto of the whole file into a buffer of its size whose pages are touched."""
    dst = np.zeros(path.stat().st_size, np.uint8)
    dst[::PAGE] = 1
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for start in range(0, dst.nbytes, chunk):
            f.readinto(dst[start : start + chunk])  # type: ignore[arg-type]
    seconds = time.perf_counter() - t0
    del dst
    return seconds


def raw_read_fresh(path: Path, chunk: int) -> float:
    """Sequential readinto of the whole file into a freshly allocated buffer of its size."""
    t0 = time.perf_counter()
    dst = np.empty(path.stat().st_size, np.uint8)
    with open(path, "rb", buffering=0) as f:
        for start in range(0, dst.nbytes, chunk):
            f.readinto(dst[start : start + chunk])  # type: ignore[arg-type]
    seconds = time.perf_counter() - t0
    del dst
    return seconds


async def loader_steady_state(model: Path, size: int, chunk: int, which: str) -> float:
    """Seconds for the loader alone into device memory already touched (no first-touch faults)."""
    from aioep._session.external_data import read_initializers

    specs = read_initializers(str(model), None)
    opts = {"memory_bytes": size + 256 * MIB, "num_devices": 1}
    async with aioep.Environment(autoload=False) as env:
        env.register_library("sim", "aioep_sim:SimFactory", opts)
        dev = env.ep_devices(ep_name="SimExecutionProvider")[0]
        info = dev.memory_info()
        assert info is not None
        memory = env._libraries["sim"].factory.devices[0].memory  # type: ignore[attr-defined]
        tensors = [env.empty(s.shape, s.dtype, info) for s in specs]
        for t in tensors:  # benchmark-only: touch the sim's backing pages
            memory.view(t.data_ptr, t.nbytes)[:] = 0
        loader: Any = (
            ChunkedExternalDataLoader(env, chunk_bytes=chunk)
            if which == "builtin"
            else env.external_data_loader(info)
        )
        async with dev.create_sync_stream() as stream:
            t0 = time.perf_counter()
            for spec, t in zip(specs, tensors):
                assert spec.external is not None
                e = spec.external
                await loader.load_tensor(e.path, e.offset, e.length, t, stream=stream)
            await stream
            seconds = time.perf_counter() - t0
        del tensors, t
        if which == "builtin":
            loader.close()
    return seconds


async def aioep_load(model: Path, size: int, chunk: int, which: str) -> tuple[float, float, int]:
    """Load to sim device 0; returns (seconds, peak extra host RSS, bytes loaded)."""
    opts = {"memory_bytes": size + 256 * MIB, "num_devices": 1}
    async with aioep.Environment(autoload=False) as env:
        env.register_library("sim", "aioep_sim:SimFactory", opts)
        dev = env.ep_devices(ep_name="SimExecutionProvider")[0]
        memory = env._libraries["sim"].factory.devices[0].memory  # type: ignore[attr-defined]

        def device_resident() -> int:
            with memory._lock:
                blocks = list(memory._blocks.values())
            arrays = [b[0] if isinstance(b, tuple) else b for b in blocks]
            return sum(_resident(a.__array_interface__["data"][0], a.nbytes) for a in arrays)

        loader = ChunkedExternalDataLoader(env, chunk_bytes=chunk) if which == "builtin" else None
        with rss_sampler(device_resident) as rss:
            t0 = time.perf_counter()
            out = await env.load_initializers(
                model, dev, progress=False, chunk_bytes=chunk, loader=loader
            )
            seconds = time.perf_counter() - t0
        loaded = sum(t.nbytes for t in out.values())
        # Spot-check: the first 8 bytes of each tensor hold its end offset (see make_model).
        first = out["w0"]
        host = env.empty((2,), np.float32)
        await env.copy_tensors(
            [aioep.Tensor(first.buffer, (2,), np.float32, byte_offset=first.byte_offset)], [host]
        )
        assert host.numpy().view(np.int64)[0] > 0
        del out, first, host
        if loader is not None:
            loader.close()
    return seconds, rss["peak"], loaded


def onnx_load(model: Path) -> tuple[float, float]:
    import onnx

    with rss_sampler() as rss:
        t0 = time.perf_counter()
        m = onnx.load(str(model), load_external_data=True)
        seconds = time.perf_counter() - t0
    del m
    return seconds, rss["peak"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--chunk-mib", type=int, default=16)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="warm runs (best is kept)")
    parser.add_argument("--no-cold", action="store_true")
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "external_data.json")
    )
    args = parser.parse_args()
    size = args.size_mib * MIB
    chunk = args.chunk_mib * MIB
    results: dict[str, Any] = {
        "size_mib": args.size_mib,
        "chunk_mib": args.chunk_mib,
        "tensors": args.tensors,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory(prefix="aioep-bench-") as tmp:
        model = make_model(Path(tmp), size, args.tensors)
        data = Path(tmp) / "weights.bin"
        nbytes = data.stat().st_size
        raw_read(data, chunk)  # warm the cache

        def gbps(seconds: float) -> float:
            return nbytes / seconds / 1e9

        warm: dict[str, float] = {}
        rss: dict[str, float] = {}
        warm["raw_readinto"] = min(raw_read(data, chunk) for _ in range(args.repeat))
        warm["raw_readinto_fresh"] = min(raw_read_fresh(data, chunk) for _ in range(args.repeat))
        warm["raw_readinto_touched"] = min(
            raw_read_touched(data, chunk) for _ in range(args.repeat)
        )
        for which in ("sim_loader", "builtin"):
            runs = [anyio.run(aioep_load, model, size, chunk, which) for _ in range(args.repeat)]
            warm[which] = min(r[0] for r in runs)
            rss[which] = max(r[1] for r in runs)
            assert runs[0][2] == nbytes
            warm[which + "_steady"] = min(
                anyio.run(loader_steady_state, model, size, chunk, which)
                for _ in range(args.repeat)
            )
        results["warm"] = {
            k: {"seconds": round(v, 4), "gbps": round(gbps(v), 3)} for k, v in warm.items()
        }
        # load_initializers writes fresh device memory: compare with a raw read into fresh
        # memory; the loaders alone (device memory already touched) compare with the raw read
        # into a reused buffer.
        results["warm_ratio_vs_raw"] = ratios(warm)

        if not args.no_cold:
            how = drop_cache(data)
            results["cold_method"] = how
            if how != "unavailable":
                cold: dict[str, float] = {}
                residue: dict[str, float] = {}
                for which in (
                    "raw_readinto",
                    "raw_readinto_fresh",
                    "sim_loader",
                    "builtin",
                    "sim_loader_steady",
                    "builtin_steady",
                ):
                    drop_cache(data)
                    residue[which] = round(_file_cached(data), 3)
                    if which == "raw_readinto":
                        cold[which] = raw_read(data, chunk)
                    elif which == "raw_readinto_fresh":
                        cold[which] = raw_read_fresh(data, chunk)
                    elif which.endswith("_steady"):
                        cold[which] = anyio.run(
                            loader_steady_state, model, size, chunk, which[: -len("_steady")]
                        )
                    else:
                        cold[which] = anyio.run(aioep_load, model, size, chunk, which)[0]
                results["cold"] = {
                    k: {"seconds": round(v, 4), "gbps": round(gbps(v), 3)} for k, v in cold.items()
                }
                results["cold_cached_fraction_before_run"] = residue
                results["cold_ratio_vs_raw"] = ratios(cold)

        onnx_seconds, onnx_rss = onnx_load(model)
        results["onnx_load"] = {
            "seconds": round(onnx_seconds, 4),
            "gbps": round(gbps(onnx_seconds), 3),
        }
        budget = 2 * chunk + 32 * MIB
        results["peak_extra_rss_mib"] = {
            "sim_loader": round(rss["sim_loader"] / MIB, 1),
            "builtin": round(rss["builtin"] / MIB, 1),
            "onnx_load": round(onnx_rss / MIB, 1),
            "budget_2_chunks_plus_32": round(budget / MIB, 1),
        }
        results["targets_met"] = {
            **{f"warm_{k}_ge_0.8x": v >= 0.8 for k, v in results["warm_ratio_vs_raw"].items()},
            "rss_builtin_le_budget": rss["builtin"] <= budget,
            "rss_sim_loader_le_budget": rss["sim_loader"] <= budget,
        }

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"file: {args.size_mib} MiB in {args.tensors} tensors, chunk {args.chunk_mib} MiB")
    for mode in ("warm", "cold"):
        if mode not in results:
            print(f"cold  not measured ({results.get('cold_method', 'skipped')})")
            continue
        print(
            f"{mode} ({results.get('cold_method', 'page cache')}):" if mode == "cold" else "warm:"
        )
        for k, v in results[mode].items():
            print(f"  {k:<22} {v['gbps']:7.2f} GB/s  {v['seconds']:.3f} s")
        for k, v in results[f"{mode}_ratio_vs_raw"].items():
            print(f"  ratio {k:<30} {v:.2f}x")
    r = results["peak_extra_rss_mib"]
    print(
        f"peak extra RSS: aioep sim loader {r['sim_loader']} MiB, built-in {r['builtin']} MiB "
        f"(budget {r['budget_2_chunks_plus_32']} MiB) vs onnx.load {r['onnx_load']} MiB "
        f"(ratio {r['onnx_load'] / max(r['builtin'], 0.1):.0f}x)"
    )
    print(f"wrote {out}")


def _file_cached(path: Path) -> float:
    """Fraction of the file's pages in the page cache."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(
            ctypes.c_void_p(0), ctypes.c_size_t(size), mmap.PROT_READ, mmap.MAP_SHARED, fd, 0
        )
    finally:
        os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        return float("nan")
    try:
        return _resident(addr, size) / size
    finally:
        _libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))


if __name__ == "__main__":
    main()
