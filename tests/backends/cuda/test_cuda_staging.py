"""Pageable host memory on CUDA through pinned staging chunks (``aioep_cuda._staging``,
``_pieces``, ``_chunks``, ``_workers``).

The gpu tests run on the real driver where ``cuInit`` finds a GPU, else on the emulated
driver (``tests/cuda_emulator``, a test double), with the same assertions. Chunks are made
small here (a few KiB) so that ordinary arrays cross many chunk boundaries; the slices a
chunk is split into for the worker threads are made small too.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import numpy as np
import pytest
from cuda_emulator import select_driver
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioep
from aioep import MemoryType

aioep_cuda = pytest.importorskip("aioep_cuda")

from aioep_cuda import CudaFactory, CudaOptions, _pieces, _staging  # noqa: E402

pytestmark = pytest.mark.anyio

DRIVER = select_driver()
NO_GPU = None if DRIVER.available else DRIVER.reason
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")
needs_emulator = pytest.mark.skipif(
    DRIVER.emulator is None, reason="statistics and fault injection need the emulator"
)

CHUNK = 4099  # odd: chunk boundaries fall at odd offsets
_T = TypeVar("_T")


@pytest.fixture
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split each chunk among the worker threads in slices of ~1 KiB (not 1 MiB)."""
    monkeypatch.setattr(_pieces, "MIN_SLICE_BYTES", 1000)


@pytest.fixture
def host_copies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int, int]]:
    """Record every host-side slice copy: (thread id, dst address, src address, bytes)."""
    log: list[tuple[int, int, int, int]] = []
    real = _pieces.host_copy

    def copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
        log.append((threading.get_ident(), dst.ctypes.data, src.ctypes.data, dst.nbytes))
        real(dst, src)

    monkeypatch.setattr(_pieces, "host_copy", copy)
    return log


@contextlib.asynccontextmanager
async def staged_env(**options: Any) -> AsyncIterator[tuple[aioep.Environment, aioep.EpDevice]]:
    opts = {"staging_chunk_bytes": CHUNK, "staging_chunks": 3, "staging_threads": 3}
    opts.update(options)
    async with aioep.Environment(backends=["cuda"], backend_options={"cuda": opts}) as env:
        yield env, env.ep_devices(ep_name="CUDAExecutionProvider")[0]


def _mem(gpu: aioep.EpDevice, kind: MemoryType = MemoryType.DEFAULT) -> aioep.MemoryInfo:
    info = gpu.memory_info(kind)
    assert info is not None
    return info


def _stager(env: aioep.Environment, gpu: aioep.EpDevice) -> _staging.Stager:
    factory = gpu.factory
    assert isinstance(factory, CudaFactory)
    assert factory.staging is not None
    return factory.staging.stager(factory.devices[gpu.hardware.device_id])


def _stat(key: str) -> int:
    return DRIVER.emulator.get(key) if DRIVER.emulator is not None else 0


