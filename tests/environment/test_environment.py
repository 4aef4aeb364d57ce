"""Environment: lifecycle, current-environment context, registration, autoload, teardown."""

from __future__ import annotations

import gc
import importlib.metadata
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
from _factories import (
    EVENTS,
    FAKE_INFO,
    BadDevicesFactory,
    BrokenFactory,
    FakeGpuFactory,
    NoDeviceFactory,
)

import aioep
from aioep._environment import registry as _registry

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _clear_events() -> Iterator[None]:
    EVENTS.clear()
    yield
    EVENTS.clear()


@pytest.fixture
def fake_entry_points(monkeypatch: pytest.MonkeyPatch) -> list[importlib.metadata.EntryPoint]:
    """Replace the installed backends by real EntryPoint objects pointing at test factories."""
    module = types.ModuleType("aioep_test_backends")
    module.FakeGpuFactory = FakeGpuFactory  # type: ignore[attr-defined]
    module.BrokenFactory = BrokenFactory  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "aioep_test_backends", module)
    eps = [
        importlib.metadata.EntryPoint(
            "fake", "aioep_test_backends:FakeGpuFactory", "aioep.backends"
        ),
        importlib.metadata.EntryPoint(
            "broken", "aioep_test_backends:BrokenFactory", "aioep.backends"
        ),
        importlib.metadata.EntryPoint(
            "gone", "aioep_test_missing_module:Factory", "aioep.backends"
        ),
    ]
    monkeypatch.setattr(_registry, "_backend_entry_points", lambda: iter(eps))
    return eps


# -- lifecycle and the current environment ------------------------------------------------


async def test_current_environment_outside_raises() -> None:
    with pytest.raises(aioep.EpError, match="no aioep Environment is open"):
        aioep.current_environment()
    with pytest.raises(aioep.EpError, match="no aioep Environment is open"):
        aioep.copy_tensors([], [])


async def test_async_with_makes_current_and_restores() -> None:
    env = aioep.Environment(autoload=False)
    assert env.state == "unopened"
    async with env as entered:
        assert entered is env
        assert env.state == "open"
        assert aioep.current_environment() is env
        assert [d.ep_name for d in env.ep_devices()] == ["host"]
        assert env.libraries == ("host",)
    assert env.state == "closed"
    with pytest.raises(aioep.EpError):
        aioep.current_environment()


async def test_async_with_starts_backends_off_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # Backend start-up (imports, driver init, library registration) can be slow.
    import aioep._environment.environment as environment_module

    started_on: list[int] = []
    host_factory = environment_module.HostFactory

    class RecordingHostFactory(host_factory):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object) -> None:
            started_on.append(threading.get_ident())
            super().__init__(*args)

    monkeypatch.setattr(environment_module, "HostFactory", RecordingHostFactory)
    async with aioep.Environment(autoload=False) as env:
        assert aioep.current_environment() is env  # set on the loop, in this task's context
        assert env.libraries == ("host",)
    assert started_on
    assert threading.get_ident() not in started_on
    sync_env = aioep.Environment(autoload=False).open()  # the sync form: this thread
    try:
        assert sync_env.libraries == ("host",)
    finally:
        sync_env.close()
    assert started_on[-1] == threading.get_ident()


async def test_nested_environments() -> None:
    async with aioep.Environment(autoload=False) as outer:
        async with aioep.Environment(autoload=False) as inner:
            assert aioep.current_environment() is inner
            outer.register_library("fake", FakeGpuFactory)
            assert inner.ep_devices(ep_name=FakeGpuFactory.name) == []
        assert aioep.current_environment() is outer
        assert len(outer.ep_devices(ep_name=FakeGpuFactory.name)) == 1


async def test_reentering_is_refused() -> None:
    env = aioep.Environment(autoload=False)
    async with env:
        with pytest.raises(aioep.ClosedError, match="already opened"):
            await env.__aenter__()
    with pytest.raises(aioep.ClosedError, match="already opened"):
        async with env:
            pass  # pragma: no cover


async def test_closed_environment_refuses_work() -> None:
    async with aioep.Environment(autoload=False) as env:
        pass
    with pytest.raises(aioep.ClosedError, match="not open"):
        env.empty(4, "float32")
    with pytest.raises(aioep.ClosedError):
        env.register_library("fake", FakeGpuFactory)
    await env.aclose()  # idempotent
    assert env.state == "closed"


