"""The simulated accelerator backend (aioep-sim): devices, memory, options, transfers, faults."""

from __future__ import annotations

import gc
import importlib.metadata
import weakref
from typing import Any

import numpy as np
import pytest
from _factories import MakeEnv

import aioep
from aioep import DeviceType, MemoryType
from aioep_sim import SIM_VENDOR_ID, SimFactory, SimOptions

pytestmark = pytest.mark.anyio


def sim_devices(env: aioep.Environment) -> list[aioep.EpDevice]:
    return env.ep_devices(ep_name="SimExecutionProvider")


def factory_of(env: aioep.Environment) -> SimFactory:
    factory = sim_devices(env)[0].factory
    assert isinstance(factory, SimFactory)
    return factory


# -- packaging and devices -------------------------------------------------------------------


def test_entry_point_names_the_factory() -> None:
    eps = importlib.metadata.entry_points(group="aioep.backends")
    (ep,) = [e for e in eps if e.name == "sim"]
    assert ep.value == "aioep_sim:SimFactory"
    assert ep.load() is SimFactory


async def test_autoload_by_name_with_options() -> None:
    async with aioep.Environment(
        backends=["sim"], backend_options={"sim": {"num_devices": "3"}}
    ) as env:
        assert env.load_errors == {}
        assert "sim" in env.libraries
        assert len(sim_devices(env)) == 3


async def test_devices_and_memory_infos(make_env: MakeEnv) -> None:
    env = await make_env()
    devs = sim_devices(env)
    assert len(devs) == 2
    for i, dev in enumerate(devs):
        assert dev.ep_name == "SimExecutionProvider"
        assert dev.hardware.type is DeviceType.GPU
        assert dev.hardware.vendor_id == SIM_VENDOR_ID
        assert dev.hardware.device_id == i
        default = dev.memory_info(MemoryType.DEFAULT)
        pinned = dev.memory_info(MemoryType.HOST_ACCESSIBLE)
        assert default is not None
        assert pinned is not None
        assert not default.device.is_host_accessible
        assert pinned.device.is_host_accessible
        assert default.device.device_id == i
        assert env.get_shared_allocator(default) is not None
        assert env.get_shared_allocator(pinned) is not None
    assert devs[0].hardware in env.hardware_devices


async def test_device_memory_is_private_and_pinned_memory_is_host_memory(
    make_env: MakeEnv,
) -> None:
    env = await make_env()
    dev = sim_devices(env)[0]
    x = env.empty((4, 4), "float32", dev.memory_info(MemoryType.DEFAULT))
    with pytest.raises(aioep.InvalidArgument, match="copy it to a host tensor"):
        x.numpy()
    # A private address space: far from any host pointer, never a host address.
    assert x.buffer.ptr >= 1 << 44
    assert x.buffer.ptr % 256 == 0
    p = env.empty((4, 4), "float32", dev.memory_info(MemoryType.HOST_ACCESSIBLE))
    p.numpy()[...] = 3.0
    assert (np.asarray(p) == 3.0).all()


def test_every_sim_device_in_the_process_has_its_own_addresses() -> None:
    """As with a GPU's unified addressing: two factories (two environments) never hand out
    the same address, so a pointer into one's memory never resolves in the other's."""
    first, second = SimFactory(), SimFactory()
    try:
        devices = [*first.devices, *second.devices]
        ptrs = [dev.memory.allocate(256) for dev in devices]
        assert len(set(ptrs)) == len(ptrs)
        for dev, ptr in zip(devices, ptrs):
            for other in devices:
                if other is not dev:
                    with pytest.raises(aioep.DeviceError, match="illegal address"):
                        other.memory.resolve(ptr, 256)
            dev.memory.free(ptr)
    finally:
        first.close()
        second.close()


async def test_pinned_view_outlives_an_explicit_free(make_env: MakeEnv) -> None:
    env = await make_env()
    p = env.empty((1 << 16,), "uint8", sim_devices(env)[0].memory_info(MemoryType.HOST_ACCESSIBLE))
    view = p.numpy()
    view[...] = 7
    p.buffer.free()
    del p
    gc.collect()
    # The view still owns the block: writing and reading it is safe after the free.
    view[...] = 9
    assert (view == 9).all()