def _piece_count(n: int, chunk: int = CHUNK) -> int:
    return -(-n // chunk)


def _guarded(n: int, fill: int = 0xEE) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(whole, view): ``view`` is ``n`` bytes at an odd offset inside ``whole``, whose other
    bytes are ``fill`` (a copy that writes past the view shows up there)."""
    whole = np.full(n + 16, fill, dtype=np.uint8)
    return whole, whole[7 : 7 + n]


def _guards_intact(whole: np.ndarray[Any, Any], n: int, fill: int = 0xEE) -> bool:
    return bool((whole[:7] == fill).all() and (whole[7 + n :] == fill).all())


# -- options (no GPU needed) ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"staging_chunk_bytes": 0}, "staging_chunk_bytes"),
        ({"staging_chunk_bytes": 1023}, "staging_chunk_bytes"),
        ({"staging_chunk_bytes": "64MiB"}, "staging_chunk_bytes"),
        ({"staging_chunk_bytes": 1.5e6}, "staging_chunk_bytes"),
        ({"staging_chunks": -1}, "staging_chunks"),
        ({"staging_chunks": True}, "staging_chunks"),
        ({"staging_threads": 0}, "staging_threads"),
        ({"staging_threads": 1000}, "staging_threads"),
        ({"staging_thread": 4}, "unknown option"),
    ],
)
def test_bad_staging_options_are_invalid_argument(options: dict[str, Any], fragment: str) -> None:
    with pytest.raises(aioep.InvalidArgument, match=fragment):
        CudaFactory(options)


def test_staging_options_parse_with_defaults() -> None:
    opts = CudaOptions.from_options(
        {"staging_chunk_bytes": "0x10000", "staging_chunks": 0, "staging_threads": "2"}
    )
    assert opts.staging == _staging.StagingOptions(chunk_bytes=1 << 16, chunks=0, threads=2)
    default = CudaOptions().staging
    assert default == _staging.StagingOptions()
    assert default.chunk_bytes == 64 << 20
    assert default.chunks == 4
    assert 1 <= default.threads <= 8
    assert default.bound == default.chunk_bytes * default.chunks  # 64 MiB: no rounding
    assert _staging.StagingOptions(chunk_bytes=5000, chunks=3).bound == 3 * 8192


# -- the stager's parts (no GPU needed) --------------------------------------------------------
def test_the_worker_pool_runs_queued_tasks_first_and_survives_a_failing_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aioep_cuda._workers import WorkerPool

    reported: list[BaseException] = []
    monkeypatch.setattr("sys.unraisablehook", lambda args: reported.append(args.exc_value))
    cond = threading.Condition()
    ran: list[str] = []
    offered = ["from the source 1", "from the source 2"]
    busy = [True]

    def source() -> Callable[[], None] | None:
        if not offered:
            return None
        name = offered.pop(0)
        return lambda: ran.append(name)

    def fail() -> None:
        raise RuntimeError("a bug in a task")

    pool = WorkerPool("test-pool", 1, cond, source, lambda: not busy[0])
    with cond:  # queued before the thread starts: the queue comes before the source
        pool.push(lambda: ran.append("queued"), fail, lambda: ran.append("after the failure"))
        pool.start()
    deadline = time.monotonic() + 30
    while len(ran) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ran == ["queued", "after the failure", "from the source 1", "from the source 2"]
    assert [str(e) for e in reported] == ["a bug in a task"]
    # Closing waits while the owner is busy, then the workers exit once it is idle.
    closer = threading.Thread(target=pool.close, args=(time.monotonic() + 30,))
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()
    with cond:
        busy[0] = False
        cond.notify_all()
    closer.join(30)
    assert not closer.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-pool")]


class _FakePinned:
    """A pinned pool over numpy buffers that refuses after ``limit`` blocks."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buffers: list[np.ndarray[Any, Any]] = []
        self.given: list[tuple[int, tuple[Any, ...]]] = []

    def take(self, nbytes: int) -> Any:
        from aioep_cuda._pool import Block

        if len(self.buffers) >= self.limit:
            raise aioep.DeviceError("the pinned pool's limit is reached")
        self.buffers.append(np.zeros(nbytes, np.uint8))
        return Block(self.buffers[-1].ctypes.data, nbytes)

    def give(self, block: Any, after: Any = ()) -> None:
        self.given.append((block.ptr, tuple(after)))


def test_the_chunk_pool_makes_chunks_one_at_a_time_within_its_cap() -> None:
    from aioep_cuda._chunks import ChunkPool

    cond = threading.Condition()
    pinned = _FakePinned(limit=10)
    pool = ChunkPool(pinned, 4096, 2, cond)  # type: ignore[arg-type]
    with cond:
        assert pool.take() is None
        assert pool.may_make()
        assert not pool.may_make()  # one allocation at a time
    first = pool.make()
    pool.made(first)
    first.view[:] = 7  # the chunk's bytes are the block's
    assert pinned.buffers[0][0] == 7
    with cond:
        assert pool.may_make()
    pool.made(pool.make())
    with cond:
        assert not pool.may_make()  # at its cap
        assert pool.held_bytes == pool.peak_bytes == 2 * 4096
        assert pool.take() is None
    pool.give(first)
    with cond:
        assert pool.take() is first
    pool.close(())
    assert len(pinned.given) == 2
    with cond:
        assert pool.held_bytes == 0


def test_the_chunk_pool_shrinks_to_what_the_pinned_pool_gave() -> None:
    from aioep_cuda._chunks import ChunkPool

    cond = threading.Condition()
    pool = ChunkPool(_FakePinned(limit=1), 4096, 3, cond)  # type: ignore[arg-type]
    with cond:
        assert pool.may_make()
    pool.made(pool.make())
    with cond:
        assert pool.may_make()
    with pytest.raises(aioep.DeviceError):
        pool.make()
    with cond:
        assert pool.unmade()  # one chunk there: wait for it
        assert not pool.may_make()  # the cap is now 1
    empty = ChunkPool(_FakePinned(limit=0), 4096, 3, cond)  # type: ignore[arg-type]
    with cond:
        assert empty.may_make()
    with pytest.raises(aioep.DeviceError):
        empty.make()
    with cond:
        assert not empty.unmade()  # none at all: the piece fails


def test_every_piece_kind_has_a_route_and_a_staged_one_touches_the_device() -> None:
    for kind in _pieces.PieceKind:
        for staged in (True, False):
            assert _pieces.ROUTES[kind, staged]
    assert _pieces.ROUTES[_pieces.PieceKind.H2D, True][-1] is _pieces.Phase.UPLOAD
    assert _pieces.ROUTES[_pieces.PieceKind.D2H, True][0] is _pieces.Phase.DOWNLOAD


# -- correct bytes at every chunk boundary -----------------------------------------------------
SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 5 * CHUNK + 123]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("use_stream", [True, False], ids=["stream", "no-stream"])
@pytest.mark.parametrize("n", SIZES)
async def test_round_trip_at_chunk_boundaries(
    n: int, use_stream: bool, host_copies: list[tuple[int, int, int, int]]
) -> None:
    """Pageable -> device -> device -> pageable, at sizes around the chunk size: every byte
    arrives, nothing outside the destinations is written, the pairs went through the chunks
    (one piece per chunk each way), and the host copies ran on worker threads, never on the
    event loop."""
    rng = np.random.default_rng(n)
    src_whole, src = _guarded(n, 0x11)
    src[...] = rng.integers(0, 256, n, dtype=np.uint8)
    before = src_whole.copy()
    out_whole, out = _guarded(n)
    pageable = _stat("pageable_copies")
    async with staged_env() as (env, gpu):
        stager = _stager(env, gpu)
        pieces = stager.pieces
        async with env.create_sync_stream(gpu) as stream:
            s = stream if use_stream else None
            a = env.empty((n,), "uint8", _mem(gpu), stream=s)
            b = env.empty((n,), "uint8", _mem(gpu), stream=s)
            await env.copy_tensors([src], [a], stream=s)
            await env.copy_tensors([a], [b], stream=s)
            await env.copy_tensors([b], [out], stream=s)
            del a, b
        assert stager.pieces - pieces == 2 * _piece_count(n)
    np.testing.assert_array_equal(out, src)
    assert _guards_intact(out_whole, n)
    np.testing.assert_array_equal(src_whole, before)  # the source is only read
    assert _stat("pageable_copies") == pageable  # the driver never saw pageable memory
    assert threading.get_ident() not in {t for t, *_ in host_copies}
    if n:
        assert sum(c[3] for c in host_copies) == 2 * n  # each byte copied once each way


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((3, 5, 7), "float64"), ((1001,), "int16"), ((2, 2053), "uint8"), ((13, 17), "complex64")],
)
async def test_odd_shapes_and_dtypes(shape: tuple[int, ...], dtype: str) -> None:
    rng = np.random.default_rng(7)
    data = rng.standard_normal(int(np.prod(shape)) * 2).view("uint8")
    data = data[: int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)
    out = np.zeros_like(data)
    async with (
        staged_env(staging_chunk_bytes=1031) as (env, gpu),
        env.create_sync_stream(gpu) as stream,
    ):
        dev = env.empty(shape, dtype, _mem(gpu), stream=stream)
        env.copy_tensors([data], [dev], stream=stream)
        await env.copy_tensors([dev], [out], stream=stream)
        del dev
    assert out.tobytes() == data.tobytes()  # bit-exact, NaN payloads included


