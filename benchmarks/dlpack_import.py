"""DLPack import overhead: a DLPack-only wrapper of a 4 KiB numpy array copied host -> sim,
against the numpy array itself, measured side by side in one run.

The wrapper exposes nothing but ``__dlpack__`` / ``__dlpack_device__`` (as a PyTorch or
JAX CPU tensor does), so every call goes through aioep's import path: the producer's
capsule is consumed, wrapped zero-copy as a tensor and handed back when the copy is done.
Both contenders ``await aioep.copy_tensors([src], [sim_tensor])`` on the default sim
device (no latency, no bandwidth limit: the copy itself is a 4 KiB memcpy, so the figure
is the per-call overhead). Blocks of calls alternate so both see the same machine load;
each figure is the median per call.

Target: wrapper / numpy <= 1.1x. Results go to ``benchmarks/results/dlpack_import.json``.

Usage: ``python benchmarks/dlpack_import.py [--quick] [--json PATH]``
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
from pathlib import Path
from typing import Any

import numpy as np

import aioep

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "dlpack_import.json"
TARGET = 1.1


class DLPackOnly:
    """Only the DLPack protocol, delegated to a numpy array."""

    __slots__ = ("_array",)

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self._array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()  # type: ignore[no-any-return]


async def measure(nbytes: int, blocks: int, block: int) -> dict[str, Any]:
    async with aioep.Environment(autoload=False) as env:
        (sim, *_) = env.register_library("sim", "aioep_sim:SimFactory")
        mem = sim.memory_info(aioep.MemoryType.DEFAULT)
        src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        wrapper = DLPackOnly(src)
        dst = env.empty(nbytes, np.uint8, mem)
        for _ in range(200):  # warm both paths
            await aioep.copy_tensors([src], [dst])
            await aioep.copy_tensors([wrapper], [dst])
        plain: list[float] = []
        wrapped: list[float] = []
        perf = time.perf_counter
        for _ in range(blocks):
            for _ in range(block):
                t0 = perf()
                await aioep.copy_tensors([src], [dst])
                plain.append(perf() - t0)
            for _ in range(block):
                t0 = perf()
                await aioep.copy_tensors([wrapper], [dst])
                wrapped.append(perf() - t0)
        back = np.empty_like(src)
        await aioep.copy_tensors([dst], [back])
        if not np.array_equal(back, src):
            raise SystemExit("the copy produced wrong bytes")
        del dst
    plain_us = statistics.median(plain) * 1e6
    wrapped_us = statistics.median(wrapped) * 1e6
    ratio = wrapped_us / plain_us
    return {
        "nbytes": nbytes,
        "numpy_us": round(plain_us, 3),
        "dlpack_only_us": round(wrapped_us, 3),
        "ratio": round(ratio, 3),
        "calls_each": len(plain),
        "target_ratio": TARGET,
        "met": ratio <= TARGET,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    blocks, block = (10, 200) if args.quick else (40, 500)
    r = asyncio.run(measure(4096, blocks, block))
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "platform": platform.platform(),
        },
        "quick": args.quick,
        "host_to_sim_4k": r,
    }
    print(f"aioep DLPack import benchmark ({os.cpu_count()} CPUs, numpy {np.__version__})")
    print(
        f"4 KiB host -> sim, await copy_tensors: DLPack-only wrapper {r['dlpack_only_us']:.2f} us "
        f"vs numpy array {r['numpy_us']:.2f} us (median of {r['calls_each']} calls each) -> "
        f"{r['ratio']:.3f}x (target <= {TARGET}x: {'ok' if r['met'] else 'MISSED'})"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
