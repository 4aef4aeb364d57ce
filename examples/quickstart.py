"""aioep quickstart: the host device and the simulated accelerator, end to end.

Run it with ``python examples/quickstart.py`` after installing ``aioep`` and
``aioep-sim`` (see the README's first command). It opens an environment, lists
the devices, makes a stream on the simulated accelerator, copies a tensor
host -> device -> host with awaits, orders a second stream after the first with
a notification (no host sync), and prints what each step took.
"""

from __future__ import annotations

import time

import anyio
import numpy as np

import aioep

SIM_OPTIONS = {"sim": {"bandwidth_gbps": 8, "latency_us": 20}}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f} ms"


async def main() -> None:
    async with aioep.Environment(backend_options=SIM_OPTIONS) as env:
        print("EP devices:")
        for dev in env.ep_devices():
            hw = dev.hardware
            infos = ", ".join(info.name for info in dev.memory_infos)
            print(
                f"  {dev.ep_name:<22} {hw.type.name:<4} id {hw.device_id:<2} {hw.vendor:<10} [{infos}]"
            )
        if env.load_errors:
            print("Backends that offer nothing here:", env.load_errors)

        gpus = env.ep_devices(device_type=aioep.DeviceType.GPU)
        if not gpus:
            raise SystemExit(
                "no accelerator found: install the simulated one with 'pip install -e backends/sim'"
            )
        dev = gpus[0]
        device_memory = dev.memory_info(aioep.MemoryType.DEFAULT)
        assert device_memory is not None

        host = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
        on_device = env.empty(host.shape, host.dtype, device_memory)
        back = np.empty_like(host)
        print(
            f"\nTensor: {host.shape} {host.dtype}, {host.nbytes / 2**20:.1f} MiB on {dev.ep_name} "
            f"id {dev.hardware.device_id}"
        )

        async with env.create_sync_stream(dev) as upload, env.create_sync_stream(dev) as download:
            t0 = time.perf_counter()
            uploaded = aioep.copy_tensors([host], [on_device], stream=upload)
            print(f"  enqueue host->device      {ms(time.perf_counter() - t0)}  ({uploaded!r})")
            await uploaded
            print(f"  await host->device        {ms(time.perf_counter() - t0)}")

            t0 = time.perf_counter()
            await aioep.copy_tensors([on_device], [back], stream=download)
            print(f"  await device->host        {ms(time.perf_counter() - t0)}")
            assert np.array_equal(back, host), "round trip changed the data"

            # Order work across streams on the device: download waits for the
            # upload's notification, the host never blocks in between.
            host2 = host * 2
            t0 = time.perf_counter()
            up = aioep.copy_tensors([host2], [on_device], stream=upload)
            download.wait(up.notification)
            down = aioep.copy_tensors([on_device], [back], stream=download)
            await down
            print(f"  upload -> wait -> download {ms(time.perf_counter() - t0)} (two streams)")
            assert np.array_equal(back, host2), "cross-stream ordering failed"

        print("\nround trips are bit-exact; streams closed; environment closing")


if __name__ == "__main__":
    anyio.run(main)
