"""The ort backend against a real ONNX Runtime plugin EP (onnxruntime-ep-webgpu on Mesa's
software Vulkan driver), plus factory-level tests that need no plugin library.

Crash cases of ORT's own binding (see shared notes: heap corruption on size or count
mismatches, SIGSEGV on unregister with live OrtValues or reused memory infos, SIGABRT
without an adapter) run in subprocesses, to prove the interpreter survives with aioep.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import itertools
import os
import textwrap
from functools import cache
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from _models import add_model
from _webgpu import OrtCopies, run_child, webgpu_skip_reason

import aioep

os.environ.setdefault("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")
pytestmark = pytest.mark.anyio

aioep_ort = pytest.importorskip(
    "aioep_ort", reason="the ort backend (backends/ort) is not installed"
)


def _library_path(package: str, skip_reason: str | None) -> str:
    """The plugin library of ``package`` (``onnxruntime_ep_*``), or skip saying why not."""
    if skip_reason:
        pytest.skip(skip_reason)
    return str(importlib.import_module(package).get_library_path())


@pytest.fixture
def webgpu_path() -> str:
    return _library_path("onnxruntime_ep_webgpu", webgpu_skip_reason())


# -- options and factory-level behaviour (no plugin library needed) ---------------------------
@pytest.mark.parametrize(
    "options",
    [
        {"bogus": 1},
        {"libraries": "no-equals-sign"},
        {"libraries": "a=/nonexistent/libx.so"},
        {"chunk_bytes": 10},
        {"chunk_bytes": "lots"},
        {"chunk_ms": 0},
        {"chunk_ms": "fast"},
        {"device_check": 2},
        {"registration_name": "x"},
    ],
)
def test_bad_options_are_invalid_argument(options: dict[str, Any]) -> None:
    with pytest.raises(aioep.InvalidArgument, match="ort backend"):
        aioep_ort.OrtFactory(options)


def test_chunk_options() -> None:
    assert aioep_ort.OrtFactory({}).options.chunk_bytes is None  # auto: sized by time
    assert aioep_ort.OrtFactory({"chunk_bytes": "auto", "chunk_ms": "4"}).options.chunk_ms == 4
    assert aioep_ort.OrtFactory({"chunk_bytes": 0}).options.chunk_bytes == 0
    assert aioep_ort.OrtFactory({"chunk_bytes": "8192"}).options.chunk_bytes == 8192


def test_call_pacer_sizes_calls_by_time() -> None:
    mib = 1 << 20
    pacer = aioep_ort.CallPacer(0.008)
    assert pacer.call_bytes("d2h") == pacer.initial_bytes
    assert pacer.segment_bytes() == 8 * mib
    for _ in range(40):  # 1 GB/s: 8 ms moves 8 MB
        pacer.record("d2h", 4 * mib, 4 * mib / 1e9)
    assert 7.5e6 < pacer.call_bytes("d2h") < 8.5e6
    assert pacer.call_bytes("h2d") == pacer.initial_bytes  # per direction
    assert pacer.segment_bytes() == 4 * mib  # the smaller direction, a power of two
    # One slow call (a direction's first copy warms the device up) moves it at most 4x.
    before = pacer.call_bytes("d2h")
    pacer.record("d2h", 4 * mib, 10.0)
    assert pacer.call_bytes("d2h") > before / 3
    for _ in range(40):  # very slow, then very fast: clamped to the bounds
        pacer.record("d2h", 4 * mib, 1.0)
    assert pacer.call_bytes("d2h") == pacer.min_bytes
    assert pacer.segment_bytes() == pacer.min_segment_bytes
    for _ in range(40):
        pacer.record("h2d", 4 * mib, 1e-6)
        pacer.record("d2h", 4 * mib, 1e-6)
    assert pacer.call_bytes("h2d") == pacer.max_bytes
    assert pacer.segment_bytes() == pacer.max_segment_bytes
    pacer.record("h2d", 100, 10.0)  # tiny calls measure the fixed cost: ignored
    assert pacer.call_bytes("h2d") == pacer.max_bytes
    fixed = aioep_ort.CallPacer(0.008, 4096)
    fixed.record("d2h", 4 * mib, 10.0)
    assert fixed.call_bytes("d2h") == fixed.segment_bytes() == 4096
    assert aioep_ort.CallPacer(0.008, 0).call_bytes("h2d") == 0


async def test_without_libraries_the_backend_offers_nothing() -> None:
    async with aioep.Environment(backends=["ort"]) as env:
        assert "ort" in env.libraries
        assert "ort" not in env.load_errors
        assert [d for d in env.ep_devices() if isinstance(d, aioep_ort.OrtPluginDevice)] == []


async def test_register_missing_path_is_no_such_file() -> None:
    async with aioep.Environment(autoload=False) as env:
        with pytest.raises(aioep.NoSuchFile):
            env.register_library("nothing", "/nonexistent/libnothing_ep.so")


class _FakeHw:
    type = type("T", (), {"name": "NPU"})()
    vendor_id, device_id, vendor, metadata = 0xABCD, 0, "Fake", {"k": "v"}


class _FakeEpDevice:
    """An OrtEpDevice of a library that declares no memory: ORT needs no data transfer."""

    ep_name, ep_vendor = "FakeNoTransferEP", "Fake"
    ep_metadata: ClassVar[dict[str, str]] = {"version": "0.2.0", "library_path": "fake"}
    ep_options: ClassVar[dict[str, str]] = {"opt": "1"}
    device = _FakeHw()

    def memory_info(self, _t: Any) -> None:
        return None

    def create_sync_stream(self) -> Any:
        raise RuntimeError("The execution provider does not support streams.")


class _FakeOrt:
    __version__ = "1.32.0"
    OrtDeviceMemoryType = type("M", (), {"DEFAULT": 0, "HOST_ACCESSIBLE": 1})

    def __init__(self) -> None:
        self.registered: dict[str, str] = {}
        self.unregistered: list[str] = []

    def get_ep_devices(self) -> list[Any]:
        return [_FakeEpDevice() for _ in self.registered]

    def register_execution_provider_library(self, name: str, path: str) -> None:
        self.registered[name] = path

    def unregister_execution_provider_library(self, name: str) -> None:
        del self.registered[name]
        self.unregistered.append(name)


async def test_library_without_data_transfer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    fake = _FakeOrt()
    monkeypatch.setattr("aioep_ort._ort._module", fake)
    lib = tmp_path / "libfake_ep.so"
    lib.write_bytes(b"")
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("fake", str(lib))
        assert isinstance(dev, aioep_ort.OrtPluginDevice)
        assert (dev.ep_name, dev.ep_vendor) == ("FakeNoTransferEP", "Fake")
        assert dev.ep_metadata["version"] == "0.2.0"
        assert dict(dev.ep_options) == {"opt": "1"}
        assert dev.hardware.type is aioep.DeviceType.NPU
        assert dev.memory_infos == ()
        assert dev.factory.create_data_transfer() is None
        assert not dev.factory.is_stream_aware()
        with pytest.raises(aioep.InvalidArgument, match="no DEFAULT memory"):
            env.create_sync_stream(dev)
        env.unregister_library("fake")
    assert fake.unregistered == ["fake"]
    with pytest.raises(aioep.ClosedError):
        _ = dev.ort_device


def test_ort_errors_are_translated() -> None:
    from aioep_ort._ort import translate

    not_impl = type("NotImplemented", (Exception,), {})
    assert isinstance(
        translate(not_impl("Data transfer implementation ... was not found."), "copy"),
        aioep.NotImplementedByEp,
    )
    assert isinstance(translate(type("InvalidArgument", (Exception,), {})("x"), "y"), ValueError)
    assert isinstance(translate(type("EPFail", (Exception,), {})("x"), "y"), aioep.DeviceError)


# -- a real plugin library: onnxruntime-ep-webgpu ---------------------------------------------
async def test_register_path_maps_devices_faithfully(webgpu_path: str) -> None:
    async with aioep.Environment(autoload=False) as env:
        devices = env.register_library("webgpu", webgpu_path)
        (dev,) = [d for d in devices if d.ep_name == "WebGpuExecutionProvider"]
        assert dev.ep_vendor == "Microsoft"
        assert dev.ep_metadata["version"] == "0.4.0"
        assert dev.ep_metadata["library_path"].endswith(".so")
        assert dev.hardware.type is aioep.DeviceType.CPU  # software adapter, as ORT lists it
        info = dev.memory_info(aioep.MemoryType.DEFAULT)
        assert info is not None
        assert info.name == "WebGPU_Buf"
        assert info.device.device_type is aioep.DeviceType.GPU
        assert not info.device.is_host_accessible
        assert dev.memory_info(aioep.MemoryType.HOST_ACCESSIBLE) is None
        assert env.ep_devices(ep_name="WebGpuExecutionProvider") == [dev]
        assert env.get_shared_allocator(info) is not None
        x = env.empty((2, 3), "float32", info)
        with pytest.raises(aioep.InvalidArgument, match="device memory"):
            x.numpy()
        del x
        gc.collect()
        env.unregister_library("webgpu")
        assert env.ep_devices(ep_name="WebGpuExecutionProvider") == []


async def test_libraries_option_from_config(webgpu_path: str) -> None:
    options = {"ort": {"libraries": f"wg_a={webgpu_path}", "chunk_bytes": 1 << 20}}
    async with aioep.Environment(backends=["ort"], backend_options=options) as env:
        (dev,) = env.ep_devices(ep_name="WebGpuExecutionProvider")
        assert isinstance(dev, aioep_ort.OrtPluginDevice)
        assert isinstance(dev.factory, aioep_ort.OrtFactory)
        assert dev.registration_name == "wg_a"
        assert dev.factory.options.chunk_bytes == 1 << 20


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((5,), "uint8"),
        ((3,), "float16"),
        ((7, 129), "float32"),
        ((3000,), "int64"),
        ((), "float64"),
    ],
)
async def test_round_trip_host_device_host(
    webgpu_path: str, shape: tuple[int, ...], dtype: str
) -> None:
    async with aioep.Environment(autoload=False) as env:
        # A small chunk so that multi-segment buffers and chunked copies are exercised.
        (dev,) = env.register_library("webgpu", webgpu_path, {"chunk_bytes": 4096})
        info = dev.memory_info()
        a = (np.arange(int(np.prod(shape))) * 3 % 251).astype(dtype).reshape(shape)
        x, y = env.empty(shape, dtype, info), env.empty(shape, dtype, info)
        out = np.zeros_like(a)
        await aioep.copy_tensors([a], [x])
        await aioep.copy_tensors([x], [y])  # device to device
        await aioep.copy_tensors([y], [out])
        np.testing.assert_array_equal(out, a)
        del x, y


async def test_views_at_any_offset(webgpu_path: str) -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("webgpu", webgpu_path, {"chunk_bytes": 4096})
        n = 3 * 4096 + 77
        base = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
        x = env.empty(n, np.uint8, dev.memory_info())
        await aioep.copy_tensors([base], [x])
        # Unaligned, crossing segment boundaries, odd lengths (WebGPU pads uploads to 4 bytes).
        for offset, length in [(1, 3), (4090, 11), (5000, 7000), (0, 4097), (n - 5, 5)]:
            patch = np.random.default_rng(offset).integers(0, 255, length, dtype=np.uint8)
            view = aioep.Tensor(x.buffer, (length,), np.uint8, byte_offset=offset)
            await aioep.copy_tensors([patch], [view])
            base[offset : offset + length] = patch
            got = np.zeros(length, np.uint8)
            await aioep.copy_tensors([view], [got])
            np.testing.assert_array_equal(got, patch)
        whole = np.zeros(n, np.uint8)
        await aioep.copy_tensors([x], [whole])
        np.testing.assert_array_equal(whole, base)
        del x, view


async def test_auto_chunks_batch_several_segments_per_call(webgpu_path: str) -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("webgpu", webgpu_path)
        factory = dev.factory
        assert isinstance(factory, aioep_ort.OrtFactory)
        pacer = factory.pacer
        pacer.min_segment_bytes = pacer.max_segment_bytes = 4096  # tiny segments, big calls
        n = 40 * 4096 + 123
        base = np.random.default_rng(1).integers(0, 255, n, dtype=np.uint8)
        x = env.empty(n, np.uint8, dev.memory_info())
        assert factory.segment_bytes(x) == 4096
        calls: list[int] = []
        real = aioep_ort._transfer._ort_copy

        def spy(src: list[Any], dst: list[Any], lock: Any) -> None:
            calls.append(len(src))
            real(src, dst, lock)

        aioep_ort._transfer._ort_copy = spy
        try:
            await aioep.copy_tensors([base], [x])
            assert max(calls) > 1  # several segment pairs in one ORT call
            view = aioep.Tensor(x.buffer, (5 * 4096,), np.uint8, byte_offset=4093)
            patch = np.arange(5 * 4096, dtype=np.uint8)
            await aioep.copy_tensors([patch], [view])  # unaligned: ends read-patch-written
            base[4093 : 4093 + 5 * 4096] = patch
            whole = np.zeros(n, np.uint8)
            await aioep.copy_tensors([x], [whole])
            np.testing.assert_array_equal(whole, base)
        finally:
            aioep_ort._transfer._ort_copy = real
        assert pacer.call_bytes("h2d") >= pacer.min_bytes
        del x, view


async def test_validation_before_ort(webgpu_path: str) -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("webgpu", webgpu_path)
        one = env.empty((1,), "float32", dev.memory_info())
        big = np.zeros(1 << 20, np.float32)
        with pytest.raises(aioep.InvalidArgument, match="size mismatch"):
            aioep.copy_tensors([big], [one])
        with pytest.raises(aioep.InvalidArgument, match="size mismatch"):
            aioep.copy_tensors([one], [big])
        with pytest.raises(aioep.InvalidArgument, match="same length"):
            aioep.copy_tensors([big[:1], big[1:2]], [one])
        with pytest.raises(aioep.InvalidArgument, match="dtype"):
            aioep.copy_tensors([np.zeros(1, np.int32)], [one])
        del one


async def test_unregister_refused_while_tensors_live(webgpu_path: str) -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("webgpu", webgpu_path)
        x = env.empty((16,), "float32", dev.memory_info())
        with pytest.raises(aioep.InUseError, match="live buffer"):
            env.unregister_library("webgpu")
        del x
        gc.collect()
        env.unregister_library("webgpu")


async def test_streams_not_supported_by_webgpu(webgpu_path: str) -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("webgpu", webgpu_path)
        with pytest.raises(aioep.NotImplementedByEp, match="does not support streams"):
            env.create_sync_stream(dev)


async def test_event_loop_keeps_running_during_a_large_copy(
    webgpu_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A large copy is split into ORT calls with the GIL released between them: the loop
    # must run *between* two calls, not only before the first and after the last. Count
    # the calls (fixed 4 MiB each) and record, on every loop tick, how many had finished.
    # No timing bound here: benchmarks/ort_copy.py measures the loop lag.
    import onnxruntime as ort_module

    real_copy = ort_module.copy_tensors
    finished = 0

    def counting_copy(*args: Any) -> None:
        nonlocal finished
        real_copy(*args)
        finished += 1

    monkeypatch.setattr(ort_module, "copy_tensors", counting_copy)
    options = {"ort": {"libraries": f"webgpu={webgpu_path}", "chunk_bytes": 4 << 20}}
    async with aioep.Environment(backends=["ort"], backend_options=options) as env:
        (dev,) = env.ep_devices(ep_name="WebGpuExecutionProvider")
        n = 64 << 20
        a = np.arange(n, dtype=np.uint32).view(np.uint8)[:n]
        x = env.empty(n, np.uint8, dev.memory_info())
        try:
            seen: list[int] = []

            async def ticker() -> None:
                while True:
                    seen.append(finished)
                    await anyio.sleep(0.001)

            async with anyio.create_task_group() as tg:
                tg.start_soon(ticker)
                before = finished
                await aioep.copy_tensors([a], [x])
                calls = finished - before
                tg.cancel_scope.cancel()
            assert calls == n // (4 << 20)
            assert any(before < c < before + calls for c in seen), (calls, seen)
            back = await aioep.copy_tensors([x], [np.empty(n, np.uint8)])
            np.testing.assert_array_equal(back[0], a)
        finally:
            del x


# -- crash cases of ORT's binding, each in a subprocess --------------------------------------
_PRELUDE = """
import gc, numpy as np, aioep, onnxruntime_ep_webgpu as w
env = aioep.Environment(autoload=False).open()
(dev,) = env.register_library("webgpu", w.get_library_path())
info = dev.memory_info()
"""


@pytest.mark.parametrize(
    ("case", "code"),
    [
        (
            "size mismatch: 64 MiB into a 1-element device tensor and back",
            """
            one = env.empty((1,), "float32", info)
            big = np.zeros(16 << 20, np.float32)
            for src, dst in (([big], [one]), ([one], [big])):
                try:
                    aioep.copy_tensors(src, dst).wait()
                except aioep.InvalidArgument as e:
                    print("caught", e)
            """,
        ),
        (
            "src and dst lists of different lengths",
            """
            one = env.empty((4,), "float32", info)
            try:
                aioep.copy_tensors([np.zeros(4, np.float32)] * 2, [one]).wait()
            except aioep.InvalidArgument as e:
                print("caught", e)
            """,
        ),
        (
            "unregister while a device tensor is alive, then close with it alive",
            """
            x = env.empty((1024,), "float32", info)
            aioep.copy_tensors([np.ones(1024, np.float32)], [x]).wait()
            try:
                env.unregister_library("webgpu")
            except aioep.InUseError as e:
                print("caught", e)
            import warnings; warnings.simplefilter("ignore")
            env.close()          # x outlives the environment: ORT unregisters after x goes
            h = np.zeros(1024, np.float32)
            del x; gc.collect()
            print("caught nothing to catch: x released after close")
            """,
        ),
        (
            "memory info kept from before unregister + re-register",
            """
            old_dev, old_info = dev, info
            del dev, info
            env.unregister_library("webgpu")
            (dev,) = env.register_library("webgpu", w.get_library_path())
            x = env.empty((8,), "float32", old_info)   # routed to the new registration
            aioep.copy_tensors([np.arange(8, dtype=np.float32)], [x]).wait()
            h = np.zeros(8, np.float32); aioep.copy_tensors([x], [h]).wait()
            assert list(h) == list(range(8))
            try:
                old_dev.ort_device
            except aioep.ClosedError as e:
                print("caught", e)
            del x
            """,
        ),
        (
            "unregister while a session on the library is open",
            """
            import anyio
            from onnx import TensorProto, helper
            vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in "xy"]
            graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "g", vi[:1], vi[1:])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

            async def main():
                sess = await env.create_session(model, [dev])
                try:
                    env.unregister_library("webgpu")
                except aioep.InUseError as e:
                    print("caught", e)
                out = await sess.run({"x": np.ones(4, np.float32)}, output_location="host")
                assert list(out["y"].numpy()) == [2.0] * 4
                await sess.aclose()
                del out
                env.unregister_library("webgpu")   # nothing uses it any more

            anyio.run(main)
            """,
        ),
    ],
)
def test_crash_cases_survive_in_subprocess(webgpu_path: str, case: str, code: str) -> None:
    proc = run_child(_PRELUDE + textwrap.dedent(code) + "\nenv.close()\nprint('SURVIVED')\n")
    assert proc.returncode == 0, f"{case}: rc {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "SURVIVED" in proc.stdout, proc.stdout
    assert "caught" in proc.stdout, proc.stdout


def test_no_adapter_is_device_error_not_abort(webgpu_path: str) -> None:
    # No Vulkan driver at all: raw ORT aborts (SIGABRT) on the first device allocation.
    code = _PRELUDE + textwrap.dedent(
        """
        try:
            env.empty((4,), "float32", info)
        except aioep.DeviceError as e:
            print("caught", str(e)[:200])
        env.close()
        print("SURVIVED")
        """
    )
    proc = run_child(code, VK_ICD_FILENAMES="/nonexistent/icd.json", VK_DRIVER_FILES="/nonexistent")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "caught" in proc.stdout
    assert "SURVIVED" in proc.stdout


def test_arena_options_out_of_range_are_invalid_argument(webgpu_path: str) -> None:
    arena = importlib.util.find_spec("aioep._memory.arena") is not None
    code = _PRELUDE + textwrap.dedent(
        f"""
        try:   # ORT's OrtArenaCfg key: stored unchecked by ORT (crashes later); refused here
            env.create_shared_allocator(dev, aioep.MemoryType.DEFAULT, aioep.AllocatorType.DEVICE,
                                        {{"arena_extend_strategy": 11}})
        except aioep.InvalidArgument as e:
            print("caught", e)
        if {arena}:
            try:
                env.create_shared_allocator(dev, aioep.MemoryType.DEFAULT,
                                            aioep.AllocatorType.ARENA, {{"arena.extend_strategy": 11}})
            except aioep.InvalidArgument as e:
                print("caught arena", e)
        env.close()
        print("SURVIVED")
        """
    )
    proc = run_child(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "caught" in proc.stdout
    assert "SURVIVED" in proc.stdout
    if not arena:
        pytest.skip(
            "aioep._memory.arena is not there yet: only the DEVICE-allocator key was checked"
        )
    assert "caught arena" in proc.stdout


async def test_session_runs_on_the_real_webgpu_ep(webgpu_path: str) -> None:
    """The session API drives a real plugin EP: ORT runs the claimed nodes with WebGPU
    selected (add_provider_for_devices), and the results match ORT's CPU EP."""
    from _baseline import ort_baseline
    from onnx import TensorProto, helper

    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 8], np.linspace(-2, 2, 32).tolist())
    nodes = [helper.make_node("Add", ["x", "w"], ["a"]), helper.make_node("Mul", ["a", "x"], ["y"])]
    graph = helper.make_graph(nodes, "g", [x_info], [y_info], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    expected = ort_baseline(model).run(None, {"x": x})[0]

    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("webgpu", webgpu_path)
        async with await env.create_session(model, [dev]) as sess:
            assert sess.assignment == (dev.ep_name, dev.ep_name)
            out = await sess.run({"x": x}, output_location="host")
            np.testing.assert_allclose(out["y"].numpy(), expected, rtol=1e-5, atol=1e-6)
            del out


def test_ort_owned_host_outputs_count_on_the_registration() -> None:
    """An array ORT hands back from ``InferenceSession.run`` does not own its memory (ORT's
    tensor does, and a plugin such as OpenVINO may have allocated it): the host path wraps
    it so that it counts as a live value of the library's registration until its last
    view is collected (ORT unregisters the library only then)."""
    from _baseline import ort_baseline

    from aioep_ort._ep import _owned_by_aioep
    from aioep_ort._registry import Registration

    sess = ort_baseline(add_model())
    (raw,) = sess.run(None, {"x": np.arange(4, dtype=np.float32)})
    assert raw.base is not None  # ORT's memory, not numpy's
    reg = Registration("counted", "/nowhere/lib.so", [])
    reg.registered = False  # a bare count: never asks ORT to unregister anything
    out = _owned_by_aioep(raw, [reg])
    del raw
    assert reg.live_values == 1
    view = out[1:]
    del out
    gc.collect()
    assert reg.live_values == 1, "released while a view of the output was alive"
    np.testing.assert_array_equal(view, [2.0, 4.0, 6.0])
    del view
    gc.collect()
    assert reg.live_values == 0
    owned = np.arange(3.0)
    assert _owned_by_aioep(owned, [reg]) is owned
    assert reg.live_values == 0


# -- OpenVINO's plugin EP (onnxruntime-ep-openvino, on the CPU) -------------------------------
_OPENVINO_PROBE = """
import onnxruntime as ort, onnxruntime_ep_openvino as ov
ort.register_execution_provider_library("probe", ov.get_library_path())
names = [d.ep_name for d in ort.get_ep_devices()]
print(sum(n == ov.get_ep_name() for n in names))
"""


@cache
def _openvino_skip_reason() -> str | None:
    if importlib.util.find_spec("onnxruntime_ep_openvino") is None:
        return "onnxruntime-ep-openvino is not installed (pip install -e 'backends/ort[openvino]')"
    proc = run_child(_OPENVINO_PROBE)
    if proc.returncode != 0:
        return f"the OpenVINO plugin library failed to load (exit code {proc.returncode})"
    if proc.stdout.strip() == "0":
        # OpenVINO's factory offers devices only for hardware it supports (Intel CPUs and
        # GPUs): on other processors it registers and lists none.
        return "OpenVINO's plugin EP offers no device on this machine's processor"
    return None


@pytest.fixture
def openvino_path() -> str:
    return _library_path("onnxruntime_ep_openvino", _openvino_skip_reason())


def _data_input(model: Any) -> str:
    """The first graph input that is not an initializer (old models list both)."""
    inits = {i.name for i in model.graph.initializer}
    return next(i.name for i in model.graph.input if i.name not in inits)


def _light_model(name: str) -> str:
    import onnx

    path = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", name)
    if not os.path.exists(path):
        pytest.skip(f"the installed onnx wheel has no {name}")
    return path


async def test_openvino_session_matches_onnxruntime(openvino_path: str) -> None:
    """Registration, a device copy and a session on a light model through OpenVINO's
    plugin EP; outputs match onnxruntime's with the same EP (OpenVINO's own numerics: in
    bf16 on processors that have it, up to 1e-3 from the CPU EP on this model), and the CPU
    EP's within that."""
    import onnx
    from _baseline import ort_baseline, ort_plugin_baseline

    model = onnx.load(_light_model("light_squeezenet.onnx"))
    name = _data_input(model)
    x = np.random.default_rng(7).random((1, 3, 224, 224), dtype=np.float32)
    on_cpu = ort_baseline(model).run(None, {name: x})[0]
    async with aioep.Environment(autoload=False) as env:
        (dev, *_) = env.register_library("openvino", openvino_path)
        expected = ort_plugin_baseline(model, dev.ep_name).run(None, {name: x})[0]
        np.testing.assert_allclose(expected, on_cpu, atol=5e-3)
        h = np.arange(16, dtype=np.float32)
        t = env.empty((16,), "float32", dev.memory_info())
        back = np.zeros_like(h)
        await aioep.copy_tensors([h], [t])
        await aioep.copy_tensors([t], [back])
        np.testing.assert_array_equal(back, h)
        del t
        async with await env.create_session(model, [dev]) as sess:
            out = await sess.run({name: x}, output_location="host")
            (y,) = out.values()
            np.testing.assert_allclose(y.numpy(), expected, rtol=1e-3, atol=1e-4)
            del out, y


def test_openvino_output_outliving_its_environment_survives(openvino_path: str) -> None:
    """The crash the ort backend had: a session output that outlives its environment was
    released after ORT unregistered the library whose allocator owns it (SIGSEGV)."""
    code = f"""
    import anyio, numpy as np, onnx, onnxruntime, aioep, onnxruntime_ep_openvino as ov
    path = {_light_model("light_squeezenet.onnx")!r}
    model = onnx.load(path)
    inits = {{i.name for i in model.graph.initializer}}
    name = next(i.name for i in model.graph.input if i.name not in inits)
    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)

    async def main():
        async with aioep.Environment(autoload=False) as env:
            dev = env.register_library("openvino", ov.get_library_path())[0]
            async with await env.create_session(model, ep_devices=[dev]) as sess:
                out = await sess.run({{name: x}}, output_location="host")
        return out

    out = anyio.run(main)
    onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {{name: x}})
    del out
    import gc; gc.collect()
    print("SURVIVED")
    """
    proc = run_child(code)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "SURVIVED" in proc.stdout, proc.stdout


# -- device-resident session I/O on a plugin EP (ORT's IOBinding underneath) -----------------
async def test_session_outputs_stay_on_the_plugin_device(webgpu_path: str) -> None:
    """Outputs of a plugin partition come back in the plugin's DEFAULT memory (no copy);
    output_location="host" copies them down."""
    x = np.arange(4, dtype=np.float32)
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("webgpu", webgpu_path)
        async with await env.create_session(add_model(), [dev]) as sess:
            out = await sess.run({"x": x})
            y = out["y"]
            assert y.memory_info == dev.memory_info(aioep.MemoryType.DEFAULT)
            assert not y.is_host_accessible
            assert (y.shape, y.dtype) == ((4,), np.float32)
            back = np.zeros(4, np.float32)
            await aioep.copy_tensors([y], [back])
            np.testing.assert_array_equal(back, 2 * x)
            host = await sess.run({"x": x}, output_location="host")
            assert host["y"].is_host_accessible
            np.testing.assert_array_equal(host["y"].numpy(), 2 * x)
            with pytest.raises(aioep.InUseError, match="live buffer"):
                env.unregister_library("webgpu")
            del out, y, host


async def test_device_inputs_are_bound_where_they_are(
    webgpu_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device tensor (uploaded by the caller, or the output of another session) is bound
    by its buffer handle: chaining two sessions on the device makes no copy at all."""
    copies = OrtCopies(monkeypatch)
    x = np.linspace(-1, 1, 4, dtype=np.float32)
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("webgpu", webgpu_path)
        first = await env.create_session(add_model(), [dev])
        second = await env.create_session(add_model(), [dev])
        async with first, second:
            xd = env.empty((4,), "float32", dev.memory_info())
            await aioep.copy_tensors([x], [xd])
            before = copies.calls
            mid = await first.run({"x": xd})
            out = await second.run({"x": mid["y"]})
            assert copies.calls == before, "a device-resident chain copied through ORT"
            back = np.zeros(4, np.float32)
            await aioep.copy_tensors([out["y"]], [back])
            np.testing.assert_allclose(back, 4 * x)
            del xd, mid, out


async def test_segmented_device_input_is_copied_once(
    webgpu_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device tensor that spans several OrtValue segments cannot be bound by handle: it is
    read to the host once and bound from there, and the result is still right."""
    copies = OrtCopies(monkeypatch)
    n = 4096  # 16 KiB over 4 KiB segments
    x = np.arange(n, dtype=np.float32)
    options = {"ort": {"libraries": f"webgpu={webgpu_path}", "chunk_bytes": 4096}}
    async with aioep.Environment(backends=["ort"], backend_options=options) as env:
        (dev,) = env.ep_devices(ep_name="WebGpuExecutionProvider")
        async with await env.create_session(add_model(n), [dev]) as sess:
            (ep,) = sess._eps
            xd = env.empty((n,), "float32", dev.memory_info())
            await aioep.copy_tensors([x], [xd])
            before = copies.calls
            out = await sess.run({"x": xd}, output_location="host")
            np.testing.assert_array_equal(out["y"].numpy(), 2 * x)
            assert ep.device_io.host_fallbacks == 1
            # the fallback read (one call per 4 KiB segment: chunk_bytes caps calls too),
            # then the output's download; no upload (ORT reads the bound host copy)
            assert copies.calls - before == x.nbytes // 4096 + 1
            # A host input: the session's copy of it is one OrtValue, bound by handle.
            before = copies.calls
            out = await sess.run({"x": x}, output_location="host")
            np.testing.assert_array_equal(out["y"].numpy(), 2 * x)
            assert ep.device_io.host_fallbacks == 1
            assert copies.calls - before == 2  # one upload, one download
            del xd, out


async def test_device_outputs_outlive_their_environment(webgpu_path: str) -> None:
    """A device output kept past the environment's exit stays valid memory of the library:
    ORT keeps the library registered until the tensor is gone."""
    import onnxruntime as ort

    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("webgpu-kept", webgpu_path)
        async with await env.create_session(add_model(), [dev]) as sess:
            out = await sess.run({"x": np.ones(4, np.float32)})
        await env.aclose()
        assert env.close_report is not None
        assert env.close_report.live_buffers >= 1
    y = out.pop("y")
    gc.collect()
    assert any(d.ep_name == "WebGpuExecutionProvider" for d in ort.get_ep_devices())
    del y
    gc.collect()
    # A release that found the device lock busy (a session being destroyed, say) finishes
    # on the releaser thread: wait for the releases queued so far.
    from aioep_ort._memory import _releaser

    _releaser().submit(lambda: None).result(timeout=60)
    assert not any(d.ep_name == "WebGpuExecutionProvider" for d in ort.get_ep_devices())


# -- faults on a plugin-EP session -------------------------------------------------------------
def _reshape_model() -> Any:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "shape"], ["r"]),
            helper.make_node("Relu", ["r"], ["y"]),
        ],
        "g",
        [x, shape],
        [y],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