async def test_num_devices_zero_offers_none(make_env: MakeEnv) -> None:
    env = await make_env(num_devices=0)
    assert sim_devices(env) == []
    assert "num_devices=0" in env.load_errors["sim"]


# -- memory ------------------------------------------------------------------------------------


async def test_out_of_memory_is_a_clear_device_error(make_env: MakeEnv) -> None:
    env = await make_env(memory_bytes=1 << 20)
    info = sim_devices(env)[0].memory_info(MemoryType.DEFAULT)
    alloc = env.get_shared_allocator(info)
    assert alloc is not None
    a = alloc.alloc(600_000)
    with pytest.raises(aioep.DeviceError) as err:
        alloc.alloc(600_000)
    msg = str(err.value)
    assert "out of memory" in msg
    assert "600000" in msg  # requested
    assert str(1 << 20) in msg  # limit
    assert "600000 in use" in msg
    assert err.value.code is aioep.ErrorCode.EP_FAIL
    stats = alloc.stats()
    assert stats["Limit"] == 1 << 20
    assert stats["DeviceInUse"] == 600_000
    a.free()
    b = alloc.alloc(600_000)  # freed memory counts again
    del b
    # The other device has its own limit.
    other = env.get_shared_allocator(sim_devices(env)[1].memory_info(MemoryType.DEFAULT))
    assert other is not None
    del other


async def test_illegal_device_address_faults(make_env: MakeEnv) -> None:
    env = await make_env()
    dev = sim_devices(env)[0]
    info = dev.memory_info(MemoryType.DEFAULT)
    assert info is not None
    real = env.empty(16, "uint8", info)
    bogus = aioep.Tensor(aioep.Buffer(real.buffer.ptr + 8, 16, info), 16, "uint8")
    with pytest.raises(aioep.DeviceError, match="illegal address"):
        await aioep.copy_tensors([bogus], [np.zeros(16, np.uint8)])


async def test_zero_byte_ranges_are_valid_anywhere(make_env: MakeEnv) -> None:
    env = await make_env()
    dev = sim_devices(env)[0]
    info = dev.memory_info(MemoryType.DEFAULT)
    assert info is not None
    empty = env.empty((0, 4), "float32", info)
    assert empty.buffer.ptr == 0  # a zero-size allocation has no address
    memory = dev.factory.device(info).memory
    assert memory.view(empty.data_ptr, 0).nbytes == 0
    with pytest.raises(aioep.DeviceError, match="illegal address"):
        memory.view(0, 1)


# -- options -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"bogus": 1}, "bogus"),
        ({"num_devices": -1}, "num_devices"),
        ({"num_devices": 1.5}, "num_devices"),
        ({"num_devices": "two"}, "num_devices"),
        ({"num_devices": 1000}, "num_devices"),
        ({"memory_bytes": 0}, "memory_bytes"),
        ({"bandwidth_gbps": -1}, "bandwidth_gbps"),
        ({"bandwidth_gbps": float("nan")}, "bandwidth_gbps"),
        ({"latency_us": True}, "latency_us"),
        ({"latency_us": "fast"}, "latency_us"),
        ({"fail_after_copies": -2}, "fail_after_copies"),
        ({"lose_device_after_copies": "x"}, "lose_device_after_copies"),
    ],
)
def test_bad_options_are_rejected_by_name(options: dict[str, Any], name: str) -> None:
    with pytest.raises(aioep.InvalidArgument, match=name):
        SimFactory(options)


async def test_bad_options_through_the_environment() -> None:
    async with aioep.Environment(autoload=False) as env:
        with pytest.raises(aioep.InvalidArgument, match="latency_us"):
            env.register_library("sim", SimFactory, {"latency_us": -5})
        assert "sim" not in env.libraries