@pytest.mark.gpu
@needs_gpu
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(0, 6 * CHUNK), min_size=1, max_size=4),
    chunk=st.integers(1024, 3 * CHUNK),
    threads=st.integers(1, 4),
    chunks=st.integers(1, 3),
)
async def test_any_batch_round_trips(
    sizes: list[int], chunk: int, threads: int, chunks: int, small_slices: None
) -> None:
    """Any batch of pageable arrays, any chunk size, count and thread count: one batched
    upload and one batched download on a stream return the same bytes."""
    rng = np.random.default_rng(sum(sizes) + chunk)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    outs = [np.zeros_like(s) for s in srcs]
    async with (
        staged_env(staging_chunk_bytes=chunk, staging_chunks=chunks, staging_threads=threads) as (
            env,
            gpu,
        ),
        env.create_sync_stream(gpu) as stream,
    ):
        devs = [env.empty(s.shape, s.dtype, _mem(gpu), stream=stream) for s in srcs]
        env.copy_tensors(srcs, devs, stream=stream)
        await env.copy_tensors(devs, outs, stream=stream)
        stager = _stager(env, gpu)
        assert stager.peak_bytes <= stager.options.bound
        del devs
    for s, o in zip(srcs, outs):
        np.testing.assert_array_equal(o, s)