def test_sync_open_close() -> None:
    env = aioep.Environment(autoload=False).open()
    try:
        assert aioep.current_environment() is env
        a = np.arange(12, dtype=np.float32)
        b = np.zeros_like(a)
        assert env.copy_tensors([a], [b]).wait(timeout=10)[0].shape == (12,)
        np.testing.assert_array_equal(a, b)
    finally:
        env.close()
    assert env.state == "closed"
    env.close()  # idempotent
    with pytest.raises(aioep.EpError):
        aioep.current_environment()


async def test_environment_rejects_str_backends() -> None:
    with pytest.raises(aioep.InvalidArgument, match="list of names"):
        aioep.Environment(backends="sim")  # type: ignore[arg-type]


# -- register / unregister ---------------------------------------------------------------


async def test_register_instance_class_and_module_string() -> None:
    async with aioep.Environment(autoload=False) as env:
        inst = FakeGpuFactory({"tag": "a"})
        devs = env.register_library("a", inst)
        assert [d.factory for d in devs] == [inst]
        devs_b = env.register_library("b", FakeGpuFactory, {"tag": "b"})
        assert devs_b[0].ep_options["tag"] == "b"
        devs_c = env.register_library("c", "_factories:FakeGpuFactory", {"tag": "c"})
        assert devs_c[0].ep_options["tag"] == "c"
        assert env.libraries == ("host", "a", "b", "c")
        dev = devs[0]
        # ORT's example-EP getters (notes A.2).
        assert dev.ep_vendor == "Contoso"
        assert dev.ep_metadata == {"supported_devices": "CrackGriffin 7+", "version": "0.1.0"}
        assert dev.hardware.type is aioep.DeviceType.GPU
        assert dev.memory_info(aioep.MemoryType.DEFAULT) == FAKE_INFO
        assert dev.memory_info(aioep.MemoryType.HOST_ACCESSIBLE) is None
        assert dev.hardware in env.hardware_devices
        assert len(env.ep_devices(device_type=aioep.DeviceType.GPU)) == 3
        assert env.ep_devices(device_type=aioep.DeviceType.CPU)[0].ep_name == "host"
        # One default shared allocator per memory device: the first registration's.
        alloc = env.get_shared_allocator(FAKE_INFO)
        assert alloc is not None
        assert alloc.memory_info == FAKE_INFO
        env.unregister_library("a")
        assert env.libraries == ("host", "b", "c")
        assert inst.closed


async def test_register_instance_with_options_is_refused() -> None:
    async with aioep.Environment(autoload=False) as env:
        with pytest.raises(aioep.InvalidArgument, match="options only apply"):
            env.register_library("a", FakeGpuFactory(), {"tag": "x"})
        assert env.libraries == ("host",)


async def test_register_bad_targets() -> None:
    async with aioep.Environment(autoload=False) as env:
        with pytest.raises(aioep.NoSuchFile, match="aioep_no_such_module") as e1:
            env.register_library("x", "aioep_no_such_module:Factory")
        assert e1.value.code is aioep.ErrorCode.NO_SUCHFILE
        with pytest.raises(aioep.InvalidArgument, match="has no attribute 'Nope'"):
            env.register_library("x", "_factories:Nope")
        with pytest.raises(aioep.InvalidArgument, match="must be an EpFactory") as e2:
            env.register_library("x", 42)
        assert e2.value.code is aioep.ErrorCode.INVALID_ARGUMENT
        with pytest.raises(aioep.InvalidArgument, match="must be an EpFactory"):
            env.register_library("x", "os:path")  # a module, not a factory
        with pytest.raises(aioep.NoSuchFile, match="does not exist"):
            env.register_library("x", "/nonexistent/libplugin_ep.so")
        with pytest.raises(aioep.InvalidArgument, match="unknown option"):
            env.register_library("x", FakeGpuFactory, {"bogus": 1})
        with pytest.raises(aioep.EpError, match=r"libbroken.so.1") as e3:
            env.register_library("x", BrokenFactory)
        assert e3.value.code is aioep.ErrorCode.FAIL
        with pytest.raises(aioep.InvalidArgument, match="non-empty str"):
            env.register_library("", FakeGpuFactory)
        assert env.libraries == ("host",)
        assert env.load_errors == {}


