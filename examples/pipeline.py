"""aioep pipeline example: double-buffered host -> device prefetch with two streams.

Run it with ``python examples/pipeline.py`` after installing ``aioep`` and
``aioep-sim``. A consumer processes a sequence of batches that must pass through
device memory (uploaded, then read back, as a model's inputs and outputs would).
Done naively, each batch waits for the previous one: upload, wait, download,
wait. Here two device buffers and two streams let the upload of batch ``i + 1``
run on the sim's host-to-device copy engine while batch ``i`` comes back on the
device-to-host engine, and the host only waits for the result it needs next:

    upload stream:    [up 0][up 1]      [up 2]      [up 3] ...
                           \\     \\            \\
    download stream:        [down 0][down 1]    [down 2]   ...

Two notifications per batch order the streams on the device (no host blocking):

* ``download.wait(upload_done)``: a batch is read back only after it arrived;
* ``upload.wait(buffer_free)``: a buffer is overwritten only after the previous
  batch in it was read back (the double-buffering hazard).

The sim's bandwidth is set (``--bandwidth-gbps``) so copies take real time; the
script prints the serial and the overlapped timings and checks every batch.
"""

from __future__ import annotations

import argparse
import time

import anyio
import numpy as np
import numpy.typing as npt

import aioep

Batch = npt.NDArray[np.float32]


def make_batches(count: int, mib: float) -> list[Batch]:
    n = int(mib * (1 << 20)) // 4
    return [np.full(n, i, dtype=np.float32) for i in range(count)]


def check(i: int, result: Batch) -> float:
    """The consumer's host-side work: verify the batch came back intact."""
    if result[0] != i or result[-1] != i:
        raise AssertionError(f"batch {i} came back wrong")
    return float(result[0])


async def serial(env: aioep.Environment, dev: aioep.EpDevice, batches: list[Batch]) -> float:
    """One stream, one buffer: upload, wait, download, wait, for every batch."""
    memory = dev.memory_info(aioep.MemoryType.DEFAULT)
    buf = env.empty(batches[0].shape, batches[0].dtype, memory)
    out = np.empty_like(batches[0])
    t0 = time.perf_counter()
    async with env.create_sync_stream(dev) as stream:
        for i, batch in enumerate(batches):
            await env.copy_tensors([batch], [buf], stream)
            await env.copy_tensors([buf], [out], stream)
            check(i, out)
    return time.perf_counter() - t0


async def overlapped(env: aioep.Environment, dev: aioep.EpDevice, batches: list[Batch]) -> float:
    """Two streams, two buffers: prefetch batch i + 1 while batch i comes back."""
    memory = dev.memory_info(aioep.MemoryType.DEFAULT)
    bufs = [env.empty(batches[0].shape, batches[0].dtype, memory) for _ in range(2)]
    outs = [np.empty_like(batches[0]) for _ in range(2)]
    buffer_free: list[aioep.Notification | None] = [None, None]
    t0 = time.perf_counter()
    async with env.create_sync_stream(dev) as upload, env.create_sync_stream(dev) as download:

        def enqueue(i: int) -> aioep.CopyFuture:
            k = i % 2
            free = buffer_free[k]
            if free is not None:
                upload.wait(free)  # don't overwrite buffer k before its last batch was read
            up = env.copy_tensors([batches[i]], [bufs[k]], upload)
            download.wait(up.notification)  # read the batch back only after it arrived
            down = env.copy_tensors([bufs[k]], [outs[k]], download)
            buffer_free[k] = down.notification
            return down

        pending = enqueue(0)
        for i in range(len(batches)):
            # Enqueue the next batch before waiting for this one: that is the prefetch.
            following = enqueue(i + 1) if i + 1 < len(batches) else None
            await pending
            check(i, outs[i % 2])
            if following is not None:
                pending = following
    return time.perf_counter() - t0


async def main(batches: int, mib: float, bandwidth_gbps: float, latency_us: float) -> None:
    options = {"sim": {"bandwidth_gbps": bandwidth_gbps, "latency_us": latency_us}}
    async with aioep.Environment(backends=["sim"], backend_options=options) as env:
        devices = env.ep_devices(ep_name="SimExecutionProvider")
        if not devices:
            raise SystemExit("no sim device: install it with 'pip install -e backends/sim'")
        dev = devices[0]
        data = make_batches(batches, mib)
        per_copy = mib * (1 << 20) / (bandwidth_gbps * 1e9) if bandwidth_gbps else 0.0
        print(
            f"{batches} batches of {mib:g} MiB through {dev.ep_name} at {bandwidth_gbps:g} GB/s "
            f"(~{per_copy * 1e3:.1f} ms per copy)"
        )
        t_serial = await serial(env, dev, data)
        t_overlap = await overlapped(env, dev, data)
        print(f"  serial      {t_serial * 1e3:8.1f} ms  (upload, wait, download, wait)")
        print(f"  overlapped  {t_overlap * 1e3:8.1f} ms  (two streams, two buffers, notifications)")
        print(f"  speedup     {t_serial / t_overlap:8.2f}x; every batch verified")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--mib", type=float, default=4.0, help="batch size in MiB")
    parser.add_argument(
        "--bandwidth-gbps", type=float, default=0.5, help="sim copy-engine bandwidth"
    )
    parser.add_argument("--latency-us", type=float, default=20.0, help="sim per-copy latency")
    args = parser.parse_args()
    anyio.run(main, args.batches, args.mib, args.bandwidth_gbps, args.latency_us)


if __name__ == "__main__":
    cli()