def test_options_parse_strings() -> None:
    opts = SimOptions.from_options(
        {"num_devices": "1", "memory_bytes": "4096", "bandwidth_gbps": "2.5", "latency_us": 3}
    )
    assert opts == SimOptions(num_devices=1, memory_bytes=4096, bandwidth_gbps=2.5, latency_us=3)
    assert SimOptions.from_options(None) == SimOptions()


async def test_stream_and_allocator_options_are_validated(make_env: MakeEnv) -> None:
    env = await make_env()
    dev = sim_devices(env)[0]
    with pytest.raises(aioep.InvalidArgument, match="priority"):
        env.create_sync_stream(dev, {"priority": 1})
    with pytest.raises(aioep.InvalidArgument, match="colour"):
        env.create_shared_allocator(
            dev, MemoryType.DEFAULT, aioep.AllocatorType.DEVICE, {"colour": "red"}
        )


# -- transfers ---------------------------------------------------------------------------------

PLACES = ["host", "dev0", "dev1", "pinned0", "pinned1"]


def make_tensor(env: aioep.Environment, place: str, shape: tuple[int, ...]) -> Any:
    if place == "host":
        return np.zeros(shape, np.uint16)
    devs = sim_devices(env)
    dev = devs[int(place[-1])]
    mem = MemoryType.DEFAULT if place.startswith("dev") else MemoryType.HOST_ACCESSIBLE
    return env.empty(shape, "uint16", dev.memory_info(mem))


@pytest.mark.parametrize("use_stream", [False, True], ids=["direct", "stream"])
@pytest.mark.parametrize("latency", [0, 30])
async def test_transfers_in_all_directions_are_bit_exact(
    make_env: MakeEnv, use_stream: bool, latency: int
) -> None:
    env = await make_env(latency_us=latency)
    rng = np.random.default_rng(1)
    shape = (33, 65)
    data = rng.integers(0, 2**16, size=shape, dtype=np.uint16)
    stream = sim_devices(env)[0].create_sync_stream() if use_stream else None
    for a in PLACES:
        for b in PLACES:
            if a == b == "host":
                continue
            first = make_tensor(env, a, shape)
            second = make_tensor(env, b, shape)
            out = np.zeros(shape, np.uint16)
            # host -> a -> b -> host, every hop through the sim transfer where sim memory is involved
            await aioep.copy_tensors([data], [first], stream=stream)
            await aioep.copy_tensors([first], [second], stream=stream)
            await aioep.copy_tensors([second], [out], stream=stream)
            np.testing.assert_array_equal(out, data, err_msg=f"{a} -> {b}")
    if stream is not None:
        await stream.aclose()


async def test_batch_across_device_pairs(make_env: MakeEnv) -> None:
    env = await make_env(latency_us=10)
    d0, d1 = sim_devices(env)
    srcs = [np.arange(100, dtype=np.int32) * k for k in range(4)]
    devs = [env.empty(100, "int32", d.memory_info(MemoryType.DEFAULT)) for d in (d0, d1, d0, d1)]
    outs = [np.zeros(100, np.int32) for _ in range(4)]
    async with d0.create_sync_stream() as s:
        await aioep.copy_tensors(srcs, devs, stream=s)
        await aioep.copy_tensors(devs, outs, stream=s)
    for src, out in zip(srcs, outs):
        np.testing.assert_array_equal(out, src)


async def test_empty_tensors_copy(make_env: MakeEnv) -> None:
    env = await make_env()
    dev = sim_devices(env)[0]
    x = env.empty((0, 3), "float32", dev.memory_info(MemoryType.DEFAULT))
    await aioep.copy_tensors([np.zeros((0, 3), np.float32)], [x])


async def test_host_stream_cannot_carry_sim_copies(make_env: MakeEnv) -> None:
    env = await make_env()
    host = env.ep_devices(device_type=DeviceType.CPU)[0]
    x = env.empty(4, "float32", sim_devices(env)[0].memory_info(MemoryType.DEFAULT))
    async with env.create_sync_stream(host) as s:
        with pytest.raises(aioep.NotImplementedByEp):
            aioep.copy_tensors([np.zeros(4, np.float32)], [x], stream=s)