async def test_register_import_error_in_module(tmp_path: pytest.TempPathFactory) -> None:
    async with aioep.Environment(autoload=False) as env:
        with pytest.raises(aioep.NoSuchFile, match="needs 'aioep_missing_dependency'"):
            env.register_library("x", "_broken_backend.needs_dependency:Factory")
        with pytest.raises(aioep.EpError, match="ZeroDivisionError"):
            env.register_library("x", "_broken_backend.raises_on_import:Factory")
        assert env.libraries == ("host",)


async def test_double_register_and_unknown_unregister() -> None:
    async with aioep.Environment(autoload=False) as env:
        env.register_library("fake", FakeGpuFactory)
        with pytest.raises(aioep.InvalidArgument, match="already registered"):
            env.register_library("fake", FakeGpuFactory)
        with pytest.raises(aioep.InvalidArgument, match="was not registered"):
            env.unregister_library("nope")
        with pytest.raises(aioep.InvalidArgument, match="cannot be unregistered"):
            env.unregister_library("host")
        assert env.libraries == ("host", "fake")


async def test_failed_registration_leaves_env_unchanged() -> None:
    async with aioep.Environment(autoload=False) as env:
        hardware = env.hardware_devices
        devices = env.ep_devices()
        shared = env.shared_allocators
        with pytest.raises(aioep.EpError, match="Error creating data transfer") as e:
            env.register_library("bad", BadDevicesFactory)
        assert e.value.code is aioep.ErrorCode.EP_FAIL
        assert env.libraries == ("host",)
        assert env.hardware_devices == hardware
        assert env.ep_devices() == devices
        assert env.shared_allocators == shared
        assert env.get_shared_allocator(FAKE_INFO) is None
        assert env.load_errors == {}
        # The name is free again and a good factory registers under it.
        env.register_library("bad", FakeGpuFactory)
        assert env.get_shared_allocator(FAKE_INFO) is not None


async def test_unregister_refuses_while_buffers_live() -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("fake", FakeGpuFactory, {"tag": "t"})
        t = env.empty((4, 4), "float32", dev.memory_info())
        with pytest.raises(aioep.InUseError, match=r"1 live buffer\(s\).*'FakeGpu'") as e:
            env.unregister_library("fake")
        assert isinstance(e.value, RuntimeError)
        assert env.libraries == ("host", "fake")  # nothing was removed
        assert env.get_shared_allocator(FAKE_INFO) is not None
        del t
        gc.collect()
        env.unregister_library("fake")
        assert env.libraries == ("host",)
        assert env.get_shared_allocator(FAKE_INFO) is None  # notes B.13
        assert ("factory", "t") in EVENTS


async def test_unregister_refuses_while_stream_open() -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("fake", FakeGpuFactory)
        stream = env.create_sync_stream(dev)
        with pytest.raises(aioep.InUseError, match=r"1 open stream\(s\)"):
            env.unregister_library("fake")
        await stream.aclose()
        env.unregister_library("fake")
        assert env.ep_devices(ep_name=FakeGpuFactory.name) == []


async def test_unregister_refuses_while_copy_in_flight() -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("fake", FakeGpuFactory)
        host = np.arange(1024, dtype=np.float32)
        gpu = env.empty(1024, "float32", dev.memory_info())
        gate = aioep.abc.HostNotification()
        async with env.create_sync_stream(dev) as stream:
            stream.impl.enqueue_wait(gate)  # type: ignore[attr-defined]
            fut = env.copy_tensors([host], [gpu], stream)
            assert not fut.done()
            with pytest.raises(aioep.InUseError, match=r"copy batch\(es\) in flight"):
                env.unregister_library("fake")
            gate.set()
            await fut
        del gpu, fut  # the future's result holds the destination too
        gc.collect()
        env.unregister_library("fake")


# -- autoload ----------------------------------------------------------------------------