@pytest.mark.gpu
@needs_gpu
async def test_mixed_batch_with_pinned_and_device_pairs() -> None:
    """One batch mixing staged uploads and downloads, a pageable -> pinned pair (a host
    copy by the workers) and a pinned -> device pair (no staging): all land, and later work
    on the stream sees every one of them."""
    n = 3 * CHUNK + 5
    rng = np.random.default_rng(3)
    up = rng.integers(0, 256, n, dtype=np.uint8)
    host = rng.integers(0, 256, n, dtype=np.uint8)
    async with staged_env() as (env, gpu):
        pinned_in = env.empty((n,), "uint8", _mem(gpu, MemoryType.HOST_ACCESSIBLE))
        pinned_in.numpy()[...] = host[::-1]
        pinned_out = env.empty((n,), "uint8", _mem(gpu, MemoryType.HOST_ACCESSIBLE))
        down = np.zeros(n, np.uint8)
        async with env.create_sync_stream(gpu) as stream:
            a = env.empty((n,), "uint8", _mem(gpu), stream=stream)
            b = env.empty((n,), "uint8", _mem(gpu), stream=stream)
            c = env.empty((n,), "uint8", _mem(gpu), stream=stream)
            await env.copy_tensors([up], [a], stream=stream)
            env.copy_tensors([a, host, pinned_in], [down, pinned_out, b], stream=stream)
            env.copy_tensors([a], [c], stream=stream)  # later device work: sees a
            back = np.zeros(n, np.uint8)
            back_b = np.zeros(n, np.uint8)
            await env.copy_tensors([c, b], [back, back_b], stream=stream)
            np.testing.assert_array_equal(down, up)
            np.testing.assert_array_equal(pinned_out.numpy(), host)
            np.testing.assert_array_equal(back, up)
            np.testing.assert_array_equal(back_b, host[::-1])
            del a, b, c
        del pinned_in, pinned_out


# -- concurrency, exhaustion, a slow host thread ----------------------------------------------
@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("small_slices")
async def test_many_concurrent_copies_on_several_streams() -> None:
    """40 round trips on 4 streams and 8 more without a stream, all at once, through 2
    chunks: they queue for the chunks (no deadlock), every byte arrives, and the staging
    memory never exceeds its bound."""
    import anyio

    if DRIVER.emulator is not None:
        DRIVER.emulator.set("bandwidth", 1 << 30)  # device copies take time: they overlap
    rng = np.random.default_rng(11)
    sizes = [int(x) for x in rng.integers(1, 4 * CHUNK, 48)]
    datas = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    outs = [np.zeros_like(d) for d in datas]
    async with staged_env(staging_chunks=2, staging_threads=4) as (env, gpu):
        streams = [env.create_sync_stream(gpu) for _ in range(4)]

        async def round_trip(i: int) -> None:
            s = streams[i % 4] if i < 40 else None
            dev = env.empty(datas[i].shape, datas[i].dtype, _mem(gpu), stream=s)
            await env.copy_tensors([datas[i]], [dev], stream=s)
            await env.copy_tensors([dev], [outs[i]], stream=s)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(len(datas)):
                    tg.start_soon(round_trip, i)
        stager = _stager(env, gpu)
        assert stager.peak_bytes <= stager.options.bound == 2 * 8192  # 8 KiB pool blocks
        assert stager.jobs >= 2 * len(datas)
        for s in streams:
            await s.aclose()
    for d, o in zip(datas, outs):
        np.testing.assert_array_equal(o, d)