async def test_latency_is_paid_per_copy_off_the_loop(make_env: MakeEnv) -> None:
    import time

    env = await make_env(latency_us=100_000)
    x = env.empty(4, "float32", sim_devices(env)[0].memory_info(MemoryType.DEFAULT))
    t0 = time.perf_counter()
    fut = aioep.copy_tensors([np.zeros(4, np.float32)], [x])
    assert not fut.done()  # enqueued: the 100 ms latency is not paid on the loop
    await fut
    assert time.perf_counter() - t0 >= 0.1  # but it is paid


# -- fault injection ---------------------------------------------------------------------------


async def test_fail_after_copies_fails_one_copy_then_recovers(make_env: MakeEnv) -> None:
    env = await make_env(fail_after_copies=2)
    x = env.empty(8, "int64", sim_devices(env)[0].memory_info(MemoryType.DEFAULT))
    out = np.zeros(8, np.int64)
    await aioep.copy_tensors([np.ones(8, np.int64)], [x])
    await aioep.copy_tensors([x], [out])
    with pytest.raises(aioep.DeviceError, match=r"copy 3 \(fail_after_copies=2\)"):
        await aioep.copy_tensors([np.full(8, 2, np.int64)], [x])
    await aioep.copy_tensors([np.full(8, 5, np.int64)], [x])
    await aioep.copy_tensors([x], [out])
    assert (out == 5).all()
    assert factory_of(env).devices[0].copies == 5


async def test_lost_device_fails_everything_after(make_env: MakeEnv) -> None:
    env = await make_env(lose_device_after_copies=1, latency_us=50)
    d0, d1 = sim_devices(env)
    x = env.empty(8, "int64", d0.memory_info(MemoryType.DEFAULT))
    y = env.empty(8, "int64", d1.memory_info(MemoryType.DEFAULT))
    async with d0.create_sync_stream() as s:
        ok = aioep.copy_tensors([np.ones(8, np.int64)], [x], stream=s)
        lost = aioep.copy_tensors([np.ones(8, np.int64)], [x], stream=s)
        after = aioep.copy_tensors([x], [np.zeros(8, np.int64)], stream=s)
        await ok
        with pytest.raises(aioep.DeviceError, match="device lost"):
            await lost
        with pytest.raises(aioep.DeviceError, match="lost"):
            await after
        with pytest.raises(aioep.DeviceError, match="lost"):
            await s  # a lost device's streams report it at every later mark
    assert factory_of(env).devices[0].lost
    with pytest.raises(aioep.DeviceError, match="lost"):
        await aioep.copy_tensors([np.ones(8, np.int64)], [x])
    with pytest.raises(aioep.DeviceError, match="lost"):
        env.empty(8, "int64", d0.memory_info(MemoryType.DEFAULT))
    with pytest.raises(aioep.DeviceError, match="lost"):
        await aioep.copy_tensors([y], [x])  # a peer copy touching the lost device
    # The other device is not lost (it has its own count: one copy still allowed).
    await aioep.copy_tensors([np.full(8, 3, np.int64)], [y])
    assert not factory_of(env).devices[1].lost


# -- copy engines ------------------------------------------------------------------------------


def overlaps(a: Any, b: Any) -> bool:
    return a.start < b.end and b.start < a.end