async def test_a_run_that_fails_inside_ort_leaves_the_session_usable(webgpu_path: str) -> None:
    x = np.array([-1, 2, -3, 4], np.float32)
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("webgpu", webgpu_path)
        async with await env.create_session(_reshape_model(), [dev]) as sess:
            with pytest.raises(aioep.EpError, match=r"(?i)reshape"):
                await sess.run({"x": x, "shape": np.array([3, 3], np.int64)})
            out = await sess.run(
                {"x": x, "shape": np.array([2, 2], np.int64)}, output_location="host"
            )
            np.testing.assert_array_equal(out["y"].numpy(), [[0, 2], [0, 4]])


def _matmul_chain(n: int, depth: int) -> Any:
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.eye(n, dtype=np.float32), "w")
    vi = [helper.make_tensor_value_info(v, TensorProto.FLOAT, [n, n]) for v in "xy"]
    names = ["x", *[f"m{i}" for i in range(depth - 1)], "y"]
    nodes = [helper.make_node("MatMul", [a, "w"], [b]) for a, b in itertools.pairwise(names)]
    graph = helper.make_graph(nodes, "g", vi[:1], vi[1:], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


async def test_cancelled_and_closing_runs_keep_their_tensors(webgpu_path: str) -> None:
    """Cancelling runs mid-flight abandons only the wait: the device input stays alive until
    ORT is done with it, and closing the session waits for runs in flight (no crash)."""
    n = 256
    x = np.random.default_rng(1).random((n, n), dtype=np.float32)
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("webgpu", webgpu_path)
        sess = await env.create_session(_matmul_chain(n, 8), [dev])
        await sess.run({"x": x})  # compile the shaders once
        xd = env.empty((n, n), "float32", dev.memory_info())
        await aioep.copy_tensors([x], [xd])
        with anyio.move_on_after(0.005):
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(sess.run, {"x": xd})
        del xd
        gc.collect()
        out = await sess.run({"x": x}, output_location="host")
        np.testing.assert_allclose(out["y"].numpy(), x, rtol=1e-5)

        async def late_run() -> None:
            with contextlib.suppress(aioep.ClosedError):
                await sess.run({"x": x})

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(late_run)
            await anyio.lowlevel.checkpoint()
            await sess.aclose()  # waits for the runs already in flight
        assert sess.closed
        with pytest.raises(aioep.ClosedError):
            await sess.run({"x": x})
        del out


async def test_an_output_nothing_reads_does_not_keep_a_node_off_the_plugin(
    webgpu_path: str,
) -> None:
    """A node whose unused extra output has no inferable type (old Dropout's mask) is still
    claimed by the plugin EP: light_squeezenet runs wholly on WebGPU."""
    import onnx
    from _baseline import ort_baseline

    model = onnx.load(_light_model("light_squeezenet.onnx"))
    name = _data_input(model)
    x = np.random.default_rng(2).random((1, 3, 224, 224), dtype=np.float32)
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("webgpu", webgpu_path)
        async with await env.create_session(model, [dev]) as sess:
            assert set(sess.assignment) == {dev.ep_name}
            out = await sess.run({name: x}, output_location="host")
            (y,) = out.values()
            (want,) = ort_baseline(model).run(None, {name: x})
            np.testing.assert_allclose(y.numpy(), want, rtol=1e-3, atol=1e-4)
            del out, y


def test_device_outputs_take_onnxruntimes_numpy_types() -> None:
    """A device output's dtype is what onnxruntime's binding gives the same output on the
    host (float8e4m3fn as uint8 bytes), else onnx's ml_dtypes type; values aioep cannot hold
    as a tensor (strings, sequences, types ORT packs below a byte), and types onnx maps to a
    dtype of another element size, are refused."""
    from onnx import TensorProto, helper

    from aioep_ort._binding import output_dtype

    assert output_dtype("tensor(float)", 3, 12) == np.float32
    assert output_dtype("tensor(bool)", 3, 3) == np.bool_
    assert output_dtype("tensor(float8e4m3fn)", 3, 3) == np.uint8
    if np.dtype(helper.tensor_dtype_to_np_dtype(TensorProto.BFLOAT16)).itemsize == 2:
        assert output_dtype("tensor(bfloat16)", 3, 6).name == "bfloat16"
    else:  # onnx < 1.18 maps bfloat16 to float32: refused rather than misread
        with pytest.raises(aioep.InvalidArgument, match="as float32"):
            output_dtype("tensor(bfloat16)", 3, 6)
    with pytest.raises(aioep.InvalidArgument, match="12 bytes for 4 element"):
        output_dtype("tensor(float)", 4, 12)
    for bad in ("tensor(int4)", "tensor(string)", "seq(tensor(float))"):
        with pytest.raises(aioep.InvalidArgument, match="aioep cannot hold"):
            output_dtype(bad, 2, 2)
