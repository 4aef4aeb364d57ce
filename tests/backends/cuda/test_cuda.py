"""The CUDA backend: option validation, the no-driver path, the GIL-free wake machinery and
DLPack/CUDA-array-interface export run everywhere. Tests marked ``gpu`` run against the real
NVIDIA driver where ``cuInit`` finds a GPU, and otherwise against the emulated driver in
``tests/cuda_emulator`` (a test double built with the system C compiler), with the same
assertions; they skip (with the reason) only where neither exists."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import numpy as np
import pytest
from _cuda_hold import WAIT_VALUE_GEQ, hold_cu, hold_stream
from cuda_emulator import Driver, select_driver

import aioep
from aioep import DeviceType, MemoryType

aioep_cuda = pytest.importorskip("aioep_cuda")

from aioep_cuda import CudaFactory, CudaOptions  # noqa: E402
from aioep_cuda._dlpack import DLManagedTensor, dlpack_dtype, live_exports  # noqa: E402
from aioep_cuda._wake import Dispatcher, Semaphore  # noqa: E402

pytestmark = pytest.mark.anyio

DRIVER = select_driver()
"""The driver the gpu tests use: the real one with a GPU, else the emulator (test double)."""
EMULATED = DRIVER.kind == "emulator"
NO_GPU = None if DRIVER.available else DRIVER.reason
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")
REAL_GPU = DRIVER.kind == "real"

_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


def emulated_devices(count: int) -> Callable[[_F], _F]:
    """How many devices the emulator offers to this test (default 1)."""

    def mark(fn: _F) -> _F:
        fn.emulated_devices = count  # type: ignore[attr-defined]
        return fn

    return mark


def loop_may_wait(fn: _F) -> _F:
    """The test exercises a documented path where the caller's thread waits in the driver."""
    fn.loop_may_wait = True  # type: ignore[attr-defined]
    return fn


# -- options (no GPU needed) ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"bogus": 1}, "unknown option"),
        ({"allocator": "arena"}, "'allocator' must be one of"),
        ({"allocator": 1}, "'allocator' must be one of"),
        ({"wake": "spin"}, "'wake' must be one of"),
        ({"pool_release_threshold": -5}, "pool_release_threshold"),
        ({"pool_release_threshold": "lots"}, "pool_release_threshold"),
        ({"pool_release_threshold": 1.5}, "pool_release_threshold"),
        ({"pool_release_threshold": True}, "pool_release_threshold"),
        ({"pinned_pool_limit": -2}, "pinned_pool_limit"),
        ({"pinned_pool_limit": "big"}, "pinned_pool_limit"),
    ],
)
def test_bad_options_are_invalid_argument(options: dict[str, Any], fragment: str) -> None:
    with pytest.raises(aioep.InvalidArgument, match=fragment):
        CudaFactory(options)


def test_good_options_parse() -> None:
    opts = CudaOptions.from_options(
        {
            "allocator": "sync",
            "wake": "poll",
            "pool_release_threshold": "1024",
            "pinned_pool_limit": "0x100000",
        }
    )
    assert opts == CudaOptions(
        allocator="sync", wake="poll", pool_release_threshold=1024, pinned_pool_limit=1 << 20
    )
    assert CudaOptions.from_options(None) == CudaOptions()


async def test_bad_option_through_environment_is_recorded() -> None:
    with pytest.warns(RuntimeWarning, match="cuda"):
        async with aioep.Environment(
            backends=["cuda"], backend_options={"cuda": {"allocator": "nope"}}
        ) as env:
            assert "allocator" in env.load_errors["cuda"]


# -- no driver / no device -------------------------------------------------------------------
@pytest.mark.skipif(REAL_GPU, reason="a GPU is present: the no-driver path is not taken")
def test_factory_without_driver_offers_nothing() -> None:
    factory = CudaFactory()
    assert factory.get_supported_devices([]) == []
    assert factory.unavailable_reason
    assert factory.create_data_transfer() is None
    assert not factory.is_stream_aware()
    factory.close()
    factory.close()


@pytest.mark.skipif(REAL_GPU, reason="a GPU is present: the no-driver path is not taken")
async def test_environment_records_why_without_warning() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        async with aioep.Environment(backends=["cuda"]) as env:
            assert "cuda" in env.libraries
            assert env.ep_devices(ep_name="CUDAExecutionProvider") == []
            assert env.ep_devices(device_type=DeviceType.GPU) == []
            reason = env.load_errors["cuda"]
            assert "CUDA" in reason or "cuInit" in reason
            env.unregister_library("cuda")


def test_entry_point_is_registered() -> None:
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="aioep.backends")}
    assert eps.get("cuda") == "aioep_cuda:CudaFactory"


# -- the GIL-free wake machinery (no GPU needed) ---------------------------------------------
_pylibc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during its calls
_pylibc.pthread_create.argtypes = [
    ctypes.POINTER(ctypes.c_ulong),
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
]
_pylibc.pthread_join.argtypes = [ctypes.c_ulong, ctypes.c_void_p]


def _post_from_native_thread(sem: Semaphore, *, hold_gil: bool = True) -> None:
    """Run ``sem_post(&sem)`` on a thread Python does not know, the way the CUDA driver runs a
    host function, and join it while this thread keeps the GIL: if posting needed the GIL this
    would deadlock."""
    tid = ctypes.c_ulong()
    assert _pylibc.pthread_create(ctypes.byref(tid), None, sem.post_address, sem.address) == 0
    join = _pylibc.pthread_join if hold_gil else ctypes.CDLL(None).pthread_join
    assert join(tid, None) == 0


def test_sem_post_runs_on_a_native_thread_without_the_gil() -> None:
    sem = Semaphore()
    assert sem.value == 0
    _post_from_native_thread(sem)
    _post_from_native_thread(sem)
    assert sem.value == 2
    assert sem.wait(0.0)
    assert sem.drain() == 1
    assert not sem.wait(0.001)


class _Flag:
    """A fake notification: done once ``set``; ``check`` calls back like CudaNotification."""

    def __init__(self) -> None:
        self.done = False
        self.fired = threading.Event()
        self.checked = threading.Event()

    def check(self) -> bool:
        if self.done:
            self.fired.set()
        self.checked.set()
        return self.done


def test_dispatcher_wakes_on_a_native_post() -> None:
    dispatcher = Dispatcher(idle_bound=30.0)  # no re-poll within the test: only the post wakes
    try:
        flag = _Flag()
        dispatcher.watch_ordered("stream-a", flag.check)
        flag.done = True
        t0 = time.perf_counter()
        _post_from_native_thread(dispatcher.semaphore)
        assert flag.fired.wait(5)
        assert time.perf_counter() - t0 < 1.0
        assert dispatcher.posts >= 1
    finally:
        dispatcher.close()


def test_dispatcher_pops_in_stream_order_and_skips_nothing() -> None:
    dispatcher = Dispatcher(idle_bound=30.0)
    try:
        flags = [_Flag() for _ in range(5)]
        for f in flags:
            dispatcher.watch_ordered("s", f.check)
        for f in flags[:3]:
            f.done = True
        dispatcher.semaphore.post()
        assert all(f.fired.wait(5) for f in flags[:3])
        # flags[3] is checked only after flags[2] was popped: then the count is settled.
        assert flags[3].checked.wait(5)
        assert not flags[3].fired.is_set()
        assert dispatcher.pending() == 2
        for f in flags[3:]:
            f.done = True
        dispatcher.semaphore.post()
        assert all(f.fired.wait(5) for f in flags[3:])
    finally:
        dispatcher.close()


def test_dispatcher_polls_without_any_post() -> None:
    dispatcher = Dispatcher()
    try:
        flag = _Flag()
        dispatcher.watch_polled(flag.check)
        timer = threading.Timer(0.02, lambda: setattr(flag, "done", True))
        timer.start()
        assert flag.fired.wait(5)
        timer.join()
    finally:
        dispatcher.close()


def test_dispatcher_bounds_a_lost_post() -> None:
    dispatcher = Dispatcher(idle_bound=0.01)
    try:
        flag = _Flag()
        dispatcher.watch_ordered("s", flag.check)
        flag.done = True  # and no post ever comes
        assert flag.fired.wait(5)
    finally:
        dispatcher.close()