@pytest.mark.gpu
@needs_gpu
async def test_one_chunk_one_thread_serves_everything() -> None:
    """The smallest staging (one chunk, one worker) still moves many concurrent batches:
    the single chunk is reused only after its device copy completed (else later pieces
    would overwrite bytes still being uploaded)."""
    import anyio

    if DRIVER.emulator is not None:
        DRIVER.emulator.set("bandwidth", 256 << 20)
        DRIVER.emulator.set("latency_ns", 100_000)
    rng = np.random.default_rng(5)
    datas = [rng.integers(0, 256, 3 * CHUNK + i, dtype=np.uint8) for i in range(6)]
    outs = [np.zeros_like(d) for d in datas]
    async with (
        staged_env(staging_chunks=1, staging_threads=1) as (env, gpu),
        env.create_sync_stream(gpu) as s1,
        env.create_sync_stream(gpu) as s2,
    ):
        devs = [env.empty(d.shape, d.dtype, _mem(gpu)) for d in datas]
        futures = [
            env.copy_tensors([d], [t], stream=(s1, s2)[i % 2])
            for i, (d, t) in enumerate(zip(datas, devs))
        ]
        with anyio.fail_after(60):
            for f in futures:
                await f
            for i, (t, o) in enumerate(zip(devs, outs)):
                await env.copy_tensors([t], [o], stream=(s2, s1)[i % 2])
        assert _stager(env, gpu).peak_bytes == 8192  # one chunk: one 8 KiB pool block
        del devs, futures, t, f
    for d, o in zip(datas, outs):
        np.testing.assert_array_equal(o, d)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("use_stream", [True, False], ids=["stream", "no-stream"])
async def test_a_slow_host_thread(monkeypatch: pytest.MonkeyPatch, use_stream: bool) -> None:
    """One slice of one chunk is slow (its worker sleeps): the others go on, the copy waits
    for it, and later work on the stream sees every byte."""
    n = 6 * CHUNK + 99
    data = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8)
    out = np.zeros_like(data)
    slow_at = data.ctypes.data + 2 * CHUNK  # the start of the third chunk
    real = _pieces.host_copy
    slept = threading.Event()

    def copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
        if src.ctypes.data == slow_at:
            time.sleep(0.2)
            slept.set()
        real(dst, src)

    monkeypatch.setattr(_pieces, "host_copy", copy)
    async with staged_env(staging_threads=4) as (env, gpu), env.create_sync_stream(gpu) as stream:
        s = stream if use_stream else None
        a = env.empty(data.shape, data.dtype, _mem(gpu), stream=s)
        b = env.empty(data.shape, data.dtype, _mem(gpu), stream=s)
        later = [env.copy_tensors([data], [a], stream=s)]
        if s is None:  # without a stream, copies are not ordered with each other
            await later[0]
        later.append(env.copy_tensors([a], [b], stream=s))
        if s is None:
            await later[1]
        await env.copy_tensors([b], [out], stream=s)
        del a, b, later
    assert slept.is_set()
    np.testing.assert_array_equal(out, data)


