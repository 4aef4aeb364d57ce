"""The built-in host device: hardware, allocator alignment, parallel copies, options, streams."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import aioep
from aioep._environment.host import (
    HostAllocator,
    HostDataTransfer,
    HostFactory,
    _split,
    host_hardware_device,
)
from aioep._plugin.buffer import HOST_MEMORY_INFO

pytestmark = pytest.mark.anyio


def test_host_hardware_device() -> None:
    hw = host_hardware_device()
    assert hw.type is aioep.DeviceType.CPU
    assert hw.device_id == 0
    assert hw.vendor_id >= 0
    assert hw.vendor
    assert hw.metadata["cpu_count"] == str(os.cpu_count() or 1)


async def test_host_ep_device_always_present() -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.ep_devices()
        assert dev.ep_name == "host"
        assert dev.device_type is aioep.DeviceType.CPU
        assert dev.memory_info(aioep.MemoryType.DEFAULT) == HOST_MEMORY_INFO
        assert dev.memory_info(aioep.MemoryType.HOST_ACCESSIBLE) is None
        assert HOST_MEMORY_INFO.alignment == 64
        assert dev.ep_metadata["version"] == HostFactory.version
        assert env.get_shared_allocator(HOST_MEMORY_INFO) is not None


@pytest.mark.parametrize("nbytes", [1, 3, 63, 64, 65, 4096, 1 << 20, (1 << 20) + 17])
def test_host_allocator_alignment(nbytes: int) -> None:
    alloc = HostAllocator()
    bufs = [alloc.alloc(nbytes) for _ in range(8)]
    assert all(b.ptr % 64 == 0 for b in bufs)
    assert alloc.stats()["InUse"] == 8 * nbytes
    assert alloc.stats()["LiveBuffers"] == 8
    t = aioep.Tensor(bufs[0], (nbytes,), np.uint8)
    t.numpy()[:] = 0xAB  # the whole span is writable memory
    assert int(t.numpy()[-1]) == 0xAB
    del t, bufs
    gc.collect()
    assert alloc.stats()["InUse"] == 0
    assert alloc.live_buffers == 0
    assert alloc.stats()["MaxInUse"] == 8 * nbytes


def test_host_allocator_custom_alignment_and_bad_sizes() -> None:
    alloc = HostAllocator(aioep.MemoryInfo("Cpu4k", HOST_MEMORY_INFO.device, alignment=4096))
    b = alloc.alloc(100)
    assert b.ptr % 4096 == 0
    zero = alloc.alloc(0)
    assert zero.nbytes == 0
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(aioep.InvalidArgument, match="nbytes must be an int >= 0"):
            alloc.alloc(bad)  # type: ignore[arg-type]
    with pytest.raises(aioep.InvalidArgument, match="did not allocate"):
        HostAllocator().free(b)
    alloc.free(b)
    assert b.freed
    del zero
    alloc.close()
    with pytest.raises(aioep.ClosedError, match="closed"):
        alloc.alloc(8)


def test_host_allocator_out_of_memory_is_a_device_error() -> None:
    with pytest.raises(aioep.DeviceError, match="out of memory") as e:
        HostAllocator().alloc(1 << 62)
    assert e.value.code is aioep.ErrorCode.EP_FAIL


def test_host_factory_options() -> None:
    assert HostFactory({"copy_threads": 3}).create_data_transfer()._workers == 3
    with pytest.raises(aioep.InvalidArgument, match=r"'copy_threads' must be an integer in \[1,"):
        HostFactory({"copy_threads": 0})
    with pytest.raises(aioep.InvalidArgument, match=r"'copy_threads' must be .*, got 'many'$"):
        HostFactory({"copy_threads": "many"})
    with pytest.raises(aioep.InvalidArgument, match=r"got 2.7 \(a float"):
        HostFactory({"copy_threads": 2.7})  # was taken as 2
    with pytest.raises(aioep.InvalidArgument, match=r"unknown option\(s\) \['speed'\]"):
        HostFactory({"speed": 1})
    with pytest.raises(aioep.InvalidArgument, match="has no memory"):
        HostFactory().create_allocator(
            aioep.MemoryInfo(
                "X", aioep.MemoryDevice(aioep.DeviceType.GPU, aioep.MemoryType.DEFAULT, 1, 0)
            ),
            None,
        )


async def test_backend_options_for_host() -> None:
    async with aioep.Environment(
        autoload=False, backend_options={"host": {"copy_threads": 1}}
    ) as env:
        transfer = env._libraries["host"].transfer
        assert isinstance(transfer, HostDataTransfer)
        assert transfer._workers == 1
    with pytest.raises(aioep.InvalidArgument, match="unknown option"):
        aioep.Environment(autoload=False, backend_options={"host": {"x": 1}}).open()


@given(
    sizes=st.lists(st.integers(1, 10_000_000), min_size=1, max_size=5),
    parts=st.integers(2, 8),
)
def test_split_covers_every_byte_once(sizes: list[int], parts: int) -> None:
    jobs = []
    base = 0
    for n in sizes:
        jobs.append((0x10_0000_0000 + base, 0x20_0000_0000 + base, n))
        base += n + 4096
    shares = _split(jobs, parts)
    assert 1 <= len(shares) <= parts
    pieces = [p for share in shares for p in share]
    # Contiguous, in order, and the same bytes as the jobs.
    rebuilt: list[tuple[int, int, int]] = []
    for d, s, n in pieces:
        if (
            rebuilt
            and rebuilt[-1][0] + rebuilt[-1][2] == d
            and rebuilt[-1][1] + rebuilt[-1][2] == s
        ):
            rebuilt[-1] = (rebuilt[-1][0], rebuilt[-1][1], rebuilt[-1][2] + n)
        else:
            rebuilt.append((d, s, n))
    assert rebuilt == jobs
    sizes_per_share = [sum(n for _, _, n in share) for share in shares]
    assert max(sizes_per_share) - min(sizes_per_share) <= 4096 * len(sizes) + sum(sizes) // parts


def test_parallel_copy_uses_every_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import aioep._environment.host as host

    threads: set[str] = set()
    sizes: list[int] = []
    real = host._memmove

    def spy(dst: int, src: int, n: int) -> int:
        threads.add(threading.current_thread().name)
        sizes.append(n)
        return int(real(dst, src, n))

    monkeypatch.setattr(host, "_memmove", spy)
    monkeypatch.setattr(host, "small_memmove", spy)  # small copies keep the GIL
    transfer = HostDataTransfer(workers=3)
    n = 3 * transfer.parallel_threshold + 12345
    src = aioep.Tensor.from_numpy(np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8))
    dst_arr = np.zeros(n, np.uint8)
    dst = aioep.Tensor.from_numpy(dst_arr)
    try:
        transfer.copy_tensors([(src, dst)], None)
    finally:
        transfer.close()
    assert np.array_equal(dst_arr, src.numpy())
    # Three equal contiguous shares, one memmove each; the calling thread copies one and the
    # pool the others (a pool thread that finishes early may take the last share too).
    assert len(sizes) == 3
    assert max(sizes) - min(sizes) <= 3 * 4096
    assert threading.current_thread().name in threads
    assert len(threads) >= 2
    # Below the threshold: inline on this thread only.
    threads.clear()
    small = HostDataTransfer(workers=3)
    tiny_src = aioep.Tensor.from_numpy(np.ones(10))
    tiny_dst = aioep.Tensor.from_numpy(np.zeros(10))
    small.copy_tensors([(tiny_src, tiny_dst)], None)
    assert tiny_dst.numpy().tolist() == [1.0] * 10
    assert threads == {threading.current_thread().name}


async def test_copy_on_host_stream_orders_work() -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.ep_devices()
        a = np.arange(1 << 16, dtype=np.uint32)
        b = env.empty(a.shape, a.dtype)
        c = np.zeros_like(a)
        async with dev.create_sync_stream() as stream:
            f1 = aioep.copy_tensors([a], [b], stream)
            f2 = aioep.copy_tensors([b], [c], stream)  # in order after f1 on the same stream
            await f2
            assert f1.done()
        np.testing.assert_array_equal(c, a)
        del b, f1, f2


async def test_loop_stays_responsive_during_large_copy() -> None:
    import anyio

    async with aioep.Environment(autoload=False) as env:
        n = 64 << 20
        src = env.empty(n, "uint8")
        src.numpy()[::4096] = 1
        dst = env.empty(n, "uint8")
        dst.numpy()[::4096] = 0
        ticks = 0
        fut = aioep.copy_tensors([src], [dst])

        async def ticker(fut: aioep.CopyFuture) -> None:
            nonlocal ticks
            while not fut.done():
                ticks += 1
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker, fut)
            await fut
        assert ticks > 1  # the loop ran other tasks while the copy was in flight
        assert np.array_equal(dst.numpy()[::4096], src.numpy()[::4096])
        del src, dst, fut