def test_dispatcher_thousand_waiters_one_thread() -> None:
    dispatcher = Dispatcher(idle_bound=30.0)
    # Compare thread sets, not counts: idle worker threads of earlier tests may exit meanwhile.
    before = set(threading.enumerate())
    try:
        flags = [_Flag() for _ in range(1000)]
        for i, f in enumerate(flags):
            dispatcher.watch_ordered(i % 8, f.check)
        assert set(threading.enumerate()) - before == {dispatcher.thread}
        for f in flags:
            f.done = True
        for _ in range(8):
            _post_from_native_thread(dispatcher.semaphore, hold_gil=False)
        assert all(f.fired.wait(5) for f in flags)
        assert set(threading.enumerate()) - before == {dispatcher.thread}
    finally:
        dispatcher.close()  # joins the thread: every pop has happened
    assert dispatcher.pending() == 0
    assert dispatcher.thread is not None
    assert not dispatcher.thread.is_alive()


# -- DLPack and the CUDA array interface on a stand-in tensor (no GPU needed) ---------------
def _fake_cuda_tensor(array: np.ndarray[Any, Any]) -> aioep.Tensor:
    info = aioep.MemoryInfo(
        "Cuda", aioep.MemoryDevice(DeviceType.GPU, MemoryType.DEFAULT, 0x10DE, 1), 256
    )
    buffer = aioep.Buffer(array.ctypes.data, array.nbytes, info, owner=array)
    return aioep.Tensor(buffer, array.shape, array.dtype)


def test_cuda_array_interface_fields() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = _fake_cuda_tensor(array)
    cai = t.__cuda_array_interface__
    assert cai["version"] == 3
    assert cai["shape"] == (3, 4)
    assert cai["typestr"] == "<f4"
    assert cai["data"] == (array.ctypes.data, False)
    assert cai["strides"] is None
    assert cai["stream"] is None
    assert not hasattr(aioep.Tensor.from_numpy(array), "__cuda_array_interface__")


def test_dlpack_capsule_layout_and_release() -> None:
    array = np.arange(6, dtype=np.int16).reshape(2, 3)
    t = _fake_cuda_tensor(array)
    assert t.__dlpack_device__() == (2, 1)
    base = live_exports()
    capsule = t.__dlpack__()
    assert live_exports() == base + 1
    get = ctypes.pythonapi["PyCapsule_GetPointer"]
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    managed = DLManagedTensor.from_address(get(capsule, b"dltensor"))
    dl = managed.dl_tensor
    assert dl.data == array.ctypes.data
    assert (dl.device.device_type, dl.device.device_id) == (2, 1)
    assert dl.ndim == 2
    assert (dl.dtype.code, dl.dtype.bits, dl.dtype.lanes) == (0, 16, 1)
    assert [dl.shape[i] for i in range(2)] == [2, 3]
    # NULL strides mean C-contiguous in the legacy ABI (numpy 2.2 writes NULL there, 2.3
    # writes the element strides): either way the layout is row-major.
    assert not dl.strides or [dl.strides[i] for i in range(2)] == [3, 1]
    # A consumer calls the deleter when done with the memory:
    managed.deleter(ctypes.pointer(managed))
    assert live_exports() == base
    # An unconsumed capsule releases the tensor when it dies.
    capsule2 = t.__dlpack__()
    assert live_exports() == base + 1
    del capsule2
    gc.collect()
    assert live_exports() == base


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [("float32", (2, 32, 1)), ("uint8", (1, 8, 1)), ("bool", (6, 8, 1)), ("complex64", (5, 64, 1))],
)
def test_dlpack_dtype(dtype: str, expected: tuple[int, int, int]) -> None:
    assert dlpack_dtype(np.dtype(dtype)) == expected


def test_dlpack_dtype_rejects_unsupported() -> None:
    with pytest.raises(BufferError):
        dlpack_dtype(np.dtype("datetime64[s]"))
    with pytest.raises(BufferError):
        dlpack_dtype(np.dtype(">f4"))


# -- on a GPU --------------------------------------------------------------------------------
@pytest.fixture
async def env(cuda_driver: Driver) -> AsyncIterator[aioep.Environment]:
    async with aioep.Environment(backends=["cuda"]) as e:
        yield e


@pytest.fixture
def gpu(env: aioep.Environment) -> aioep.EpDevice:
    return env.ep_devices(ep_name="CUDAExecutionProvider")[0]


def _mem(gpu: aioep.EpDevice, kind: MemoryType = MemoryType.DEFAULT) -> aioep.MemoryInfo:
    info = gpu.memory_info(kind)
    assert info is not None
    return info


@pytest.mark.gpu
@needs_gpu
async def test_discovery(env: aioep.Environment) -> None:
    from aioep_cuda._driver import driver

    count = driver().cuDeviceGetCount()[1]
    devices = env.ep_devices(ep_name="CUDAExecutionProvider")
    assert len(devices) == count
    assert "cuda" not in env.load_errors
    for i, d in enumerate(devices):
        assert d.hardware.type is DeviceType.GPU
        assert d.hardware.vendor_id == 0x10DE
        assert d.hardware.device_id == i
        meta = d.hardware.metadata
        assert meta["name"]
        assert meta["uuid"].startswith("GPU-")
        assert ":" in meta["pci_bus_id"]
        assert _mem(d).name == "Cuda"
        assert _mem(d, MemoryType.HOST_ACCESSIBLE).name == "CudaPinned"


