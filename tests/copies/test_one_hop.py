"""One hop per completion: the thread that finishes a copy wakes the awaiting loop itself,
once per batch of completions; small host work runs inline within the inline budget; an
idle stream is awaited without recording anything."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np
import pytest
from _factories import FAKE_INFO, FakeGpuFactory, MakeEnv, RecordingTransfer

import aioep
from aioep.abc import CopyPair, DataTransfer, HostNotification, NotificationImpl, StreamImpl

pytestmark = pytest.mark.anyio


def _copy_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aioep-copy")]


# -- one wake-up per completion, from the thread that finished the work ----------------------


async def test_a_streamed_copy_wakes_the_loop_once_from_the_stream_worker(
    make_env: MakeEnv, wakeups: list[str]
) -> None:
    env = await make_env(num_devices=1, bandwidth_gbps=1000)  # worker path: never inline
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    dst = env.empty(1024, "float32", dev.memory_info(aioep.MemoryType.DEFAULT))
    src = np.arange(1024, dtype=np.float32)
    back = np.zeros_like(src)
    async with env.create_sync_stream(dev) as stream:
        wakeups.clear()
        for i in range(10):
            src[0] = i
            await aioep.copy_tensors([src], [dst], stream=stream)
            await aioep.copy_tensors([dst], [back], stream=stream)
            assert back[0] == i
        # One wake-up per awaited copy, each scheduled by the stream's own worker thread.
        assert len(wakeups) == 20
        assert all(name.startswith("sim:0/stream-") for name in wakeups), wakeups
    del dst


async def test_an_unstreamed_sim_copy_wakes_the_loop_once_without_a_copy_worker(
    make_env: MakeEnv, wakeups: list[str]
) -> None:
    env = await make_env(num_devices=1, bandwidth_gbps=1000)
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    dst = env.empty(4096, "uint8", dev.memory_info(aioep.MemoryType.DEFAULT))
    src = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    back = np.zeros_like(src)
    wakeups.clear()
    for _ in range(5):
        await aioep.copy_tensors([src], [dst])
        await aioep.copy_tensors([dst], [back])
    np.testing.assert_array_equal(back, src)
    assert len(wakeups) == 10
    # The sim's own stream runs the copy and wakes the loop: no copy worker in between.
    assert all(name.startswith("sim:0/stream-") for name in wakeups), wakeups
    assert not _copy_threads()
    del dst


async def test_unstreamed_sim_copies_stay_parallel(
    make_env: MakeEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aioep_sim._transfer import SimDataTransfer

    env = await make_env(num_devices=1, latency_us=1)
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    info = dev.memory_info(aioep.MemoryType.DEFAULT)
    slow_dst, fast_dst = env.empty(64, "uint8", info), env.empty(64, "uint8", info)
    release = threading.Event()
    real_run = SimDataTransfer._run
    stuck_at = slow_dst.data_ptr

    def run(self: SimDataTransfer, pairs: list[CopyPair]) -> None:
        if pairs[0][1].data_ptr == stuck_at:
            assert release.wait(10)  # one user's copy stuck on the device
        real_run(self, pairs)

    monkeypatch.setattr(SimDataTransfer, "_run", run)
    slow = aioep.copy_tensors([np.ones(64, np.uint8)], [slow_dst])
    # Another user's copy is not queued behind it: it completes while the first is stuck.
    with anyio.fail_after(10):
        await aioep.copy_tensors([np.full(64, 7, np.uint8)], [fast_dst])
    assert not slow.done()
    release.set()
    with anyio.fail_after(10):
        await slow
    back = np.zeros(64, np.uint8)
    await aioep.copy_tensors([fast_dst], [back])
    assert (back == 7).all()
    del slow_dst, fast_dst, slow


async def test_completions_that_arrive_together_share_one_wake_up(wakeups: list[str]) -> None:
    marks = [HostNotification() for _ in range(50)]
    woken: list[int] = []

    async def waiter(i: int) -> None:
        await aioep.Notification(marks[i])
        woken.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(len(marks)):
            tg.start_soon(waiter, i)
        await anyio.sleep(0.01)  # every waiter is parked on its notification
        wakeups.clear()
        # A worker completes all of them while the loop is busy (here: blocked on purpose).
        worker = threading.Thread(target=lambda: [m.set() for m in marks], name="completer")
        worker.start()
        worker.join()
    assert sorted(woken) == list(range(50))
    assert wakeups == ["completer"]


async def test_a_stream_passing_many_marks_at_once_wakes_the_loop_once_per_batch(
    make_env: MakeEnv, wakeups: list[str]
) -> None:
    env = await make_env(num_devices=1)
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    async with env.create_sync_stream(dev) as stream:
        gate = HostNotification()
        stream.wait(aioep.Notification(gate))
        marks = [stream.record() for _ in range(40)]
        done: list[int] = []
        all_done = anyio.Event()

        async def waiter(i: int) -> None:
            await marks[i]
            done.append(i)
            if len(done) == len(marks):
                all_done.set()

        async with anyio.create_task_group() as tg:
            for i in range(len(marks)):
                tg.start_soon(waiter, i)
            await anyio.sleep(0.01)
            wakeups.clear()
            gate.set()  # the worker passes 40 marks in a row
            with anyio.fail_after(10):
                await all_done.wait()
        # Far fewer wake-ups than completions: they ride along with the batch in flight.
        assert 1 <= len(wakeups) < len(marks) // 2, wakeups


# -- the inline budget in the copy path ------------------------------------------------------


class _SlowInlineTransfer(RecordingTransfer):
    """Host memcpys that say they may run inline, each preceded by ``cost`` s of CPU work."""

    cost = 0.0
    threads: list[int]

    def __init__(self, owner: str) -> None:
        super().__init__(owner)
        self.threads = []

    def can_copy_inline(self, pairs: Sequence[CopyPair]) -> bool:
        return True

    def copy_tensors(self, pairs: Sequence[CopyPair], stream: StreamImpl | None) -> None:
        if stream is None:
            self.threads.append(threading.get_ident())
            end = time.thread_time() + self.cost
            while time.thread_time() < end:
                pass
        super().copy_tensors(pairs, stream)


class _SlowInlineFactory(FakeGpuFactory):
    def create_data_transfer(self) -> DataTransfer:
        return _SlowInlineTransfer(self.tag)


def _transfer(env: aioep.Environment) -> _SlowInlineTransfer:
    (transfer,) = [t for n, t in env._transfers if isinstance(t, _SlowInlineTransfer)]
    return transfer


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_copy_kind_over_budget_runs_inline_once_then_off_the_loop(
    streamed: bool,
) -> None:
    async with aioep.Environment(autoload=False, inline_budget_us=200) as env:
        env.register_library("slow", _SlowInlineFactory)
        (dev,) = env.ep_devices(ep_name="FakeGpuExecutionProvider")
        transfer = _transfer(env)
        transfer.cost = 600e-6  # three times the budget, every time
        dst = env.empty(256, "uint8", FAKE_INFO)
        src = np.arange(256, dtype=np.uint8)
        loop_thread = threading.get_ident()
        async with env.create_sync_stream(dev) as stream:
            for i in range(12):
                src[0] = i
                await aioep.copy_tensors([src], [dst], stream if streamed else None)
                check = np.zeros_like(src)
                await aioep.copy_tensors([dst], [check], stream if streamed else None)
                assert check[0] == i
        on_loop = [t for t in transfer.threads if t == loop_thread]
        # Each direction is its own kind: each ran on the loop once, overran, and left it.
        assert len(transfer.threads) == 24
        assert len(on_loop) == 2
        assert env.inline_budget.overruns == 2
        del dst


async def test_cheap_copies_run_inline_within_the_budget() -> None:
    async with aioep.Environment(autoload=False, inline_budget_us=1000) as env:
        env.register_library("slow", _SlowInlineFactory)
        transfer = _transfer(env)
        dst = env.empty(256, "uint8", FAKE_INFO)
        for _ in range(5):
            fut = aioep.copy_tensors([np.ones(256, np.uint8)], [dst])
            assert fut.done()  # copied before copy_tensors returned
            await fut
        assert set(transfer.threads) == {threading.get_ident()}
        del dst, fut


async def test_a_zero_budget_runs_nothing_inline(make_env: MakeEnv) -> None:
    async with aioep.Environment(autoload=False, inline_budget_us=0) as env:
        src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
        fut = env.copy_tensors([src], [dst])
        await fut
        assert dst.tolist() == src.tolist()
        assert env.inline_budget.inline_runs == 0
        assert _copy_threads()  # it went to a copy worker


# -- results are bit-exact whatever path a copy takes, through cancellation -----------------


@pytest.mark.parametrize("options", [{}, {"bandwidth_gbps": 1000}, {"latency_us": 200}])
async def test_copies_are_bit_exact_when_their_awaits_are_cancelled(
    make_env: MakeEnv, options: dict[str, Any]
) -> None:
    env = await make_env(num_devices=1, **options)
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    info = dev.memory_info(aioep.MemoryType.DEFAULT)
    rng = np.random.default_rng(7)
    sizes = [1, 100, 4096, 70_000, 1 << 20]
    sources = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    on_device = [env.empty(n, "uint8", info) for n in sizes]
    async with env.create_sync_stream(dev) as stream:
        for streamed in (None, stream):
            futures = []
            for s, d in zip(sources, on_device):
                fut = aioep.copy_tensors([s.copy()], [d], streamed)  # its source: a temporary
                with anyio.CancelScope() as scope:
                    scope.cancel()  # the await is cancelled at once: the copy goes on
                    await fut
                futures.append(fut)
            gc.collect()
            # Copies without a stream are not ordered before later ones: let these finish
            # before reading back.
            for fut in futures:
                await fut
            del futures, fut
            outs = [np.zeros_like(s) for s in sources]
            futs = [aioep.copy_tensors([d], [o], streamed) for d, o in zip(on_device, outs)]
            for f in futs:
                await f
            for s, o in zip(sources, outs):
                assert o.tobytes() == s.tobytes()
    del on_device


# -- awaiting an idle stream records nothing --------------------------------------------------


def _count_records(impl: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    made: list[int] = []
    real = impl.create_notification

    def create_notification() -> NotificationImpl:
        made.append(1)
        return real()  # type: ignore[no-any-return]

    monkeypatch.setattr(impl, "create_notification", create_notification)
    return made


async def test_awaiting_an_idle_stream_records_nothing(
    make_env: MakeEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = await make_env(num_devices=1, bandwidth_gbps=1000)
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    dst = env.empty(16, "uint8", dev.memory_info(aioep.MemoryType.DEFAULT))
    async with env.create_sync_stream(dev) as stream:
        await aioep.copy_tensors([np.ones(16, np.uint8)], [dst], stream=stream)
        made = _count_records(stream.impl, monkeypatch)
        for _ in range(5):
            await stream
            await stream.synchronize()
        assert made == []
        # Work in flight: the await records a mark and waits for it.
        gate = HostNotification()
        stream.wait(aioep.Notification(gate))
        threading.Timer(0.02, gate.set).start()
        await stream
        assert made == [1]
    del dst


async def test_a_failure_since_the_last_mark_still_raises_on_an_idle_stream(
    make_env: MakeEnv,
) -> None:
    env = await make_env(num_devices=1)
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    async with env.create_sync_stream(dev) as stream:

        def fail() -> None:
            raise aioep.DeviceError("kernel fault")

        stream.impl.enqueue(fail)  # type: ignore[attr-defined]
        with anyio.fail_after(10):
            # Poll the stream's own state: the point is to await it once it is idle.
            while not stream.done():  # noqa: ASYNC110
                await anyio.sleep(0.001)
        assert not stream.impl.settled()  # idle, but a failure waits for the next mark
        with pytest.raises(aioep.DeviceError, match="kernel fault"):
            await stream
        await stream  # reported once, to the mark that reached it


async def test_a_lost_device_still_raises_on_an_idle_stream(make_env: MakeEnv) -> None:
    env = await make_env(num_devices=1, lose_device_after_copies=0)
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    dst = env.empty(16, "uint8", dev.memory_info(aioep.MemoryType.DEFAULT))
    async with env.create_sync_stream(dev) as stream:
        with pytest.raises(aioep.DeviceError, match="lost"):
            await aioep.copy_tensors([np.ones(16, np.uint8)], [dst], stream=stream)
        assert stream.done()
        for _ in range(2):  # idle, but the device is gone: every await says so
            with pytest.raises(aioep.DeviceError, match="lost"):
                await stream
    del dst


class _Done(NotificationImpl):
    def activate(self) -> None:
        pass

    def wait_on_device(self, stream: StreamImpl) -> None:
        pass

    def query(self) -> bool:
        return True


class _OpaqueStream(StreamImpl):
    """A backend stream that cannot say whether it is idle (query() is None)."""

    def __init__(self) -> None:
        self.records = 0

    def create_notification(self) -> NotificationImpl:
        self.records += 1
        return _Done()

    def close(self) -> None:
        pass


async def test_a_stream_that_cannot_query_keeps_the_recording_path() -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.ep_devices(ep_name="host")
        impl = _OpaqueStream()
        stream = aioep.SyncStream(impl, dev)
        for _ in range(3):
            await stream
        assert impl.records == 3


async def test_an_await_returns_once_the_done_callbacks_ran(make_env: MakeEnv) -> None:
    env = await make_env(num_devices=1, bandwidth_gbps=1000)
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    dst = env.empty(16, "uint8", dev.memory_info(aioep.MemoryType.DEFAULT))
    async with env.create_sync_stream(dev) as stream:
        gate = HostNotification()
        stream.wait(aioep.Notification(gate))
        fut = aioep.copy_tensors([np.ones(16, np.uint8)], [dst], stream=stream)
        release = threading.Event()
        ran: list[str] = []

        def slow_callback(_: aioep.CopyFuture) -> None:
            assert release.wait(10)
            ran.append("callback")

        fut.add_done_callback(slow_callback)
        gate.set()
        with anyio.fail_after(10):
            while not fut.done():  # noqa: ASYNC110 - the copy completes; its callback waits
                await anyio.sleep(0.001)
        # Done, but its callback still runs on the stream's worker: the await waits for it.
        with anyio.move_on_after(0.1) as scope:
            await fut
        assert scope.cancelled_caught
        release.set()
        with anyio.fail_after(10):
            await fut
        assert ran == ["callback"]
        del fut
    del dst


class _Polled(NotificationImpl):
    """A notification that cannot call back: done once queried a few times."""

    def __init__(self) -> None:
        self.queries = 0

    def activate(self) -> None:
        pass

    def wait_on_device(self, stream: StreamImpl) -> None:
        pass

    def query(self) -> bool:
        self.queries += 1
        return self.queries > 3


class _PolledTransfer(RecordingTransfer):
    def enqueue_unstreamed(self, pairs: Sequence[CopyPair]) -> NotificationImpl | None:
        self.copy_tensors(pairs, None)  # a memmove: the "device" finishes it at once
        return _Polled()


class _PolledFactory(FakeGpuFactory):
    def create_data_transfer(self) -> DataTransfer:
        return _PolledTransfer(self.tag)


async def test_a_copy_whose_notification_cannot_call_back_is_awaited_by_polling() -> None:
    async with aioep.Environment(autoload=False) as env:
        env.register_library("polled", _PolledFactory)
        dst = env.empty(64, "uint8", FAKE_INFO)
        with anyio.fail_after(10):
            await aioep.copy_tensors([np.full(64, 3, np.uint8)], [dst])
            back = np.zeros(64, np.uint8)
            await aioep.copy_tensors([dst], [back])
        assert (back == 3).all()
        del dst
