"""A soak of the CUDA backend, and its default wake (a bounded poll, then the host function).

The soak: hundreds of tasks on several streams of two environments copy fresh random data
host -> device -> device -> host through pageable and pinned host memory, drop device and
pinned tensors while their copies are in flight, abandon some waits (cancelled tasks),
cross streams through notifications, close streams and one whole environment while copies
are in flight, and check every byte that arrives. It runs on the real driver where a GPU
exists and otherwise on the emulated driver (``tests/cuda_emulator``), with the event-loop
thread marked so that the emulator aborts if the loop ever waits in the driver. A deadlock
fails the test (``anyio.fail_after``) and, should the loop thread itself be stuck, every
thread's stack is dumped and the process ends (``faulthandler``), instead of hanging CI.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest
from cuda_emulator import Driver, select_driver

import aioep
from aioep import MemoryType

pytest.importorskip("aioep_cuda")

from aioep_cuda._wake import Dispatcher

pytestmark = pytest.mark.anyio

DRIVER = select_driver()
EMULATED = DRIVER.kind == "emulator"
needs_gpu = pytest.mark.skipif(not DRIVER.available, reason=DRIVER.reason)

SOAK_LIMIT_S = 60.0
"""The soak fails (with every task's state) if it has not finished by then ..."""
STACKS_AFTER_S = SOAK_LIMIT_S + 15.0
"""... and if even that cannot fire (the loop thread is stuck), every thread's stack is dumped
and the process ends."""


@contextlib.contextmanager
def _stacks_on_deadlock(seconds: float) -> Iterator[None]:
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def driver() -> Iterator[Driver]:
    """On the emulator: one device, copies that take a while (so that drops, cancellations and
    closes land while copies are in flight), and the event-loop thread marked."""
    emulator = DRIVER.emulator
    if emulator is None:
        yield DRIVER
        return
    emulator.take_violation()
    with emulator.devices(1):
        emulator.set("host_wait_limit_ns", 20_000_000_000)  # a hung wait fails, never hangs
        emulator.set("bandwidth", 2_000_000_000)
        emulator.set("latency_ns", 20_000)
        with _loop_thread_marked(emulator):
            yield DRIVER
            gc.collect()
    violation = emulator.take_violation()
    if violation:
        pytest.fail(f"the CUDA emulator saw a violation: {violation}")


@contextlib.contextmanager
def _loop_thread_marked(emulator: Any) -> Iterator[None]:
    """The strict emulator aborts when a marked thread waits in the driver; an older one only
    counts the waits of its watched thread, which must then stay at zero."""
    mark = getattr(emulator, "loop_thread", None)
    if mark is not None:
        with mark():
            yield
        return
    emulator.set("watch_tid", threading.get_native_id())
    before = emulator.get("watched_blocking")
    yield
    waits = emulator.get("watched_blocking") - before
    assert waits == 0, f"the event-loop thread waited in the driver {waits} time(s)"


# -- the soak ---------------------------------------------------------------------------------
DTYPES = ("uint8", "int16", "int32", "float32", "float64")
SIZES = (1, 7, 1000, 4096, 65_536, 300_000)


def _fresh(rng: np.random.Generator, n: int, dtype: str) -> np.ndarray:
    """Random bits of ``n`` elements (every float bit pattern too: NaNs, infinities)."""
    raw = rng.integers(0, 256, size=n * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype)


def _same_bits(a: Any, b: np.ndarray) -> bool:
    return bool(np.array_equal(np.asarray(a).view(np.uint8), b.view(np.uint8)))


class _Tally:
    def __init__(self) -> None:
        self.checked = 0
        self.abandoned_then_checked = 0
        self.crossed = 0
        self.dropped = 0
        self.wrong: list[str] = []


async def _round_trip(
    env: aioep.Environment,
    gpu: aioep.EpDevice,
    streams: list[aioep.SyncStream],
    rng: np.random.Generator,
    tally: _Tally,
    i: int,
) -> None:
    """host -> device -> device -> host on one stream (or crossing to another), dropping what
    it can while the copies are in flight; some waits are abandoned, then awaited again."""
    n = int(rng.choice(SIZES))
    dtype = str(rng.choice(DTYPES))
    data = _fresh(rng, n, dtype)
    pinned = gpu.memory_info(MemoryType.HOST_ACCESSIBLE)
    device = gpu.memory_info(MemoryType.DEFAULT)
    stream = streams[i % len(streams)]
    src: Any
    if rng.random() < 0.5:
        src = env.empty(data.shape, data.dtype, pinned)
        src.numpy()[...] = data
    else:
        src = data.copy()  # pageable
    dev = env.empty(data.shape, data.dtype, device, stream=stream if rng.random() < 0.5 else None)
    dev2 = env.empty(data.shape, data.dtype, device)
    env.copy_tensors([src], [dev], stream=stream)
    second = env.copy_tensors([dev], [dev2], stream=stream)
    if rng.random() < 0.6:  # dropped while the copies that use them are in flight
        del src, dev
        tally.dropped += 1
    out: Any = (
        env.empty(data.shape, data.dtype, pinned) if rng.random() < 0.5 else np.empty_like(data)
    )
    last = stream
    if rng.random() < 0.3:  # cross to another stream through the copy's notification
        last = streams[(i + 1) % len(streams)]
        last.wait(second.notification)
        tally.crossed += 1
    third = env.copy_tensors([dev2], [out], stream=last)
    del dev2
    if rng.random() < 0.15:
        with anyio.CancelScope() as scope:
            scope.cancel()  # the wait is abandoned; the copy runs its course
            await third
        await third
        tally.abandoned_then_checked += 1
    elif rng.random() < 0.5:
        await last
    else:
        await third
    result = out.numpy() if isinstance(out, aioep.Tensor) else out
    if not _same_bits(result, data):
        tally.wrong.append(f"task {i}: {n} x {dtype}")
    tally.checked += 1


async def _victim(env: aioep.Environment, gpu: aioep.EpDevice, stream: aioep.SyncStream) -> None:
    """Copies in a loop until cancelled from outside: its copies are abandoned mid-flight."""
    data = np.arange(1 << 16, dtype=np.uint32)
    while True:
        dev = env.empty(data.shape, data.dtype, gpu.memory_info(MemoryType.DEFAULT))
        env.copy_tensors([data], [dev], stream=stream)
        await env.copy_tensors([dev], [np.empty_like(data)], stream=stream)


async def _load(env: aioep.Environment, seed: int, tally: _Tally, rounds: int, tasks: int) -> None:
    """``rounds`` rounds of ``tasks`` round trips on 4 fresh streams each; a round's streams
    are closed while the next round runs; victims are cancelled mid-copy in each round."""
    gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
    rng = np.random.default_rng(seed)
    async with anyio.create_task_group() as closers:
        for _ in range(rounds):
            streams = [env.create_sync_stream(gpu) for _ in range(4)]
            async with anyio.create_task_group() as tg, anyio.create_task_group() as victims:
                for s in streams[:2]:
                    victims.start_soon(_victim, env, gpu, s)
                for i in range(tasks):
                    child = np.random.default_rng(rng.integers(1 << 62))
                    tg.start_soon(_round_trip, env, gpu, streams, child, tally, i)
                await anyio.sleep(0.01)
                victims.cancel_scope.cancel()
            for s in streams:
                closers.start_soon(s.aclose)  # closed while the next round runs


async def _close_under_load(env: aioep.Environment, tally: _Tally) -> None:
    """Copies in flight on two streams when the environment closes: it waits for them, and
    each lands bit-exact in its (pageable) destination."""
    gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
    rng = np.random.default_rng(7)
    streams = [env.create_sync_stream(gpu) for _ in range(2)]
    pending = []
    for i in range(40):
        data = _fresh(rng, int(rng.choice(SIZES)), str(rng.choice(DTYPES)))
        dev = env.empty(data.shape, data.dtype, gpu.memory_info(MemoryType.DEFAULT))
        out = np.empty_like(data)
        env.copy_tensors([data], [dev], stream=streams[i % 2])
        pending.append((env.copy_tensors([dev], [out], stream=streams[i % 2]), out, data))
        del dev
    for s in streams:
        await s.aclose()
    await env.aclose()
    for future, out, data in pending:
        assert future.done()
        future.result()
        if not _same_bits(out, data):
            tally.wrong.append("a copy in flight when its environment closed")
        tally.checked += 1


@pytest.mark.gpu
@needs_gpu
async def test_soak_many_tasks_streams_drops_cancels_and_closes(driver: Driver) -> None:
    tally = _Tally()
    rounds, tasks = (4, 120) if driver.kind == "emulator" else (4, 200)
    with _stacks_on_deadlock(STACKS_AFTER_S):
        with anyio.fail_after(SOAK_LIMIT_S):
            async with aioep.Environment(backends=["cuda"]) as first:
                second = await aioep.Environment(backends=["cuda"]).__aenter__()
                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(_load, first, 1, tally, rounds, tasks)
                        tg.start_soon(_load, second, 2, tally, 1, tasks // 2)
                    # `first` still has its streams closing; `second` closes under its own load
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(_load, first, 3, tally, 1, tasks // 2)
                        tg.start_soon(_close_under_load, second, tally)
                finally:
                    await second.aclose()
    assert tally.wrong == []
    expected = rounds * tasks + tasks // 2 + tasks // 2 + 40
    assert tally.checked == expected
    assert tally.abandoned_then_checked > 0
    assert tally.crossed > 0
    assert tally.dropped > 0


# -- the default wake: a bounded poll on the dispatcher thread, then the host function --------
class _Waiter:
    """A dispatcher check that is done once ``ready`` is set, counting its calls."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.finished = threading.Event()
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        if self.ready.is_set():
            self.finished.set()
            return True
        return False


def _until(predicate: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.001)


def test_a_hot_waiter_is_found_by_the_poll_without_any_post() -> None:
    d = Dispatcher(name="test-hot", idle_bound=60.0)
    try:
        w = _Waiter()
        w.ready.set()
        d.watch_ordered("s", w, poll_first=True)  # no host function will ever post
        assert w.finished.wait(10)
        _until(lambda: d.stats()["hot_done"] == 1, "the hot poll to count it")
        assert d.stats()["hot_expired"] == 0
    finally:
        d.close()


def test_the_poll_is_bounded_and_the_host_function_wakes_after_it() -> None:
    d = Dispatcher(name="test-expire", idle_bound=60.0, poll_budget=200e-6)
    try:
        w = _Waiter()
        d.watch_ordered("s", w, poll_first=True)
        _until(lambda: d.stats()["hot_expired"] == 1, "the poll budget to run out")
        assert d.stats()["hot_now"] == 0
        calls = w.calls
        time.sleep(0.05)
        assert w.calls == calls  # no poll after the budget: nothing spins
        assert not w.finished.is_set()
        w.ready.set()
        d.semaphore.post()  # what the waiter's host function does on the driver's thread
        assert w.finished.wait(10)
        assert d.stats()["hot_done"] == 0
    finally:
        d.close()


def test_without_poll_first_nothing_is_polled() -> None:
    d = Dispatcher(name="test-cold", idle_bound=60.0)
    try:
        w = _Waiter()
        d.watch_ordered("s", w)
        d.semaphore.post()  # the first scan: not ready
        _until(lambda: w.calls >= 1, "the first scan")
        calls = w.calls
        time.sleep(0.05)
        assert w.calls == calls
        assert d.stats()["hot_done"] == d.stats()["hot_expired"] == 0
        w.ready.set()
        d.semaphore.post()
        assert w.finished.wait(10)
    finally:
        d.close()


def test_the_hot_set_and_the_budget_are_capped() -> None:
    with pytest.raises(ValueError, match="poll_budget"):
        Dispatcher(poll_budget=1.0)
    d = Dispatcher(name="test-cap", idle_bound=60.0, hot_max=2, poll_budget=0.005)
    try:
        waiters = [_Waiter() for _ in range(5)]
        for w in waiters:
            d.watch_ordered("s", w, poll_first=True)
        assert d.stats()["hot_now"] <= 2
        for w in waiters:
            w.ready.set()
        d.semaphore.post()
        assert all(w.finished.wait(10) for w in waiters)
        _until(lambda: d.stats()["hot_now"] == 0, "the hot set to empty")
    finally:
        d.close()


def _dispatcher(stream: aioep.SyncStream) -> Dispatcher:
    dispatcher = stream.impl.dispatcher
    assert isinstance(dispatcher, Dispatcher)
    return dispatcher


@pytest.mark.gpu
@needs_gpu
async def test_default_wake_polls_short_copies_and_falls_back_for_long_ones(
    driver: Driver,
) -> None:
    emulator = driver.emulator
    async with aioep.Environment(backends=["cuda"]) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        small = np.arange(1024, dtype=np.int32)
        dev = env.empty(small.shape, small.dtype, gpu.memory_info(MemoryType.DEFAULT))
        out = np.empty_like(small)
        async with env.create_sync_stream(gpu) as stream:
            assert stream.impl.wake == "auto"
            stats = _dispatcher(stream).stats
            if emulator is not None:
                emulator.set("bandwidth", 0)  # short copies complete at once
                emulator.set("latency_ns", 0)
            for _ in range(50):
                env.copy_tensors([small], [dev], stream=stream)
                await env.copy_tensors([dev], [out], stream=stream)
                assert _same_bits(out, small)
            if emulator is not None:
                assert stats()["hot_done"] >= 1  # the poll woke some of them
            # A long copy (tens of ms): the poll gives up after its budget, the host
            # function wakes the awaiter.
            big = np.arange(64 << 20, dtype=np.uint8)
            if emulator is not None:
                emulator.set("bandwidth", 1_000_000_000)  # 64 MiB: 67 ms
            pinned = env.empty(big.shape, big.dtype, gpu.memory_info(MemoryType.HOST_ACCESSIBLE))
            pinned.numpy()[...] = big
            dev_big = env.empty(big.shape, big.dtype, gpu.memory_info(MemoryType.DEFAULT))
            expired = stats()["hot_expired"]
            await env.copy_tensors([pinned], [dev_big], stream=stream)
            assert stats()["hot_expired"] > expired
            back = np.empty_like(big)
            await env.copy_tensors([dev_big], [back], stream=stream)
            assert _same_bits(back, big)
        del dev, dev_big, pinned


@pytest.mark.gpu
@needs_gpu
async def test_hostfn_and_poll_wakes_never_poll_first(driver: Driver) -> None:
    for wake in ("hostfn", "poll"):
        async with aioep.Environment(
            backends=["cuda"], backend_options={"cuda": {"wake": wake}}
        ) as env:
            gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
            data = np.arange(4096, dtype=np.float64)
            dev = env.empty(data.shape, data.dtype, gpu.memory_info(MemoryType.DEFAULT))
            out = np.empty_like(data)
            async with env.create_sync_stream(gpu) as stream:
                for _ in range(10):
                    env.copy_tensors([data], [dev], stream=stream)
                    await env.copy_tensors([dev], [out], stream=stream)
                    assert _same_bits(out, data)
                stats = _dispatcher(stream).stats()
                assert stats["hot_done"] == stats["hot_expired"] == 0
            del dev


@pytest.mark.gpu
@needs_gpu
async def test_an_unstreamed_copy_of_pinned_memory_needs_no_worker_thread(driver: Driver) -> None:
    """Without a stream, pinned and device memory are copied on the transfer's own stream and
    woken by the dispatcher (no worker-thread hop); pageable memory still works."""
    async with aioep.Environment(backends=["cuda"]) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        data = np.arange(1 << 14, dtype=np.int64)
        pinned = env.empty(data.shape, data.dtype, gpu.memory_info(MemoryType.HOST_ACCESSIBLE))
        pinned.numpy()[...] = data
        dev = env.empty(data.shape, data.dtype, gpu.memory_info(MemoryType.DEFAULT))
        future = env.copy_tensors([pinned], [dev])
        assert type(future.notification.impl).__name__ == "CudaNotification"
        await future
        back = env.empty(data.shape, data.dtype, gpu.memory_info(MemoryType.HOST_ACCESSIBLE))
        await env.copy_tensors([dev], [back])
        assert _same_bits(back.numpy(), data)
        pageable = np.empty_like(data)
        await env.copy_tensors([dev], [pageable])  # the worker-thread path
        assert _same_bits(pageable, data)
        del pinned, dev, back, future  # a future holds its destinations