@pytest.mark.gpu
@needs_gpu
async def test_pinned_view_outlives_an_explicit_free(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    pinned = env.empty((1 << 16,), "uint8", _mem(gpu, MemoryType.HOST_ACCESSIBLE))
    view = pinned.numpy()
    view[...] = 7
    pinned.buffer.free()
    del pinned
    gc.collect()
    # The view still owns the cuMemHostAlloc block: using it after the free is safe.
    view[...] = 9
    assert (view == 9).all()


@pytest.mark.gpu
@needs_gpu
async def test_alloc_and_oom_message(env: aioep.Environment, gpu: aioep.EpDevice) -> None:
    t = env.empty((1024,), "float32", _mem(gpu))
    assert t.data_ptr
    assert t.nbytes == 4096
    total = int(gpu.hardware.metadata["total_memory"])
    allocator = env.get_shared_allocator(_mem(gpu))
    assert allocator is not None
    with pytest.raises(aioep.DeviceError, match=r"of \d+ bytes failed .* bytes free of \d+") as e:
        allocator.alloc(total * 4)
    assert str(total * 4) in str(e.value)
    del t


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("allocator", ["async", "sync"])
@pytest.mark.parametrize("use_stream", [True, False])
@pytest.mark.parametrize("host", ["pageable", "pinned"])
async def test_h2d_d2h_d2d_bit_exact(allocator: str, use_stream: bool, host: str) -> None:
    async with aioep.Environment(
        backends=["cuda"], backend_options={"cuda": {"allocator": allocator}}
    ) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        rng = np.random.default_rng(0)
        data = rng.integers(0, 2**32, size=(3, 1 << 18), dtype=np.uint32)  # 3 MiB
        if host == "pinned":
            src = env.empty(data.shape, data.dtype, _mem(gpu, MemoryType.HOST_ACCESSIBLE))
            out = env.empty(data.shape, data.dtype, _mem(gpu, MemoryType.HOST_ACCESSIBLE))
            src.numpy()[...] = data
        else:
            src, out = aioep.Tensor.from_numpy(data), aioep.Tensor.from_numpy(np.zeros_like(data))
        async with env.create_sync_stream(gpu) as stream:
            s = stream if use_stream else None
            a = env.empty(data.shape, data.dtype, _mem(gpu), stream=s)
            b = env.empty(data.shape, data.dtype, _mem(gpu), stream=s)
            await env.copy_tensors([src], [a], stream=s)
            await env.copy_tensors([a], [b], stream=s)
            await env.copy_tensors([b], [out], stream=s)
            np.testing.assert_array_equal(out.numpy(), data)
            del a, b
        del src, out  # pinned buffers must not outlive the environment (a ResourceWarning)


@pytest.mark.gpu
@needs_gpu
async def test_batched_mixed_copy_on_one_stream(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    arrays = [np.full(n, i, dtype=np.float64) for i, n in enumerate((1, 1000, 1 << 20))]
    devs = [env.empty(a.shape, a.dtype, _mem(gpu)) for a in arrays]
    outs = [np.empty_like(a) for a in arrays]
    async with env.create_sync_stream(gpu) as stream:
        future = env.copy_tensors(arrays, devs, stream=stream)
        future2 = env.copy_tensors(devs, outs, stream=stream)
        await future2
        assert future.done()
    for a, o in zip(arrays, outs):
        np.testing.assert_array_equal(a, o)


@pytest.mark.gpu
@needs_gpu
@emulated_devices(2)
async def test_peer_copy_when_two_gpus(env: aioep.Environment) -> None:
    devices = env.ep_devices(ep_name="CUDAExecutionProvider")
    if len(devices) < 2:
        pytest.skip("needs two GPUs")
    data = np.arange(1 << 20, dtype=np.int32)
    a = env.empty(data.shape, data.dtype, _mem(devices[0]))
    b = env.empty(data.shape, data.dtype, _mem(devices[1]))
    out = np.zeros_like(data)
    async with env.create_sync_stream(devices[0]) as stream:
        await env.copy_tensors([data], [a], stream=stream)
        await env.copy_tensors([a], [b], stream=stream)
    await env.copy_tensors([b], [out])
    np.testing.assert_array_equal(out, data)


@pytest.mark.gpu
@needs_gpu
async def test_events_order_work_across_streams(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    data = np.arange(1 << 22, dtype=np.float32)  # 16 MiB: the first copy takes a while
    a = env.empty(data.shape, data.dtype, _mem(gpu))
    out = np.zeros_like(data)
    async with env.create_sync_stream(gpu) as s1, env.create_sync_stream(gpu) as s2:
        assert s1.handle
        assert s2.handle
        assert s1.handle != s2.handle
        env.copy_tensors([data], [a], stream=s1)
        n = s1.record()
        s2.wait(n)  # device-side: s2's copy starts after s1's
        done = env.copy_tensors([a], [out], stream=s2)
        await done
        assert n.done()
    np.testing.assert_array_equal(out, data)


@pytest.mark.gpu
@needs_gpu
async def test_await_stream_and_notification(env: aioep.Environment, gpu: aioep.EpDevice) -> None:
    data = np.ones(1 << 20, dtype=np.uint8)
    a = env.empty(data.shape, data.dtype, _mem(gpu))
    async with env.create_sync_stream(gpu) as stream:
        await stream  # empty stream
        env.copy_tensors([data], [a], stream=stream)
        await stream
        assert stream.done()
        n = stream.record()
        await n
        n.wait(timeout=5)
        assert n.done()
        assert n.exception() is None


@pytest.mark.gpu
@needs_gpu
async def test_poll_mode_wakes_too() -> None:
    async with aioep.Environment(
        backends=["cuda"], backend_options={"cuda": {"wake": "poll"}}
    ) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        data = np.arange(1000, dtype=np.int64)
        a = env.empty(data.shape, data.dtype, _mem(gpu))
        out = np.zeros_like(data)
        async with env.create_sync_stream(gpu) as stream:
            await env.copy_tensors([data], [a], stream=stream)
            await env.copy_tensors([a], [out], stream=stream)
        np.testing.assert_array_equal(out, data)
        del a  # must not outlive the environment (a ResourceWarning)


@pytest.mark.gpu
@needs_gpu
async def test_thousand_awaiters_on_eight_streams_constant_threads(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    import anyio

    streams = [env.create_sync_stream(gpu) for _ in range(8)]
    data = np.ones(1 << 16, dtype=np.uint8)
    bufs = [env.empty(data.shape, data.dtype, _mem(gpu)) for _ in streams]
    # Warm up: start the dispatcher and the core's helpers before counting threads.
    for s, b in zip(streams, bufs):
        await env.copy_tensors([data], [b], stream=s)
    # Compare thread sets, not counts: idle worker threads of earlier tests may exit meanwhile.
    before = set(threading.enumerate())
    new_threads: set[threading.Thread] = set()

    async def waiter(i: int) -> None:
        s = streams[i % 8]
        env.copy_tensors([data], [bufs[i % 8]], stream=s)
        await s
        new_threads.update(set(threading.enumerate()) - before)

    async with anyio.create_task_group() as tg:
        for i in range(1000):
            tg.start_soon(waiter, i)
    assert new_threads == set()
    for s in streams:
        await s.aclose()


@pytest.mark.gpu
@needs_gpu
async def test_interop_cupy_or_torch(env: aioep.Environment, gpu: aioep.EpDevice) -> None:
    """CuPy and PyTorch work on an aioep stream and read an aioep tensor without a copy.

    CuPy 14 deprecates ``cupy.cuda.ExternalStream`` (a DeprecationWarning at every call) for
    ``cupy.cuda.Stream.from_external(obj)``, which takes an object with ``__cuda_stream__``
    (the CUDA stream protocol) and the device that is current; older CuPy takes
    ``ExternalStream(ptr, device_id)``. PyTorch offers ``get_stream_from_external(ptr,
    device)``. No warning is silenced: each library is called the way it asks to be.
    """
    if EMULATED:
        pytest.skip(
            "CuPy and PyTorch need the real driver (their runtime does not run on the emulator)"
        )
    try:
        import cupy  # type: ignore[import-not-found]
    except ImportError:
        cupy = None
    try:
        import torch  # type: ignore[import-not-found]
    except ImportError:
        torch = None
    use_torch = torch is not None and torch.cuda.is_available()
    if cupy is None and not use_torch:
        pytest.skip("neither CuPy nor PyTorch (with CUDA) is installed")
    device_id = _mem(gpu).device.device_id
    data = np.arange(4096, dtype=np.float32)
    out = np.zeros_like(data)
    async with env.create_sync_stream(gpu) as stream:
        t = env.empty(data.shape, data.dtype, _mem(gpu), stream=stream)
        await env.copy_tensors([data], [t], stream=stream)
        cai = t.__cuda_array_interface__
        assert cai["data"][0] == t.data_ptr
        assert cai["stream"] == stream.handle
        if cupy is not None:
            with cupy.cuda.Device(device_id):
                if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14

                    class _Protocol:
                        def __cuda_stream__(self) -> tuple[int, int]:
                            return (0, stream.handle)

                    cupy_stream = cupy.cuda.Stream.from_external(_Protocol())
                else:
                    cupy_stream = cupy.cuda.ExternalStream(stream.handle, device_id)
                assert cupy_stream.ptr == stream.handle
                with cupy_stream:
                    c = cupy.asarray(t)  # zero-copy through __cuda_array_interface__
                    assert c.data.ptr == t.data_ptr
                    c *= 2  # enqueued on our stream
                    d = cupy.from_dlpack(t)
                    assert d.data.ptr == t.data_ptr
                del c, d, cupy_stream
        if use_torch:
            assert torch is not None
            if hasattr(torch.cuda, "get_stream_from_external"):
                torch_stream = torch.cuda.get_stream_from_external(stream.handle, device_id)
            else:
                torch_stream = torch.cuda.ExternalStream(stream.handle, device=device_id)
            with torch.cuda.stream(torch_stream):
                x = torch.from_dlpack(t)
                assert x.data_ptr() == t.data_ptr
                x += 1  # enqueued on our stream
            del x, torch_stream
        await env.copy_tensors([t], [out], stream=stream)  # after their work, in stream order
        del t  # no view or tensor outlives the environment
    expected = data * 2 if cupy is not None else data.copy()
    if use_torch:
        expected = expected + 1
    np.testing.assert_array_equal(out, expected)


@pytest.mark.gpu
@needs_gpu
async def test_unregister_refused_while_buffers_alive(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    t = env.empty((256,), "float32", _mem(gpu))
    with pytest.raises(aioep.InUseError, match="live buffer"):
        env.unregister_library("cuda")
    del t
    gc.collect()
    env.unregister_library("cuda")
    assert env.ep_devices(ep_name="CUDAExecutionProvider") == []


# -- what needed a GPU to verify: ordering under load, the pageable gate, GIL-free wake-ups ---
def _emulator_stat(key: str) -> int:
    return DRIVER.emulator.get(key) if DRIVER.emulator is not None else 0


@pytest.mark.gpu
@needs_gpu
async def test_cross_stream_ordering_under_load(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    """A three-stage pipeline (upload, on-device copy, download) on three streams ordered only by
    events, with double-buffered device memory (so write-after-read hazards need waits too),
    while two more streams keep copies in flight: every round's data comes back intact."""
    import anyio

    if DRIVER.emulator is not None:
        DRIVER.emulator.set("bandwidth", 2 << 30)  # copies take time: the stages overlap
        DRIVER.emulator.set("latency_ns", 200_000)
    rounds, n = 12, 1 << 16
    rng = np.random.default_rng(1)
    pinned = _mem(gpu, MemoryType.HOST_ACCESSIBLE)
    ins = [env.empty((n,), "uint32", pinned) for _ in range(rounds)]
    outs = [env.empty((n,), "uint32", pinned) for _ in range(rounds)]
    expected = [rng.integers(0, 2**32, size=n, dtype=np.uint32) for _ in range(rounds)]
    for t, e in zip(ins, expected):
        t.numpy()[...] = e
    a = [env.empty((n,), "uint32", _mem(gpu)) for _ in range(2)]
    b = [env.empty((n,), "uint32", _mem(gpu)) for _ in range(2)]
    load_host = np.ones(1 << 20, dtype=np.uint8)
    load_bufs = [
        [env.empty(load_host.shape, load_host.dtype, _mem(gpu)) for _ in range(2)] for _ in range(2)
    ]
    stop = anyio.Event()

    async with (
        env.create_sync_stream(gpu) as up,
        env.create_sync_stream(gpu) as mid,
        env.create_sync_stream(gpu) as down,
        env.create_sync_stream(gpu) as busy1,
        env.create_sync_stream(gpu) as busy2,
    ):

        async def load(stream: aioep.SyncStream, bufs: list[aioep.Tensor]) -> None:
            while not stop.is_set():
                env.copy_tensors([load_host], [bufs[0]], stream=stream)
                await env.copy_tensors([bufs[0]], [bufs[1]], stream=stream)

        async with anyio.create_task_group() as tg:
            tg.start_soon(load, busy1, load_bufs[0])
            tg.start_soon(load, busy2, load_bufs[1])
            read_a: list[aioep.Notification | None] = [None, None]
            read_b: list[aioep.Notification | None] = [None, None]
            last = None
            for r in range(rounds):
                k = r % 2
                if read_a[k] is not None:
                    up.wait(read_a[k])  # a[k] is read by mid two rounds ago: wait before writing
                env.copy_tensors([ins[r]], [a[k]], stream=up)
                mid.wait(up.record())
                if read_b[k] is not None:
                    mid.wait(read_b[k])
                env.copy_tensors([a[k]], [b[k]], stream=mid)
                read_a[k] = mid.record()
                down.wait(read_a[k])
                last = env.copy_tensors([b[k]], [outs[r]], stream=down)
                read_b[k] = down.record()
            assert last is not None
            with anyio.fail_after(30):
                await last
            stop.set()
    for r in range(rounds):
        np.testing.assert_array_equal(outs[r].numpy(), expected[r], err_msg=f"round {r}")


@pytest.mark.gpu
@needs_gpu
async def test_streams_without_a_wait_are_not_ordered(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    """The control for the test above: without a wait, a stream reads memory another stream has
    not written yet (the writer is held back here), so the ordering test would catch a
    missing wait."""
    n = 1 << 12
    src = env.empty((n,), "uint32", _mem(gpu, MemoryType.HOST_ACCESSIBLE))
    src.numpy()[...] = 7
    out = env.empty((n,), "uint32", _mem(gpu, MemoryType.HOST_ACCESSIBLE))
    out.numpy()[...] = 0
    a = env.empty((n,), "uint32", _mem(gpu))
    async with env.create_sync_stream(gpu) as s1, env.create_sync_stream(gpu) as s2:
        await env.copy_tensors([out], [a], stream=s2)  # a = 0
        with hold_stream(s1) as release:
            first = env.copy_tensors([src], [a], stream=s1)  # held back on s1...
            await env.copy_tensors([a], [out], stream=s2)  # ...while s2 reads a: no wait
            release()
            await first
    assert (out.numpy() == 0).all()


@pytest.mark.gpu
@needs_gpu
async def test_pageable_copies_on_a_held_stream_never_block_the_loop(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    """Pageable host memory on a stream goes through the gate: ``copy_tensors`` returns at once
    even while the stream is held back on the device, the copies land in stream order once it
    moves, and the event-loop thread never issues a (synchronous) pageable copy itself."""
    import anyio

    n = 3 << 20  # 12 MiB: past the driver's staging, a pageable copy waits for its stream
    data = np.arange(n, dtype=np.uint32)
    upload = data * 3  # pageable
    out = np.zeros_like(data)  # pageable
    pinned = env.empty(data.shape, data.dtype, _mem(gpu, MemoryType.HOST_ACCESSIBLE))
    pinned.numpy()[...] = data
    dev = env.empty(data.shape, data.dtype, _mem(gpu))
    dev2 = env.empty(data.shape, data.dtype, _mem(gpu))
    back = np.zeros_like(data)
    async with env.create_sync_stream(gpu) as stream:
        with hold_stream(stream) as release:
            watched = _emulator_stat("watched_pageable"), _emulator_stat("watched_blocking")
            env.copy_tensors([pinned], [dev], stream=stream)
            up = env.copy_tensors([upload], [dev2], stream=stream)
            down = env.copy_tensors([dev], [out], stream=stream)  # returned: the loop goes on
            assert (_emulator_stat("watched_pageable"), _emulator_stat("watched_blocking")) == (
                watched
            )
            assert not down.done()
            assert not up.done()
            assert not out.any()  # nothing ran past the held point
            release()
            with anyio.fail_after(20):
                await up
                await down
        np.testing.assert_array_equal(out, data)
        await env.copy_tensors([dev2], [back], stream=stream)
    np.testing.assert_array_equal(back, upload)


@pytest.mark.gpu
@needs_gpu
async def test_closing_a_stream_while_a_gate_release_is_pending(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    """The backend stream is closed while its pageable copy waits for its gate: the copy still
    runs and completes, and the gate word is not handed to another stream (which would reset it
    under the closed stream's wait, or be released by the closed stream's late write) until the
    closed stream is past it."""
    import anyio

    n = 1 << 16
    data = np.arange(n, dtype=np.uint32)
    out = np.zeros_like(data)
    dev = env.empty(data.shape, data.dtype, _mem(gpu))
    dev2 = env.empty(data.shape, data.dtype, _mem(gpu))
    stream = env.create_sync_stream(gpu)
    impl = stream.impl
    with hold_stream(stream) as release:
        up = env.copy_tensors([data], [dev], stream=stream)  # pageable: gated
        down = env.copy_tensors([dev], [out], stream=stream)  # pageable: gated
        slot = impl.gate_addr
        assert slot is not None
        impl.close()  # the backend object goes now; its work is still held on the device
        async with env.create_sync_stream(gpu) as other:
            await env.copy_tensors([data + 1], [dev2], stream=other)  # takes a gate word
            assert other.impl.gate_addr is not None
            assert other.impl.gate_addr != slot
        release()
        with anyio.fail_after(20):
            await up
            await down
    np.testing.assert_array_equal(out, data)
    assert await anyio.to_thread.run_sync(impl.gate_released.wait, 10)
    assert impl.device.gate_slot_is_free(slot)
    await stream.aclose()


@pytest.mark.gpu
@needs_gpu
async def test_wake_comes_from_the_driver_thread_without_the_gil(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    """While this thread holds the GIL (blocked in a C call made through ``ctypes.PyDLL``), the
    driver's callback thread runs the dispatcher's ``sem_post`` host function and then the
    test's own: if either needed the GIL, the wait below would time out."""
    import sys

    from aioep_cuda._driver import ctx_current, launch_host_func
    from aioep_cuda._wake import _Timespec

    word = env.empty((1,), "uint32", _mem(gpu, MemoryType.HOST_ACCESSIBLE))  # mapped pinned
    word.numpy()[0] = 0
    data = env.empty((1 << 16,), "uint8", _mem(gpu, MemoryType.HOST_ACCESSIBLE))
    data.numpy()[...] = 1  # pinned: a pageable copy would need the (Python) dispatcher first
    dev = env.empty(data.shape, data.dtype, _mem(gpu))
    test_sem = Semaphore()
    fired = threading.Event()
    pylibc = ctypes.PyDLL(None)  # its calls keep the GIL
    pylibc.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
    pylibc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    async with env.create_sync_stream(gpu) as stream:
        impl = stream.impl
        from aioep_cuda._driver import check, driver

        drv = driver()
        with impl.lock, ctx_current(impl.device.ctx):
            err = drv.cuStreamWaitValue32(impl.cu, word.data_ptr, 1, WAIT_VALUE_GEQ)[0]
            if err == drv.CUresult.CUDA_ERROR_NOT_SUPPORTED:
                pytest.skip("this driver has no stream memory operations")
            check(err, "cuStreamWaitValue32")
            impl.enqueued()
        env.copy_tensors([data], [dev], stream=stream)
        mark = stream.record()
        assert mark.impl.add_done_callback(fired.set)  # arms: the dispatcher's sem_post
        with ctx_current(impl.device.ctx):
            assert launch_host_func(stream.handle, Semaphore.post_address, test_sem.address) == 0
        interval = sys.getswitchinterval()
        sys.setswitchinterval(30.0)  # no hand-over of the GIL to another Python thread
        try:
            pylibc.memset(word.data_ptr, 1, 1)  # lets the stream go (the device polls the word)
            deadline = time.time() + 10
            ts = _Timespec(int(deadline), int((deadline % 1.0) * 1e9))
            posted = pylibc.sem_timedwait(test_sem.address, ctypes.byref(ts))
        finally:
            sys.setswitchinterval(interval)
        assert posted == 0, "the host functions did not run while this thread held the GIL"
        # Host functions run in stream order: the dispatcher's sem_post ran before ours.
        await mark
        assert await anyio_to_thread(fired.wait, 10)
        assert impl.hostfn_failures == 0


async def anyio_to_thread(fn: Callable[..., _T], *args: Any) -> _T:
    import anyio.to_thread

    return await anyio.to_thread.run_sync(fn, *args)


@pytest.mark.gpu
@needs_gpu
async def test_host_memory_pinned_by_someone_else_is_copied_asynchronously(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    """Memory registered with ``cuMemHostRegister`` (as CuPy or PyTorch pin it) is found by
    ``cuPointerGetAttribute`` and copied like pinned memory: no gate, no pageable copy."""
    from aioep_cuda._driver import check, ctx_current, driver

    drv = driver()
    page = 4096
    raw = np.zeros(9 * page, dtype=np.uint8)
    start = (-raw.ctypes.data) % page
    region = raw[start : start + 8 * page].view(np.uint32)  # page-aligned, registered below
    host, out = region[: region.size // 2], region[region.size // 2 :]
    host[...] = np.arange(host.size, dtype=np.uint32)
    async with env.create_sync_stream(gpu) as stream:
        ctx = stream.impl.device.ctx
        cu = stream.impl.cu

        def register() -> None:
            with ctx_current(ctx):
                check(drv.cuMemHostRegister(region.ctypes.data, region.nbytes, 0), "register")

        def unregister() -> None:  # synchronises the device: never on the event loop
            with ctx_current(ctx):
                # ``await stream`` may return (the dispatcher polled the event) before the
                # wake-up host function enqueued after that event has run: work still in
                # flight, which a synchronising call waits for (and the strict emulator,
                # with the loop thread marked, refuses). Wait for the stream to be idle.
                deadline = time.monotonic() + 20
                while drv.cuStreamQuery(cu)[0] == drv.CUresult.CUDA_ERROR_NOT_READY:
                    assert time.monotonic() < deadline, "the stream never became idle"
                    time.sleep(0.0005)
                check(drv.cuMemHostUnregister(region.ctypes.data), "cuMemHostUnregister")

        await anyio_to_thread(register)
        try:
            dev = env.empty(host.shape, host.dtype, _mem(gpu), stream=stream)
            pageable = _emulator_stat("pageable_copies")
            await env.copy_tensors([host], [dev], stream=stream)
            await env.copy_tensors([dev], [out], stream=stream)
            assert stream.impl.gate_addr is None  # the gate was never needed
            assert _emulator_stat("pageable_copies") == pageable
            del dev
        finally:
            await stream  # nothing in flight: the unregistration synchronises the context
            await anyio_to_thread(unregister)
    np.testing.assert_array_equal(out, host)


# -- failure paths the emulator can inject (no GPU can be told to fail on cue) -----------------
needs_emulator = pytest.mark.skipif(not EMULATED, reason="fault injection needs the emulator")


@pytest.mark.gpu
@needs_gpu
@needs_emulator
async def test_failed_host_function_launch_falls_back_to_polling(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    assert DRIVER.emulator is not None
    DRIVER.emulator.fail_call("cuLaunchHostFunc", times=-1)
    data = np.arange(1 << 12, dtype=np.int32)
    out = np.zeros_like(data)
    dev = env.empty(data.shape, data.dtype, _mem(gpu))
    async with env.create_sync_stream(gpu) as stream:
        await env.copy_tensors([data], [dev], stream=stream)
        await env.copy_tensors([dev], [out], stream=stream)
        await stream
        assert stream.impl.hostfn_failures >= 1
    np.testing.assert_array_equal(out, data)
    del dev


@pytest.mark.gpu
@needs_gpu
@needs_emulator
@loop_may_wait  # the documented fallback: the caller's thread issues the pageable copies
async def test_without_stream_memory_operations_pageable_copies_still_arrive(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    assert DRIVER.emulator is not None
    DRIVER.emulator.set("stream_mem_ops", 0)
    data = np.arange(1 << 14, dtype=np.int64)
    out = np.zeros_like(data)
    dev = env.empty(data.shape, data.dtype, _mem(gpu))
    waits = DRIVER.emulator.get("wait_values")
    async with env.create_sync_stream(gpu) as stream:
        await env.copy_tensors([data], [dev], stream=stream)
        await env.copy_tensors([dev], [out], stream=stream)
    assert DRIVER.emulator.get("wait_values") == waits  # no gate: copied by the caller
    np.testing.assert_array_equal(out, data)
    del dev


@pytest.mark.gpu
@needs_gpu
@needs_emulator
async def test_a_device_fault_fails_the_copy_and_the_environment_still_closes(
    gpu: aioep.EpDevice, env: aioep.Environment
) -> None:
    import anyio

    assert DRIVER.emulator is not None
    data = np.arange(1 << 12, dtype=np.int32)
    dev = env.empty(data.shape, data.dtype, _mem(gpu))
    async with env.create_sync_stream(gpu) as stream:
        await env.copy_tensors([data], [dev], stream=stream)
        DRIVER.emulator.set("lose_after_copies", DRIVER.emulator.get("copies"))
        with anyio.fail_after(20), pytest.raises(aioep.DeviceError, match="ILLEGAL_ADDRESS"):
            await env.copy_tensors([dev], [np.zeros_like(data)], stream=stream)
    del dev


@pytest.mark.gpu
@needs_gpu
@needs_emulator
async def test_out_of_memory_from_the_stream_ordered_allocator(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    assert DRIVER.emulator is not None
    DRIVER.emulator.fail_call("cuMemAllocAsync", code=2)  # CUDA_ERROR_OUT_OF_MEMORY, once
    async with env.create_sync_stream(gpu) as stream:
        with pytest.raises(
            aioep.DeviceError,
            match=r"cuMemAllocAsync of 4096 bytes failed .*"
            r"OUT_OF_MEMORY; \d+ bytes free of \d+",
        ):
            env.empty((1024,), "float32", _mem(gpu), stream=stream)
        t = env.empty((1024,), "float32", _mem(gpu), stream=stream)  # the next one works
        assert t.data_ptr
        del t


# -- frees that synchronise the device never run where work waits on them ----------------------
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["pinned", "sync-device"])
async def test_dropping_a_buffer_while_work_is_held_does_not_wait_for_the_device(
    kind: str, cuda_driver: Driver
) -> None:
    """``cuMemFreeHost`` and ``cuMemFree`` synchronise the device. Dropping a buffer on the event
    loop while a stream is held back must not run them (nor anything else that waits): the
    loop would stall for as long as the device is busy (here: forever, since only the loop
    releases the stream). The block goes back to its pool instead, still held from the driver;
    the marked loop thread of the strict emulator aborts on any wait."""
    import anyio

    async with aioep.Environment(
        backends=["cuda"], backend_options={"cuda": {"allocator": "sync"}}
    ) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        info = _mem(gpu, MemoryType.HOST_ACCESSIBLE if kind == "pinned" else MemoryType.DEFAULT)
        allocator = env.get_shared_allocator(info)
        assert allocator is not None
        shared = allocator.device.shared
        pool = shared.pinned if kind == "pinned" else shared.device_cache
        async with env.create_sync_stream(gpu) as stream:
            with hold_stream(stream) as release:
                in_use, held = pool.in_use_bytes, pool.held_bytes
                doomed = env.empty((1 << 16,), "uint8", info)
                assert pool.in_use_bytes > in_use
                del doomed
                gc.collect()
                assert pool.in_use_bytes == in_use  # back in the pool...
                assert pool.held_bytes >= held  # ...and not given back to the driver
                release()
            with anyio.fail_after(20):
                await stream


@pytest.mark.gpu
@needs_gpu
async def test_a_copy_completing_on_the_dispatcher_frees_nothing_there(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    """A fire-and-forget copy from a pinned temporary: its completion (on the dispatcher thread)
    drops the last reference to the pinned buffer. Freeing it there would make the dispatcher
    wait for the whole device, including a stream whose pageable copy needs the dispatcher to
    move on: a deadlock."""
    import anyio

    n = 1 << 14
    data = np.arange(n, dtype=np.uint32)  # pageable
    dev1 = env.empty(data.shape, data.dtype, _mem(gpu))
    dev2 = env.empty(data.shape, data.dtype, _mem(gpu))
    out = np.zeros_like(data)
    async with env.create_sync_stream(gpu) as s1, env.create_sync_stream(gpu) as s2:
        with hold_stream(s1) as release:
            gated = env.copy_tensors([data], [dev1], stream=s1)  # needs the dispatcher later
            tmp = env.empty(data.shape, data.dtype, _mem(gpu, MemoryType.HOST_ACCESSIBLE))
            tmp.numpy()[...] = data
            upload = env.copy_tensors([tmp], [dev2], stream=s2)
            del tmp  # the future holds the last reference now
            with anyio.fail_after(10):
                await upload
            release()
            with anyio.fail_after(10):
                await gated
        await env.copy_tensors([dev1], [out], stream=s1)
    np.testing.assert_array_equal(out, data)


@pytest.mark.gpu
@needs_gpu
async def test_the_arena_over_cuda_memory_keeps_stream_order(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    """The stream-aware arena over the CUDA allocator: a chunk freed on a stream that is still
    held back is not handed to another stream, and shrinking keeps the region it lives in, so
    the held stream's late copy cannot land in the other stream's buffer."""
    import anyio

    arena = env.create_shared_allocator(gpu, MemoryType.DEFAULT, aioep.AllocatorType.ARENA)
    n = 1 << 16
    first = np.full(n, 1, dtype=np.uint32)
    second = np.full(n, 2, dtype=np.uint32)
    out = np.zeros_like(second)
    async with env.create_sync_stream(gpu) as a, env.create_sync_stream(gpu) as b:
        with hold_stream(a) as release:
            x = arena.alloc(first.nbytes, stream=a)
            xt = aioep.Tensor(x, (n,), "uint32")
            pending = env.copy_tensors([first], [xt], stream=a)  # lands after the release
            del xt, x  # freed "on a" while a's copy is still queued
            y = aioep.Tensor(arena.alloc(second.nbytes, stream=b), (n,), "uint32")
            await env.copy_tensors([second], [y], stream=b)
            arena.shrink()  # must keep the region a may still write
            release()
            with anyio.fail_after(20):
                await pending
            await env.copy_tensors([y], [out], stream=b)
        np.testing.assert_array_equal(out, second)
        del y
    env.release_shared_allocator(gpu, MemoryType.DEFAULT)


@pytest.mark.gpu
@needs_gpu
@needs_emulator
async def test_a_stream_with_a_gate_closes_on_a_broken_context(
    gpu: aioep.EpDevice, env: aioep.Environment
) -> None:
    """Closing never raises, even when the context's sticky error makes every call fail (no
    event can be created to mark the gate word's last use: the word is simply given back)."""
    assert DRIVER.emulator is not None
    data = np.arange(1 << 12, dtype=np.int32)
    dev = env.empty(data.shape, data.dtype, _mem(gpu))
    stream = env.create_sync_stream(gpu)
    await env.copy_tensors([data], [dev], stream=stream)  # pageable: the stream has a gate
    impl = stream.impl
    assert impl.gate_addr is not None
    DRIVER.emulator.set("lose_after_copies", DRIVER.emulator.get("copies"))
    with pytest.raises(aioep.DeviceError):
        await env.copy_tensors([dev], [np.zeros_like(data)], stream=stream)
    DRIVER.emulator.fail_call("cuEventCreate", times=-1, code=700)
    # ... and the event pool has no idle event (the pool's events stay alive: the dispatcher
    # may still be asking about the ones in use; the final release destroys them all)
    with impl.device.events._lock:
        impl.device.events._free.clear()
    impl.close()
    assert impl.closed
    assert impl.gate_released.is_set()
    await stream.aclose()
    del dev  # the frame may outlive the test in the failure's traceback: drop the tensor


@pytest.mark.gpu
@needs_gpu
@needs_emulator
async def test_a_mark_that_cannot_be_recorded_fails_the_copy_once_its_staging_is_over(
    gpu: aioep.EpDevice, env: aioep.Environment
) -> None:
    """The copy's own mark (the event the core records after a gated pageable copy) fails to
    record: the batch is already with the stager, so copy_tensors must not raise there and
    then (its caller would drop memory the stager is about to read); the copy's future
    fails, keeps its tensors until the staged copy is over, and the copy ran."""
    import anyio

    assert DRIVER.emulator is not None
    data = np.arange(1 << 12, dtype=np.int32)
    dev = env.empty(data.shape, data.dtype, _mem(gpu))
    out = np.zeros_like(data)
    async with env.create_sync_stream(gpu) as stream:
        await env.copy_tensors([data], [dev], stream=stream)
        buffer = weakref.ref(dev.buffer)
        with hold_stream(stream) as release:  # nothing runs before the mark is recorded
            # The next records: the gate's prerequisite mark, then the copy's own mark.
            DRIVER.emulator.fail_call("cuEventRecord", after=1, code=700)
            future = env.copy_tensors([dev], [out], stream=stream)
            del dev
            gc.collect()
            assert buffer() is not None  # the future keeps the source
            release()
            with anyio.fail_after(20), pytest.raises(aioep.DeviceError, match="cuEventRecord"):
                await future
        assert np.array_equal(out, data)  # the staged download ran to its end
        del future
        gc.collect()
        assert buffer() is None


@pytest.mark.gpu
@needs_gpu
@needs_emulator
async def test_a_broken_context_fails_a_gated_copy_only_once_its_staging_is_over(
    gpu: aioep.EpDevice, env: aioep.Environment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a sticky error every event of the context reports it at once, the mark of a
    gated pageable copy too, while the stager may still be working on that copy (copying,
    enqueueing, recording its release mark). The copy's future completes only once the
    stager is done with it: its caller may then drop the memory or close the device."""
    import anyio

    from aioep_cuda import _pieces
    from aioep_cuda._driver import driver

    emulator = DRIVER.emulator
    assert emulator is not None
    drv = driver()
    n = 1 << 12
    pinned_a = env.empty((n,), np.int32, _mem(gpu, MemoryType.HOST_ACCESSIBLE))
    pinned_b = env.empty((n,), np.int32, _mem(gpu, MemoryType.HOST_ACCESSIBLE))
    pinned_b.numpy()[...] = np.arange(n, dtype=np.int32)
    dev = env.empty((n,), np.int32, _mem(gpu))
    out = np.zeros(n, np.int32)
    future: list[aioep.CopyFuture] = []
    seen: list[bool] = []
    real = _pieces.host_copy

    def until(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 20
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.001)

    def copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
        # The staged (pinned -> pageable) pair, on a stager thread, once the direct pair
        # before it on the stream has broken the context and the copy's mark reports it.
        mark = future[0].notification.impl
        assert isinstance(mark, aioep_cuda._stream.CudaNotification)
        until(lambda: bool(emulator.get("sticky")))
        until(lambda: drv.cuEventQuery(mark.event)[0] != drv.CUresult.CUDA_ERROR_NOT_READY)
        seen.append(future[0].notification.done())  # must still be pending: we are at work
        real(dst, src)

    monkeypatch.setattr(_pieces, "host_copy", copy)
    async with env.create_sync_stream(gpu) as stream:
        with hold_stream(stream) as release:
            emulator.set("lose_after_copies", emulator.get("copies"))  # the next copy faults
            # A direct pair (pinned -> device: it faults) and a staged one, on one stream.
            future.append(env.copy_tensors([pinned_a, pinned_b], [dev, out], stream=stream))
            release()
            with anyio.fail_after(20), pytest.raises(aioep.DeviceError, match="ILLEGAL_ADDRESS"):
                await future[0]
        assert seen == [False]
        future.clear()
    del pinned_a, pinned_b, dev


@pytest.mark.gpu
@needs_gpu
async def test_blocking_driver_calls_release_the_gil(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    """A thread blocked in a synchronisation lets every other Python thread run (cuda-bindings
    before 12.9.x would hold the GIL: the release below could then never happen)."""
    from aioep_cuda._driver import call_nogil, check, ctx_current

    async with env.create_sync_stream(gpu) as stream:
        impl = stream.impl
        result: list[Any] = []
        with hold_stream(stream) as release:

            def synchronize() -> None:
                with ctx_current(impl.device.ctx):
                    result.append(call_nogil("cuStreamSynchronize", impl.handle))

            waiter = threading.Thread(target=synchronize)
            waiter.start()
            total = sum(range(200_000))  # Python work while the waiter is blocked
            assert not result
            release()
            waiter.join(20)
        assert total == 199_999 * 100_000
        assert len(result) == 1
        check(result[0], "cuStreamSynchronize")


# -- no synchronising call while running: pools, stream-ordered frees, lifetimes, errors --------
def _context_retained() -> bool:
    """The backend still holds device 0's primary context (its shared state is alive)."""
    retained = 0 in aioep_cuda._device._registry
    if DRIVER.emulator is not None:
        assert bool(DRIVER.emulator.get("retained_contexts")) == retained
    return retained


def _pinned_pool(env: aioep.Environment, gpu: aioep.EpDevice) -> Any:
    allocator = env.get_shared_allocator(_mem(gpu, MemoryType.HOST_ACCESSIBLE))
    assert allocator is not None
    return allocator.device.pinned


@pytest.mark.gpu
@needs_gpu
async def test_pinned_memory_is_pooled_and_reused_after_its_stream_moved_on(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    """A freed pinned block goes back to the pool, not to the driver (``cuMemFreeHost``
    synchronises the device); it is handed out again for its size class, but not while the
    work enqueued on its stream before the free may still read it."""
    import anyio

    pool = _pinned_pool(env, gpu)
    pinned = _mem(gpu, MemoryType.HOST_ACCESSIBLE)
    a = env.empty((1000,), "uint8", pinned)
    first = a.data_ptr
    made = pool.allocations
    del a
    gc.collect()
    b = env.empty((900,), "uint8", pinned)  # the same size class: the block comes back
    assert b.data_ptr == first
    assert pool.allocations == made
    async with env.create_sync_stream(gpu) as stream:
        data = np.arange(1 << 12, dtype=np.uint8)
        dev = env.empty(data.shape, data.dtype, _mem(gpu))
        with hold_stream(stream) as release:
            c = env.empty(data.shape, data.dtype, pinned, stream=stream)
            c.numpy()[...] = data
            pending = env.copy_tensors([c], [dev], stream=stream)
            held_ptr = c.data_ptr
            del c  # freed while the held stream's copy will still read it
            gc.collect()
            d = env.empty(data.shape, data.dtype, pinned)  # must not be that block
            other_ptr = d.data_ptr
            assert other_ptr != held_ptr
            d.numpy()[...] = 0
            release()
            with anyio.fail_after(20):
                await pending
        out = np.zeros_like(data)
        await env.copy_tensors([dev], [out], stream=stream)
        np.testing.assert_array_equal(out, data)
        made = pool.allocations
        del d
        gc.collect()
        again = [env.empty(data.shape, data.dtype, pinned) for _ in range(2)]
        assert {t.data_ptr for t in again} == {held_ptr, other_ptr}
        assert pool.allocations == made
        del again, dev
    del b


@pytest.mark.gpu
@needs_gpu
async def test_the_pinned_pool_is_bounded(cuda_driver: Driver) -> None:
    async with aioep.Environment(
        backends=["cuda"], backend_options={"cuda": {"pinned_pool_limit": 1 << 20}}
    ) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        pinned = _mem(gpu, MemoryType.HOST_ACCESSIBLE)
        pool = _pinned_pool(env, gpu)
        assert pool.limit == 1 << 20
        halves = [env.empty((1 << 19,), "uint8", pinned) for _ in range(2)]
        with pytest.raises(aioep.DeviceError, match=r"pinned pool .*limit of 1048576 bytes"):
            env.empty((4096,), "uint8", pinned)
        kept = halves[0].data_ptr
        del halves[0]
        gc.collect()
        small = env.empty((4096,), "uint8", pinned)  # served by the idle larger block
        assert small.data_ptr == kept
        assert pool.held_bytes <= 1 << 20
        del small, halves


def test_threads_allocating_at_once_stay_within_the_pool_limit() -> None:
    """A new block counts against the pool's limit before its (unlocked, slow) driver call:
    threads that miss the idle lists together cannot overshoot, and a failed allocation
    gives its reservation back."""
    from types import SimpleNamespace

    from aioep_cuda._pool import CachingPool

    inside = threading.Barrier(2, timeout=5)
    addresses = iter(range(0x1000, 0x100000, 0x1000))

    def allocate(size: int) -> int:
        with contextlib.suppress(threading.BrokenBarrierError):
            inside.wait(timeout=0.5)  # both threads in the driver at once, if both got here
        return next(addresses)

    shared = SimpleNamespace(ordinal=0, maybe_release=lambda: None)
    pool = CachingPool(shared, "test", allocate, lambda ptr: None, limit=1 << 20)  # type: ignore[arg-type]
    results: list[object] = []

    def take() -> None:
        try:
            results.append(pool.take(3 << 18))  # 768 KiB: one fits the limit, two do not
        except aioep.DeviceError as exc:
            results.append(exc)

    threads = [threading.Thread(target=take) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(type(r).__name__ for r in results) == ["Block", "DeviceError"]
    assert pool.held_bytes <= 1 << 20

    def refuse(size: int) -> int:
        raise aioep.DeviceError("no memory")

    failing = CachingPool(shared, "test", refuse, lambda ptr: None, limit=1 << 20)  # type: ignore[arg-type]
    with pytest.raises(aioep.DeviceError, match="no memory"):
        failing.take(4096)
    assert failing.held_bytes == 0


@pytest.mark.gpu
@needs_gpu
async def test_empty_without_a_stream_never_waits_and_streams_see_the_allocation(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    """``env.empty()`` without a stream allocates on the device's helper stream and returns at
    once even while that stream is held back; a copy on another stream waits for the
    allocation on the device (the emulator reports a use before the allocation otherwise)."""
    import anyio

    data = np.arange(1 << 14, dtype=np.uint32)
    src = env.empty(data.shape, data.dtype, _mem(gpu, MemoryType.HOST_ACCESSIBLE))
    src.numpy()[...] = data
    out = np.zeros_like(data)
    async with env.create_sync_stream(gpu) as stream:
        dev = stream.impl.device
        with hold_cu(dev, dev.helper_stream(), dev.shared.lock) as release:
            t = env.empty(data.shape, data.dtype, _mem(gpu))  # returns: nothing waits
            assert t.data_ptr
            up = env.copy_tensors([src], [t], stream=stream)
            release()
            with anyio.fail_after(20):
                await up
        await env.copy_tensors([t], [out], stream=stream)
    np.testing.assert_array_equal(out, data)
    del t, src


@pytest.mark.gpu
@needs_gpu
async def test_the_sync_allocator_caches_its_blocks(cuda_driver: Driver) -> None:
    """``allocator="sync"``: ``cuMemFree`` synchronises the device, so freed blocks are kept
    and reused; the data a reused block receives is what was copied."""
    async with aioep.Environment(
        backends=["cuda"], backend_options={"cuda": {"allocator": "sync"}}
    ) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        allocator = env.get_shared_allocator(_mem(gpu))
        assert allocator is not None
        cache = allocator.device.shared.device_cache
        a = env.empty((1000,), "float32", _mem(gpu))
        first, made = a.data_ptr, cache.allocations
        del a
        gc.collect()
        data = np.arange(1000, dtype=np.float32)
        b = env.empty(data.shape, data.dtype, _mem(gpu))
        assert b.data_ptr == first
        assert cache.allocations == made
        out = np.zeros_like(data)
        async with env.create_sync_stream(gpu) as stream:
            await env.copy_tensors([data], [b], stream=stream)
            await env.copy_tensors([b], [out], stream=stream)
        np.testing.assert_array_equal(out, data)
        del b


@pytest.mark.gpu
@needs_gpu
async def test_a_notification_outliving_its_environment_touches_no_released_handle(
    cuda_driver: Driver,
) -> None:
    """An event still held by a notification when the environment closes is destroyed before
    the context is released; asking the notification afterwards, or dropping it in a later
    garbage collection, makes no driver call on it (on the real driver that crashed)."""
    async with aioep.Environment(backends=["cuda"]) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        async with env.create_sync_stream(gpu) as stream:
            done = stream.record()
            await done
            pending = stream.record()  # never awaited
    assert not _context_retained()
    assert done.done()
    assert pending.done()
    del done, pending
    gc.collect()


@pytest.mark.gpu
@needs_gpu
async def test_memory_outliving_its_environment_keeps_the_context_until_dropped(
    cuda_driver: Driver, join_releases: Callable[[], None]
) -> None:
    """A device tensor and a view of a pinned one kept past the environment's close: the
    context stays retained while they live (the pinned view stays usable), and their late
    release gives everything back and releases it, off the event loop."""
    env = aioep.Environment(backends=["cuda"])
    async with env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        device_tensor = env.empty((1 << 10,), "float32", _mem(gpu))
        pinned = env.empty((1 << 10,), "uint8", _mem(gpu, MemoryType.HOST_ACCESSIBLE))
        view = pinned.numpy()
        pinned.buffer.free()
        del pinned
        await env.aclose()
        assert env.close_report is not None
        # The device tensor (the pinned buffer was freed: its view holds only the block).
        assert env.close_report.live_buffers == 1
    assert _context_retained()
    view[...] = 3
    assert (view == 3).all()
    del device_tensor
    gc.collect()
    assert _context_retained()  # the view still holds its block
    del view
    gc.collect()
    await anyio_to_thread(join_releases)
    assert not _context_retained()


async def _failure(future: aioep.CopyFuture) -> str:
    """The message of the DeviceError ``future`` fails with ("" if it succeeds)."""
    try:
        await future
    except aioep.DeviceError as exc:
        return str(exc)
    return ""


@pytest.mark.gpu
@needs_gpu
@needs_emulator
async def test_a_sticky_error_fails_everything_in_flight_and_the_environment_closes(
    cuda_driver: Driver,
) -> None:
    import anyio

    emulator = cuda_driver.emulator
    assert emulator is not None
    emulator.set("bandwidth", 1 << 30)  # copies take a while: several are in flight
    data = np.arange(1 << 16, dtype=np.uint32)
    with anyio.fail_after(30):
        async with aioep.Environment(backends=["cuda"]) as env:
            gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
            pinned = env.empty(data.shape, data.dtype, _mem(gpu, MemoryType.HOST_ACCESSIBLE))
            pinned.numpy()[...] = data
            devs = [env.empty(data.shape, data.dtype, _mem(gpu)) for _ in range(4)]
            streams = [env.create_sync_stream(gpu) for _ in range(2)]
            emulator.set("lose_after_copies", emulator.get("copies"))  # the next copy faults
            failures: list[str] = []  # messages: an exception's frames would hold tensors
            futures = []
            for i, dev in enumerate(devs):
                s = streams[i % 2]
                for src in (pinned, data):  # pinned, then pageable (gated)
                    try:
                        futures.append(env.copy_tensors([src], [dev], stream=s))
                    except aioep.DeviceError as exc:  # the context broke before this enqueue
                        failures.append(str(exc))
            failures += [await _failure(f) for f in futures]
            assert len(failures) == 2 * len(devs)  # every copy failed, at enqueue or after
            assert all("ILLEGAL_ADDRESS" in msg for msg in failures), failures
            for s in streams:
                await s.aclose()
            del pinned, devs, dev, src, futures


@pytest.mark.gpu
@needs_gpu
@needs_emulator
async def test_a_failed_pageable_copy_fails_only_its_own_future(
    env: aioep.Environment, gpu: aioep.EpDevice
) -> None:
    """A non-sticky driver error in a gated pageable copy: that copy's future fails with a
    DeviceError naming the call; the copies before and after it on the stream succeed."""
    import anyio

    assert DRIVER.emulator is not None
    data = np.arange(1 << 12, dtype=np.uint32)
    pinned = env.empty(data.shape, data.dtype, _mem(gpu, MemoryType.HOST_ACCESSIBLE))
    pinned.numpy()[...] = data
    a, b, c = (env.empty(data.shape, data.dtype, _mem(gpu)) for _ in range(3))
    async with env.create_sync_stream(gpu) as stream:
        with hold_stream(stream) as release:
            before = env.copy_tensors([pinned], [a], stream=stream)
            failing = env.copy_tensors([data + 1], [b], stream=stream)  # pageable: gated
            after = env.copy_tensors([pinned], [c], stream=stream)
            # The pinned copies were issued; the pageable one is issued once the stream moves.
            DRIVER.emulator.fail_call("cuMemcpyAsync", code=1)  # INVALID_VALUE, once
            release()
            with anyio.fail_after(20):
                await before
                with pytest.raises(aioep.DeviceError, match=r"cuMemcpyAsync.*INVALID_VALUE"):
                    await failing
                await after
        out = np.zeros_like(data)
        for t in (a, c):
            await env.copy_tensors([t], [out], stream=stream)
            np.testing.assert_array_equal(out, data)
        await env.copy_tensors([data + 2], [b], stream=stream)  # the stream still works
        await env.copy_tensors([b], [out], stream=stream)
        np.testing.assert_array_equal(out, data + 2)
    del a, b, c, pinned


@pytest.mark.gpu
@needs_gpu
@needs_emulator
async def test_on_a_shared_pooled_stream_a_failed_copy_fails_only_its_request(
    cuda_driver: Driver,
) -> None:
    """Two requests share one pooled stream: A's failing (non-sticky) pageable copy fails A's
    future only; B's copy, after it on the same stream, completes with the right bytes. (An
    asynchronous fault is sticky for the context: every mark fails, see the test above.)"""
    import anyio

    assert DRIVER.emulator is not None
    data = np.arange(1 << 12, dtype=np.uint32)
    async with aioep.Environment(backends=["cuda"], stream_pool_size=1) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        pinned = env.empty(data.shape, data.dtype, _mem(gpu, MemoryType.HOST_ACCESSIBLE))
        pinned.numpy()[...] = data
        a, b = (env.empty(data.shape, data.dtype, _mem(gpu)) for _ in range(2))
        out = np.zeros_like(data)
        async with env.pooled_stream(gpu) as stream_a, env.pooled_stream(gpu) as stream_b:
            assert stream_a is stream_b
            with hold_stream(stream_a) as release:
                failing = env.copy_tensors([data + 1], [a], stream=stream_a)  # pageable: gated
                fine = env.copy_tensors([pinned], [b], stream=stream_b)
                DRIVER.emulator.fail_call("cuMemcpyAsync", code=1)  # INVALID_VALUE, once
                release()
                with anyio.fail_after(20):
                    with pytest.raises(aioep.DeviceError, match=r"cuMemcpyAsync.*INVALID_VALUE"):
                        await failing
                    await fine
                    await stream_b  # B's marks report nothing of A's
            await env.copy_tensors([b], [out], stream=stream_b)
            np.testing.assert_array_equal(out, data)
        del a, b, pinned, failing, fine
