"""The program that froze a real GPU's event loop (../shared/notes/gpu-h200-2026-11.md), run on
the strict emulated driver with the event-loop thread marked.

    python tests/cuda_emulator/loop_copies.py [--bandwidth BYTES_PER_S] [--rounds N]
                                              [--empty-on-stream]

One stream; for sizes from 1 byte to 16 MiB and five dtypes, fresh random data is copied
pageable numpy -> device -> device -> pinned -> numpy, each copy awaited, the previous
iteration's tensors dropped as the loop goes on. Every result is checked bit for bit. The
emulator aborts the process (its MISUSE line names the call) if the loop thread ever has to
wait in the driver, or if a context-synchronising call (a free) runs while copies are in
flight. Exit status 0 and "ok" when the program finished.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from cuda_emulator import load

DTYPES = ("uint8", "float16", "float32", "int64", "float64")


async def run(rounds: int, on_stream: bool) -> int:
    import aioep
    from aioep import MemoryType

    emu = load()
    emu.mark_loop_thread()  # this thread runs the event loop
    done = 0
    async with aioep.Environment(backends=["cuda"]) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        device = gpu.memory_info(MemoryType.DEFAULT)
        pinned = gpu.memory_info(MemoryType.HOST_ACCESSIBLE)
        assert device is not None
        assert pinned is not None
        rng = np.random.default_rng(7)
        async with env.create_sync_stream(gpu) as stream:
            for _ in range(rounds):
                for size in [1 << k for k in range(0, 25, 2)]:
                    for dtype in DTYPES:
                        n = max(1, size // np.dtype(dtype).itemsize)
                        src = rng.integers(0, 255, size=n).astype(dtype)
                        at = stream if on_stream else None
                        a = env.empty(src.shape, src.dtype, device, stream=at)
                        b = env.empty(src.shape, src.dtype, device, stream=at)
                        p = env.empty(src.shape, src.dtype, pinned, stream=at)
                        out = np.zeros_like(src)
                        await env.copy_tensors([src], [a], stream=stream)
                        await env.copy_tensors([a], [b], stream=stream)
                        await env.copy_tensors([b], [p], stream=stream)
                        await env.copy_tensors([p], [out], stream=stream)
                        np.testing.assert_array_equal(out, src)
                        done += 1
                        del a, b, p  # the previous tensors go as the loop goes on
                print(f"round done: {done} cases", flush=True)
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth", type=int, default=2 << 30, help="bytes/s per copy")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--empty-on-stream",
        action="store_true",
        help="allocate the tensors on the stream (env.empty(..., stream=stream))",
    )
    args = parser.parse_args()
    emu = load(devices=1)  # before aioep_cuda loads the driver
    emu.set("bandwidth", args.bandwidth)
    emu.set("host_wait_limit_ns", 20_000_000_000)
    cases = asyncio.run(run(args.rounds, args.empty_on_stream))
    print(f"ok: {cases} cases bit-exact, the loop never waited in the driver")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