# -- stream order: a download into a host array, then an upload from it --------------------
@pytest.mark.gpu
@needs_gpu
@pytest.mark.usefixtures("small_slices")
async def test_download_then_upload_of_the_same_host_array(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On one stream, without awaiting in between: device ``x`` -> host ``h`` (staged, and
    slow on the host), then ``h`` -> device ``y`` (staged), then ``y`` -> host. The upload
    reads ``h`` only after the download has written all of it (its pieces start once the
    stream has passed the download's gate): ``y`` holds ``x``'s bytes, and the log of host
    copies shows every write into ``h`` before any read from it."""
    n = 4 * CHUNK + 3
    data = np.random.default_rng(9).integers(1, 256, n, dtype=np.uint8)  # no zero byte
    h = np.zeros(n, np.uint8)
    lo, hi = h.ctypes.data, h.ctypes.data + n
    log: list[str] = []
    real = _pieces.host_copy

    def copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
        if lo <= dst.ctypes.data < hi:
            time.sleep(0.02)  # the download's host side is slow
            real(dst, src)
            log.append("write h")
        elif lo <= src.ctypes.data < hi:
            log.append("read h")
            real(dst, src)
        else:
            real(dst, src)

    monkeypatch.setattr(_pieces, "host_copy", copy)
    async with staged_env(staging_threads=4) as (env, gpu):
        pinned = env.empty((n,), "uint8", _mem(gpu, MemoryType.HOST_ACCESSIBLE))
        pinned.numpy()[...] = data
        async with env.create_sync_stream(gpu) as stream:
            x = env.empty((n,), "uint8", _mem(gpu), stream=stream)
            y = env.empty((n,), "uint8", _mem(gpu), stream=stream)
            env.copy_tensors([pinned], [x], stream=stream)
            down = env.copy_tensors([x], [h], stream=stream)
            up = env.copy_tensors([h], [y], stream=stream)
            assert not up.done()
            out = np.zeros(n, np.uint8)
            await env.copy_tensors([y], [out], stream=stream)
            assert down.done()
            assert up.done()
            del x, y, down, up
        del pinned
    np.testing.assert_array_equal(h, data)
    np.testing.assert_array_equal(out, data)
    writes = [i for i, e in enumerate(log) if e == "write h"]
    reads = [i for i, e in enumerate(log) if e == "read h"]
    assert writes
    assert reads
    assert max(writes) < min(reads), log


# -- cancellation and lifetime -------------------------------------------------------------
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("direction", ["upload", "download"])
async def test_cancelled_awaiter_keeps_buffers_alive(
    monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    """The task awaiting a staged copy is cancelled while a worker is inside the copy, and
    the test drops its own references to the host array: the array stays alive while the
    workers use it, the copy completes (seen by awaiting the stream instead), and the array
    is let go afterwards."""
    import anyio

    n = 3 * CHUNK + 1
    data = np.random.default_rng(4).integers(0, 256, n, dtype=np.uint8)
    entered, proceed = threading.Event(), threading.Event()
    real = _pieces.host_copy

    def copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
        entered.set()
        proceed.wait(20)
        real(dst, src)

    async with staged_env() as (env, gpu):
        pinned = env.empty((n,), "uint8", _mem(gpu, MemoryType.HOST_ACCESSIBLE))
        async with env.create_sync_stream(gpu) as stream:
            dev = env.empty((n,), "uint8", _mem(gpu), stream=stream)
            if direction == "download":
                pinned.numpy()[...] = data
                await env.copy_tensors([pinned], [dev], stream=stream)
                raw = bytearray(n)  # the memory outlives the array object, to be checked
                host = np.frombuffer(raw, np.uint8)
                pair = ([dev], [host])
            else:
                host = data.copy()
                pair = ([host], [dev])
            alive = weakref.ref(host)
            monkeypatch.setattr(_pieces, "host_copy", copy)

            async def awaiter(src: list[Any], dst: list[Any]) -> None:
                await env.copy_tensors(src, dst, stream=stream)

            async with anyio.create_task_group() as tg:
                tg.start_soon(awaiter, *pair)
                assert await anyio.to_thread.run_sync(entered.wait, 20)
                tg.cancel_scope.cancel()
            del pair, host
            gc.collect()
            assert alive() is not None  # the workers still use it
            proceed.set()
            with anyio.fail_after(20):
                await stream  # the other route: the stream is past the copy
            monkeypatch.undo()
            if direction == "upload":
                await env.copy_tensors([dev], [pinned], stream=stream)
                np.testing.assert_array_equal(pinned.numpy(), data)
            else:
                np.testing.assert_array_equal(np.frombuffer(raw, np.uint8), data)
            del dev
        del pinned
    for _ in range(100):  # let go once released (a dispatcher callback)
        gc.collect()
        if alive() is None:
            break
        await anyio.sleep(0.01)
    assert alive() is None


@pytest.mark.gpu
@needs_gpu
async def test_closing_the_stager_with_batches_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stager closes (as the factory's close does) while batches are queued behind a slow
    host copy: they finish first, the workers stop, the chunks go back to the pinned pool,
    and a batch submitted afterwards is refused, not lost."""
    import anyio

    real = _pieces.host_copy

    def copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
        time.sleep(0.002)
        real(dst, src)

    monkeypatch.setattr(_pieces, "host_copy", copy)
    n = 5 * CHUNK
    datas = [np.full(n, i + 1, np.uint8) for i in range(6)]
    async with staged_env(staging_chunks=2) as (env, gpu):
        stager = _stager(env, gpu)
        pool = stager.device.pinned
        devs = [env.empty((n,), "uint8", _mem(gpu)) for _ in datas]
        async with env.create_sync_stream(gpu) as stream:
            await stream  # the allocations are done before the stager's streams use them
            jobs = [
                stager.submit(
                    [_staging.StagedPair(_staging.H2D, t.data_ptr, d.ctypes.data, n)], [d]
                )
                for d, t in zip(datas, devs)
            ]
            assert all(j is not None and not j.released.is_set() for j in jobs)
            with anyio.fail_after(30):
                await anyio.to_thread.run_sync(stager.close)
            assert all(j is not None and j.released.is_set() and j.error is None for j in jobs)
            assert stager.held_bytes == 0
            assert pool.in_use_bytes == 0
            assert not [t for t in threading.enumerate() if t.name.startswith("aioep-cuda-stage")]
            assert (
                stager.submit(
                    [_staging.StagedPair(_staging.H2D, devs[0].data_ptr, datas[0].ctypes.data, n)],
                    [],
                )
                is None
            )
            pinned = env.empty((n,), "uint8", _mem(gpu, MemoryType.HOST_ACCESSIBLE))
            for d, t in zip(datas, devs):
                await env.copy_tensors([t], [pinned], stream=stream)  # pinned: not staged
                np.testing.assert_array_equal(pinned.numpy(), d)
            with pytest.raises(aioep.DeviceError, match="closed"):
                await env.copy_tensors([datas[0]], [devs[0]], stream=stream)
            await stream
            del devs, pinned, t, jobs


# -- limits and the unstaged baseline --------------------------------------------------------
@pytest.mark.gpu
@needs_gpu
async def test_no_pinned_memory_for_a_chunk_is_a_clear_error() -> None:
    """The pinned pool's limit is below one chunk: the staged copy fails with a
    DeviceError that says so (on the stream and without one); the stream still works."""
    import anyio

    data = np.arange(2 * CHUNK, dtype=np.uint8)
    async with (
        staged_env(pinned_pool_limit=1024) as (env, gpu),
        env.create_sync_stream(gpu) as stream,
    ):
        dev = env.empty(data.shape, data.dtype, _mem(gpu), stream=stream)
        with anyio.fail_after(20):
            with pytest.raises(aioep.DeviceError, match="no pinned staging memory"):
                await env.copy_tensors([data], [dev], stream=stream)
            with pytest.raises(aioep.DeviceError, match="no pinned staging memory"):
                await env.copy_tensors([data], [dev])
            await stream  # the gate was opened: the stream goes on
        del dev


@pytest.mark.gpu
@needs_gpu
async def test_a_pinned_pool_limit_between_one_and_all_chunks() -> None:
    """The pinned pool holds two chunks at most while staging asks for four: staging makes
    do with what it got, and nothing deadlocks."""
    import anyio

    limit = 2 * 8192  # chunks of 4099 bytes take 8 KiB blocks of the pool
    datas = [np.full(4 * CHUNK, i + 1, np.uint8) for i in range(4)]
    outs = [np.zeros_like(d) for d in datas]
    async with (
        staged_env(pinned_pool_limit=limit, staging_chunks=4) as (env, gpu),
        env.create_sync_stream(gpu) as s1,
        env.create_sync_stream(gpu) as s2,
    ):
        devs = [env.empty(d.shape, d.dtype, _mem(gpu)) for d in datas]
        with anyio.fail_after(30):
            for i, (d, t) in enumerate(zip(datas, devs)):
                env.copy_tensors([d], [t], stream=(s1, s2)[i % 2])
            for i, (t, o) in enumerate(zip(devs, outs)):
                await env.copy_tensors([t], [o], stream=(s1, s2)[i % 2])
        assert _stager(env, gpu).peak_bytes <= limit
        del devs, t
    for d, o in zip(datas, outs):
        np.testing.assert_array_equal(o, d)


@pytest.mark.gpu
@needs_gpu
@needs_emulator
async def test_zero_chunks_is_the_unstaged_baseline() -> None:
    """``staging_chunks=0``: the workers issue the driver's own pageable copies (one per
    pair), no pinned staging memory is taken, and the bytes arrive."""
    data = np.arange(5 * CHUNK, dtype=np.uint8)
    out = np.zeros_like(data)
    pageable = _stat("pageable_copies")
    async with staged_env(staging_chunks=0) as (env, gpu), env.create_sync_stream(gpu) as stream:
        dev = env.empty(data.shape, data.dtype, _mem(gpu), stream=stream)
        env.copy_tensors([data], [dev], stream=stream)
        await env.copy_tensors([dev], [out], stream=stream)
        stager = _stager(env, gpu)
        assert stager.peak_bytes == 0
        assert stager.pieces == 2
        del dev
    np.testing.assert_array_equal(out, data)
    assert _stat("pageable_copies") == pageable + 2


@pytest.mark.gpu
@needs_gpu
async def test_staging_is_shared_per_device() -> None:
    """Copies on different streams and without a stream use the device's one stager: its
    chunks are the bound of the whole device, not of one call."""
    data = np.ones(3 * CHUNK, np.uint8)
    async with (
        staged_env(staging_chunks=2) as (env, gpu),
        env.create_sync_stream(gpu) as s1,
        env.create_sync_stream(gpu) as s2,
    ):
        dev = env.empty(data.shape, data.dtype, _mem(gpu))
        stager = _stager(env, gpu)
        jobs = stager.jobs
        await env.copy_tensors([data], [dev], stream=s1)
        await env.copy_tensors([data], [dev], stream=s2)
        await env.copy_tensors([data], [dev])
        assert stager.jobs == jobs + 3
        assert _stager(env, gpu) is stager
        assert stager.peak_bytes <= stager.options.bound
        del dev


async def anyio_to_thread(fn: Callable[..., _T], *args: Any) -> _T:
    import anyio.to_thread

    return await anyio.to_thread.run_sync(fn, *args)


@pytest.mark.gpu
@needs_gpu
@needs_emulator
async def test_no_staging_stream_fails_the_copy_not_the_stream() -> None:
    """The stager cannot make its streams (``cuStreamCreate`` fails once): the staged copy's
    future fails with a DeviceError naming the call, its gate is opened anyway (the stream
    goes on), and the next copy stages normally."""
    import anyio

    assert DRIVER.emulator is not None
    data = np.arange(3 * CHUNK, dtype=np.uint8)
    out = np.zeros_like(data)
    async with staged_env() as (env, gpu), env.create_sync_stream(gpu) as stream:
        dev = env.empty(data.shape, data.dtype, _mem(gpu), stream=stream)
        await stream
        DRIVER.emulator.fail_call("cuStreamCreate", times=1)
        with anyio.fail_after(20):
            with pytest.raises(aioep.DeviceError, match="cuStreamCreate"):
                await env.copy_tensors([data], [dev], stream=stream)
            await env.copy_tensors([data], [dev], stream=stream)
            await env.copy_tensors([dev], [out], stream=stream)
        del dev
    np.testing.assert_array_equal(out, data)