async def test_autoload_skips_broken_backend(
    fake_entry_points: list[importlib.metadata.EntryPoint],
) -> None:
    with pytest.warns(RuntimeWarning) as record:  # noqa: PT031
        env = aioep.Environment()
        await env.__aenter__()
    try:
        messages = [str(w.message) for w in record]
        assert any("'broken' could not start" in m and "libbroken.so.1" in m for m in messages)
        assert any("'gone' could not start" in m for m in messages)
        assert set(env.load_errors) == {"broken", "gone"}
        assert "libbroken.so.1" in env.load_errors["broken"]
        assert "aioep_test_missing_module" in env.load_errors["gone"]
        assert env.libraries == ("host", "fake")
        # The environment still works, with the good backend's device.
        (dev,) = env.ep_devices(ep_name=FakeGpuFactory.name)
        src = np.arange(256, dtype=np.int32)
        mid = env.empty(256, "int32", dev.memory_info())
        out = np.zeros_like(src)
        await aioep.copy_tensors([src], [mid])
        await aioep.copy_tensors([mid], [out])
        np.testing.assert_array_equal(out, src)
        del mid
    finally:
        await env.aclose()


async def test_autoload_false_and_backends_list(
    fake_entry_points: list[importlib.metadata.EntryPoint],
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        async with aioep.Environment(autoload=False) as env:
            assert env.libraries == ("host",)
            assert env.load_errors == {}
        async with aioep.Environment(backends=["fake"]) as env:
            assert env.libraries == ("host", "fake")
            assert env.load_errors == {}
        async with aioep.Environment(backends=[]) as env:
            assert env.libraries == ("host",)
    with pytest.warns(RuntimeWarning, match="'missing' is not installed"):  # noqa: PT031
        async with aioep.Environment(backends=["fake", "missing"]) as env:
            assert env.libraries == ("host", "fake")
            assert "is installed" in env.load_errors["missing"]


async def test_backend_options_reach_the_factory(
    fake_entry_points: list[importlib.metadata.EntryPoint],
) -> None:
    opts = {"fake": {"tag": "from-options"}}
    async with aioep.Environment(backends=["fake"], backend_options=opts) as env:
        (dev,) = env.ep_devices(ep_name=FakeGpuFactory.name)
        assert dev.ep_options["tag"] == "from-options"
    with pytest.warns(RuntimeWarning, match="unknown option"):  # noqa: PT031
        async with aioep.Environment(
            backends=["fake"], backend_options={"fake": {"nope": 1}}
        ) as env:
            assert "unknown option" in env.load_errors["fake"]
            assert env.libraries == ("host",)


async def test_factory_without_devices_records_reason() -> None:
    async with aioep.Environment(autoload=False) as env:
        assert env.register_library("nodev", NoDeviceFactory) == []
        assert env.load_errors == {"nodev": "no NoDevice hardware found"}


# -- teardown ----------------------------------------------------------------------------


async def test_teardown_order_streams_transfers_allocators_factories() -> None:
    env = aioep.Environment(autoload=False)
    async with env:
        (a,) = env.register_library("a", FakeGpuFactory, {"tag": "a"})
        env.register_library("b", FakeGpuFactory, {"tag": "b"})
        env.create_shared_allocator(a, allocator_type=aioep.AllocatorType.DEVICE)
        assert EVENTS == [("allocator", "a")]  # the replaced default closed at once (no buffers)
        EVENTS.clear()
        stream = env.create_sync_stream(a)
        was = repr(stream)
        await env.aclose()
    assert stream.closed
    # No warning (filterwarnings = error): the stream it closed is in the close report.
    assert env.close_report is not None
    assert env.close_report.streams == (was,)
    assert f"{was} was still open" in str(env.close_report)
    kinds = [k for k, _ in EVENTS]
    # All streams, then all transfers, then all allocators, then all factories.
    assert kinds == sorted(kinds, key=["stream", "transfer", "allocator", "factory"].index)
    assert kinds.count("stream") == 1
    assert kinds.count("transfer") == 2
    assert kinds.count("factory") == 2
    assert kinds.count("allocator") == 1  # b shares a's memory device: it made no default
    # Libraries are released in reverse registration order.
    assert [n for k, n in EVENTS if k == "factory"] == ["b", "a"]


async def test_live_buffer_at_exit_is_reported_and_factory_outlives_it() -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("a", FakeGpuFactory, {"tag": "a"})
        t = env.empty(16, "uint8", dev.memory_info())
    report = env.close_report
    assert report is not None
    assert not report.clean
    assert report.live_buffers == 1
    (live,) = report.buffers
    assert (live.library, live.memory, live.count, live.nbytes) == ("a", "FakeGpu", 1, 16)
    assert "1 live buffer(s) (16 bytes)" in str(report)
    # The buffer stays valid; its allocator and then the factory close when it goes.
    assert ("factory", "a") not in EVENTS
    assert not t.buffer.freed
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None
    assert EVENTS[-2:] == [("allocator", "a"), ("factory", "a")]


async def test_a_tensor_alive_past_async_with_is_no_warning_and_stays_readable() -> None:
    """Ordinary scoping (the quickstart's shape): tensors still named by locals when
    ``async with`` ends. No warning (the suite's filterwarnings = error turns one into a
    failure, raised out of the close), the memory stays readable until dropped, and the
    close report counts it."""
    pytest.importorskip("aioep_sim")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # also in the worker thread that releases the libraries
        async with aioep.Environment(backends=["sim"]) as env:
            (dev,) = env.ep_devices(ep_name="SimExecutionProvider")[:1]
            on_device = env.empty(8, "float32", dev.memory_info(aioep.MemoryType.DEFAULT))
            pinned = env.empty(8, "float32", dev.memory_info(aioep.MemoryType.HOST_ACCESSIBLE))
            host = env.empty(8, "float32")
            await env.copy_tensors([np.arange(8, dtype=np.float32)], [on_device])
            await env.copy_tensors([on_device, on_device], [pinned, host])
    assert env.state == "closed"
    assert pinned.numpy().tolist() == list(range(8))
    assert host.numpy().tolist() == list(range(8))
    assert not on_device.buffer.freed
    report = env.close_report
    assert report is not None
    assert report.live_buffers == 3
    assert sorted((b.library, b.count, b.nbytes) for b in report.buffers) == [
        ("host", 1, 32),
        ("sim", 1, 32),
        ("sim", 1, 32),
    ]
    assert not report.streams
    assert not report.sessions
    del on_device, pinned, host


async def test_a_clean_close_has_a_clean_report() -> None:
    env = aioep.Environment(autoload=False)
    assert env.close_report is None
    async with env:
        t = env.empty(4, "float32")
        del t
        assert env.close_report is None
    assert env.close_report == aioep.CloseReport()
    assert env.close_report.clean
    assert str(env.close_report) == "nothing was left alive"


async def test_aclose_waits_for_copies_in_flight() -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("fake", FakeGpuFactory)
        gate = aioep.abc.HostNotification()
        src = np.arange(64, dtype=np.uint8)
        dst = np.zeros_like(src)
        stream = env.create_sync_stream(dev)
        stream.impl.enqueue_wait(gate)  # type: ignore[attr-defined]
        fut = env.copy_tensors([src], [dst], stream)
        env_stream = stream
        import threading

        threading.Timer(0.05, gate.set).start()
        await env.aclose()
        assert env.close_report is not None
        assert len(env.close_report.streams) == 1
        assert fut.done()
        np.testing.assert_array_equal(dst, src)
        assert env_stream.closed


# -- what the layers below see of the environment ----------------------------------------


async def test_can_copy_follows_the_registered_transfers() -> None:
    async with aioep.Environment(backends=["sim"]) as env:
        (dev,) = env.ep_devices(ep_name="SimExecutionProvider")[:1]
        device_info = dev.memory_info(aioep.MemoryType.DEFAULT)
        assert device_info is not None
        host_info = env.ep_devices(aioep.DeviceType.CPU)[0].memory_infos[0]
        assert host_info.device.is_host_accessible
        assert env.can_copy(host_info, device_info)
        assert env.can_copy(device_info.device, host_info.device)
        with pytest.raises(aioep.InvalidArgument, match="can_copy: dst"):
            env.can_copy(host_info, "sim")  # type: ignore[arg-type]
        env.unregister_library("sim")
        # The sim's transfer went with its library: nothing copies to its memory now.
        assert not env.can_copy(host_info, device_info)
        assert env.can_copy(host_info, host_info)


async def test_an_ep_device_knows_its_environment_while_registered() -> None:
    async with aioep.Environment(backends=["sim"]) as env:
        dev = env.ep_devices(ep_name="SimExecutionProvider")[0]
        assert dev.environment is env
        async with dev.create_sync_stream() as stream:
            assert stream.ep_device is dev
        env.unregister_library("sim")
        assert dev.environment is None
        with pytest.raises(aioep.InvalidArgument, match="not registered in an open Environment"):
            dev.create_sync_stream()