async def test_copy_engines_overlap_directions_and_serialize_one_direction(
    make_env: MakeEnv,
) -> None:
    # 2 MiB at 0.1 GB/s holds an engine for ~21 ms.
    env = await make_env(bandwidth_gbps=0.1)
    dev = sim_devices(env)[0]
    sim = factory_of(env).devices[0]
    n = 2 << 20
    host_a = np.ones(n, np.uint8)
    host_b = np.zeros(n, np.uint8)
    dev_a = env.empty(n, "uint8", dev.memory_info(MemoryType.DEFAULT))
    dev_b = env.empty(n, "uint8", dev.memory_info(MemoryType.DEFAULT))
    await aioep.copy_tensors([np.full(n, 7, np.uint8)], [dev_b])
    sim.engine_log.clear()
    async with dev.create_sync_stream() as s1, dev.create_sync_stream() as s2:
        # Opposite directions on two streams: both engines busy at once.
        h2d = aioep.copy_tensors([host_a], [dev_a], stream=s1)
        d2h = aioep.copy_tensors([dev_b], [host_b], stream=s2)
        await h2d
        await d2h
        up, down = sorted(sim.engine_log, key=lambda u: u.engine)[::-1]
        assert (up.engine, down.engine) == ("h2d", "d2h")
        assert overlaps(up, down)
        assert up.end - up.start >= n / 0.1e9
        # The same direction on two streams: one engine, so they take turns.
        sim.engine_log.clear()
        f1 = aioep.copy_tensors([host_a], [dev_a], stream=s1)
        f2 = aioep.copy_tensors([host_b], [dev_b], stream=s2)
        await f1
        await f2
        first, second = sim.engine_log
        assert first.engine == second.engine == "h2d"
        assert not overlaps(first, second)
    assert (host_b == 7).all()


async def test_peer_copy_uses_both_devices_engines(make_env: MakeEnv) -> None:
    env = await make_env(bandwidth_gbps=10)
    d0, d1 = sim_devices(env)
    f = factory_of(env)
    x = env.empty(1 << 16, "uint8", d0.memory_info(MemoryType.DEFAULT))
    y = env.empty(1 << 16, "uint8", d1.memory_info(MemoryType.DEFAULT))
    z = env.empty(1 << 16, "uint8", d1.memory_info(MemoryType.DEFAULT))
    await aioep.copy_tensors([np.arange(1 << 16, dtype=np.uint64).astype(np.uint8)], [x])
    for d in f.devices:
        d.engine_log.clear()
    await aioep.copy_tensors([x], [y])
    await aioep.copy_tensors([y], [z])
    assert [u.engine for u in f.devices[0].engine_log] == ["d2h"]
    assert [u.engine for u in f.devices[1].engine_log] == ["h2d", "d2d"]
    out = np.zeros(1 << 16, np.uint8)
    await aioep.copy_tensors([z], [out])
    np.testing.assert_array_equal(out, np.arange(1 << 16, dtype=np.uint64).astype(np.uint8))


def _raised_in(exc: BaseException) -> str:
    tb = exc.__traceback__
    assert tb is not None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_name


@pytest.mark.parametrize("streamed", [True, False])
async def test_failed_copy_chains_the_backend_error_and_drops_its_sources(
    make_env: MakeEnv, streamed: bool
) -> None:
    # latency_us keeps the copy off the caller's thread: the stream worker or the executor.
    env = await make_env(fail_after_copies=0, latency_us=100)
    d0, _ = sim_devices(env)
    dst = env.empty(64, "uint8", d0.memory_info(MemoryType.DEFAULT))
    src = env.empty(64, "uint8")
    src_buffer = weakref.ref(src.buffer)
    gc.disable()  # every release below must come from reference counts alone
    try:
        async with d0.create_sync_stream() as s:
            fut = aioep.copy_tensors([src], [dst], stream=s if streamed else None)
            del src
            try:
                await fut
            except aioep.DeviceError as exc:
                err = exc
            else:
                raise AssertionError("the injected failure did not surface")
            cause = err.__cause__
            assert cause is not None
            assert cause is not err
            assert cause.__cause__ is not cause
            # The backend's own exception: raised by the sim device's fault injection.
            assert isinstance(cause, aioep.DeviceError)
            assert "injected failure of copy 1" in str(cause)
            assert _raised_in(cause) == "begin_copy"
            assert "injected failure of copy 1" in str(err)
            assert fut.exception() is err
            note_err = fut.notification.exception()
            assert note_err is not None
            assert note_err.__cause__ is cause
            del err, cause, note_err
            # A failed future keeps no source alive, while the future itself is still held.
            assert src_buffer() is None
            with pytest.raises(aioep.DeviceError):
                fut.result()
            fut_ref = weakref.ref(fut)
            del fut
            assert fut_ref() is None  # no future <-> error cycle
    finally:
        gc.enable()
    del dst
