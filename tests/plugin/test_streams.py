"""Streams, notifications and copy futures: the core semantics, on the host stream and on sim."""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from _factories import MakeEnv

import aioep
from aioep import DeviceType, MemoryType
from aioep.abc import EpFactory, HostNotification

pytestmark = pytest.mark.anyio


def sim_device(env: aioep.Environment, i: int = 0) -> aioep.EpDevice:
    return env.ep_devices(ep_name="SimExecutionProvider")[i]


def host_device(env: aioep.Environment) -> aioep.EpDevice:
    return env.ep_devices(device_type=DeviceType.CPU)[0]


def device_empty(env: aioep.Environment, dev: aioep.EpDevice, shape: Any, dtype: str = "int64"):
    return env.empty(shape, dtype, dev.memory_info(MemoryType.DEFAULT))


def gate() -> tuple[aioep.Notification, HostNotification]:
    """A notification that completes only when the test calls ``impl.set()``."""
    impl = HostNotification()
    return aioep.Notification(impl), impl


@pytest.fixture(params=["host", "sim"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def stream_device(env: aioep.Environment, kind: str) -> aioep.EpDevice:
    return host_device(env) if kind == "host" else sim_device(env)


# -- record / wait / await / done ------------------------------------------------------------


async def test_record_await_done(make_env: MakeEnv, kind: str) -> None:
    env = await make_env()
    async with env.create_sync_stream(stream_device(env, kind)) as stream:
        assert isinstance(stream.handle, int)
        assert stream.done()
        n = stream.record()
        assert isinstance(n, aioep.Notification)
        await n
        assert n.done()
        assert n.exception() is None
        await stream
        assert stream.done()
        assert "open" in repr(stream)
        assert "done" in repr(n)


async def test_gated_stream_is_not_done_until_the_gate_opens(make_env: MakeEnv, kind: str) -> None:
    env = await make_env()
    async with env.create_sync_stream(stream_device(env, kind)) as stream:
        g, impl = gate()
        stream.wait(g)
        n = stream.record()
        assert not n.done()
        assert not stream.done()
        assert "pending" in repr(n)
        impl.set()
        await n
        assert stream.done()


async def test_wait_on_already_done_notification_returns_at_once(
    make_env: MakeEnv, kind: str
) -> None:
    env = await make_env()
    dev = stream_device(env, kind)
    async with env.create_sync_stream(dev) as a, env.create_sync_stream(dev) as b:
        n = a.record()
        await n
        b.wait(n)
        n.wait_on_device(b)
        await b


async def test_wait_rejects_non_notifications(make_env: MakeEnv) -> None:
    env = await make_env()
    async with env.create_sync_stream(sim_device(env)) as s:
        with pytest.raises(aioep.InvalidArgument, match="Notification"):
            s.wait("nope")  # type: ignore[arg-type]


async def test_notification_activate_moves_the_mark(make_env: MakeEnv) -> None:
    env = await make_env()
    async with env.create_sync_stream(sim_device(env)) as s:
        n = s.record()
        await n
        g, impl = gate()
        s.wait(g)
        n.activate()  # now marks the point after the gated wait
        assert not n.done()
        impl.set()
        await n
        assert n.done()


# -- ordering ---------------------------------------------------------------------------------


async def test_ordering_within_a_stream(make_env: MakeEnv, kind: str) -> None:
    env = await make_env(latency_us=200)
    dev = stream_device(env, kind)
    buf = device_empty(env, dev, 64)
    outs = [np.zeros(64, np.int64) for _ in range(20)]
    async with env.create_sync_stream(dev) as s:
        for i, out in enumerate(outs):
            aioep.copy_tensors([np.full(64, i, np.int64)], [buf], stream=s)
            aioep.copy_tensors([buf], [out], stream=s)
        await s
    del buf
    for i, out in enumerate(outs):
        assert (out == i).all(), i


async def test_cross_stream_wait_orders_on_the_device(make_env: MakeEnv) -> None:
    # Stream A has a backlog of slow copies before it writes `buf`; B reads `buf` right
    # after waiting on A's copy. Without the device-side wait, B reads the old contents.
    env = await make_env(latency_us=3000)
    dev = sim_device(env)
    buf = device_empty(env, dev, 256)
    scratch = device_empty(env, dev, 256)
    await aioep.copy_tensors([np.zeros(256, np.int64)], [buf])
    data = np.arange(256, dtype=np.int64) + 7
    out = np.full(256, -1, np.int64)
    async with env.create_sync_stream(dev) as a, env.create_sync_stream(dev) as b:
        for _ in range(6):
            aioep.copy_tensors([np.ones(256, np.int64)], [scratch], stream=a)
        written = aioep.copy_tensors([data], [buf], stream=a)
        b.wait(written.notification)
        read = aioep.copy_tensors([buf], [out], stream=b)
        await read
        np.testing.assert_array_equal(out, data)  # stale (zeros) if b did not wait
        assert written.done()


async def test_dropped_wait_would_read_stale_data(make_env: MakeEnv) -> None:
    # The control for the test above, made deterministic with a gate: without b.wait(),
    # b's read runs while a is still held back, and sees the old contents.
    env = await make_env(latency_us=500)
    dev = sim_device(env)
    buf = device_empty(env, dev, 16)
    await aioep.copy_tensors([np.zeros(16, np.int64)], [buf])
    out_waited = np.full(16, -1, np.int64)
    out_stale = np.full(16, -1, np.int64)
    async with (
        env.create_sync_stream(dev) as a,
        env.create_sync_stream(dev) as b,
        env.create_sync_stream(dev) as c,
    ):
        g, impl = gate()
        a.wait(g)
        written = aioep.copy_tensors([np.full(16, 5, np.int64)], [buf], stream=a)
        b.wait(written.notification)
        waited = aioep.copy_tensors([buf], [out_waited], stream=b)
        await aioep.copy_tensors([buf], [out_stale], stream=c)  # no wait: stale
        assert not waited.done()
        impl.set()
        await waited
    del buf, written, waited
    assert (out_stale == 0).all()
    assert (out_waited == 5).all()


async def test_wait_on_an_unstreamed_copy(make_env: MakeEnv) -> None:
    env = await make_env(latency_us=2000)
    dev = sim_device(env)
    buf = device_empty(env, dev, 32)
    out = np.zeros(32, np.int64)
    fut = aioep.copy_tensors([np.arange(32, dtype=np.int64)], [buf])  # off the loop
    async with env.create_sync_stream(dev) as s:
        s.wait(fut.notification)
        await aioep.copy_tensors([buf], [out], stream=s)
    del buf, fut
    np.testing.assert_array_equal(out, np.arange(32))


async def test_many_streams_and_tasks_bit_exact(make_env: MakeEnv) -> None:
    env = await make_env(latency_us=50)
    devs = [sim_device(env, 0), sim_device(env, 1)]
    streams = [env.create_sync_stream(devs[i % 2]) for i in range(8)]
    rng = np.random.default_rng(0)
    failures: list[int] = []

    async def roundtrip(k: int) -> None:
        s = streams[k % len(streams)]
        other = devs[(k + 1) % 2]
        src = rng.integers(0, 2**62, size=97 + k, dtype=np.int64)
        d1 = device_empty(env, s.ep_device, src.shape)
        d2 = device_empty(env, other, src.shape)
        out = np.zeros_like(src)
        aioep.copy_tensors([src], [d1], stream=s)
        aioep.copy_tensors([d1], [d2], stream=s)
        await aioep.copy_tensors([d2], [out], stream=s)
        if not np.array_equal(out, src):
            failures.append(k)

    async with anyio.create_task_group() as tg:
        for k in range(200):
            tg.start_soon(roundtrip, k)
    for s in streams:
        await s.aclose()
    assert failures == []


# -- close ------------------------------------------------------------------------------------


async def test_aclose_waits_for_pending_work_and_then_refuses_use(
    make_env: MakeEnv, kind: str
) -> None:
    env = await make_env(latency_us=2000)
    dev = stream_device(env, kind)
    buf = device_empty(env, dev, 8)
    s = env.create_sync_stream(dev)
    fut = aioep.copy_tensors([np.arange(8, dtype=np.int64)], [buf], stream=s)
    n = s.record()
    await s.aclose()
    assert fut.done()
    assert n.done()
    assert s.closed
    assert "closed" in repr(s)
    await s.aclose()  # idempotent
    s.close()
    for use in (s.record, s.done, lambda: s.wait(n), lambda: n.activate()):
        with pytest.raises(aioep.ClosedError):
            use()
    with pytest.raises(aioep.ClosedError):
        await s
    with pytest.raises(aioep.ClosedError):
        aioep.copy_tensors([np.zeros(8, np.int64)], [buf], stream=s)
    with pytest.raises(aioep.ClosedError):
        async with s:
            pass


async def test_sync_close_waits_for_pending_work(make_env: MakeEnv) -> None:
    env = await make_env(latency_us=2000)
    dev = sim_device(env)
    buf = device_empty(env, dev, 8)
    s = dev.create_sync_stream()
    fut = aioep.copy_tensors([np.arange(8, dtype=np.int64)], [buf], stream=s)
    await anyio.to_thread.run_sync(s.close)
    assert fut.done()
    assert s.closed


async def test_aclose_is_shielded_from_cancellation(make_env: MakeEnv) -> None:
    env = await make_env(latency_us=3000)
    dev = sim_device(env)
    buf = device_empty(env, dev, 8)
    s = env.create_sync_stream(dev)
    fut = aioep.copy_tensors([np.arange(8, dtype=np.int64)], [buf], stream=s)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await s.aclose()
    assert s.closed
    assert fut.done()


async def test_stream_needs_a_stream_aware_factory() -> None:
    class NoStreams(EpFactory):
        name = "NoStreamsEP"
        vendor = "test"
        version = "1.0.0"

        def get_supported_devices(self, hardware: Any) -> list[aioep.EpDevice]:
            info = aioep.MemoryInfo(
                "NoStreams",
                aioep.MemoryDevice(DeviceType.NPU, MemoryType.DEFAULT, 0x77, 0),
            )
            hw = aioep.HardwareDevice(DeviceType.NPU, 0x77, 0, "test")
            return [aioep.EpDevice(self, hw, memory_infos={MemoryType.DEFAULT: info})]

        def create_allocator(self, memory_info: Any, options: Any) -> aioep.Allocator:
            from aioep_sim._allocator import PinnedAllocator

            return PinnedAllocator(memory_info)

    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("nostreams", NoStreams())
        with pytest.raises(aioep.NotImplementedByEp, match="does not support streams"):
            env.create_sync_stream(dev)


# -- waiting: timeouts, cancellation, threads -------------------------------------------------


async def test_fail_after_around_awaits_cancels_only_the_wait(make_env: MakeEnv, kind: str) -> None:
    env = await make_env()
    dev = stream_device(env, kind)
    buf = device_empty(env, dev, 16)
    out = np.zeros(16, np.int64)
    async with env.create_sync_stream(dev) as s:
        g, impl = gate()
        s.wait(g)
        aioep.copy_tensors([np.full(16, 3, np.int64)], [buf], stream=s)
        fut = aioep.copy_tensors([buf], [out], stream=s)
        n = s.record()
        for awaitable in (s, n, fut):
            with pytest.raises(TimeoutError):
                with anyio.fail_after(0.02):
                    await awaitable
        with anyio.move_on_after(0.01) as scope:
            await fut
        assert scope.cancelled_caught
        assert not fut.done()
        impl.set()  # the device work was never cancelled: it runs now
        assert (await fut)[0] is not None
        await n
        await s
    assert (out == 3).all()


async def test_cancel_scope_cancel_inside_wait(make_env: MakeEnv) -> None:
    env = await make_env()
    async with env.create_sync_stream(sim_device(env)) as s:
        g, impl = gate()
        s.wait(g)
        n = s.record()
        async with anyio.create_task_group() as tg:

            async def waiter(task_status: anyio.abc.TaskStatus[anyio.CancelScope]) -> None:
                with anyio.CancelScope() as scope:
                    task_status.started(scope)
                    await n
                    pytest.fail("the wait was not cancelled")

            scope = await tg.start(waiter)
            scope.cancel()
        impl.set()
        await n


async def test_asyncio_timeout_around_await(make_env: MakeEnv, anyio_backend: str) -> None:
    if anyio_backend != "asyncio":
        pytest.skip("asyncio.timeout is asyncio's own")
    import asyncio

    if not hasattr(asyncio, "timeout"):
        pytest.skip("asyncio.timeout needs Python 3.11")
    env = await make_env()
    async with env.create_sync_stream(sim_device(env)) as s:
        g, impl = gate()
        s.wait(g)
        n = s.record()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02):
                await n
        impl.set()
        await n


async def test_trio_cancel_scope_around_await(make_env: MakeEnv, anyio_backend: str) -> None:
    if anyio_backend != "trio":
        pytest.skip("trio only")
    import trio

    env = await make_env()
    async with env.create_sync_stream(sim_device(env)) as s:
        g, impl = gate()
        s.wait(g)
        n = s.record()
        with trio.move_on_after(0.02) as scope:
            await s
        assert scope.cancelled_caught
        impl.set()
        await n


async def test_sync_wait_with_timeout_from_a_plain_thread(make_env: MakeEnv) -> None:
    env = await make_env()
    dev = sim_device(env)
    buf = device_empty(env, dev, 16)
    async with env.create_sync_stream(dev) as s:
        g, impl = gate()
        s.wait(g)
        fut = aioep.copy_tensors([np.full(16, 9, np.int64)], [buf], stream=s)
        n = s.record()
        results: dict[str, Any] = {}

        def sync_code() -> None:
            try:
                for name, fn in (("n", lambda: n.wait(0.01)), ("f", lambda: fut.wait(0.01))):
                    try:
                        fn()
                    except TimeoutError as exc:
                        results[name] = exc
            finally:
                impl.set()  # whatever happened, the stream's work ends (the test fails, not hangs)
            n.wait(10)
            results["tensors"] = fut.wait(10)

        t = threading.Thread(target=sync_code)
        t.start()
        await anyio.to_thread.run_sync(t.join)
        assert isinstance(results["n"], TimeoutError)
        assert isinstance(results["f"], TimeoutError)
        assert results["tensors"][0] is buf
        assert fut.status is aioep.CopyStatus.DONE
        assert fut.result() == [buf]


def test_loop_detection_without_trios_in_trio_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """trio older than 0.27 (the lowest declared version) has no ``in_trio_run``: a trio run
    is still found on its thread, and a plain thread is still not one."""
    trio = pytest.importorskip("trio")
    from aioep._plugin.wake import runs_event_loop

    monkeypatch.delattr(trio.lowlevel, "in_trio_run", raising=False)
    found: dict[str, bool] = {}

    async def in_run() -> None:
        found["run"] = runs_event_loop()
        found["worker"] = await trio.to_thread.run_sync(runs_event_loop)

    trio.run(in_run)
    assert found == {"run": True, "worker": False}
    assert runs_event_loop() is False


async def test_blocking_wait_on_the_loop_thread_warns_only_while_pending(
    make_env: MakeEnv, anyio_backend: str
) -> None:
    """``Notification.wait()`` on the thread that runs the event loop (asyncio or trio)
    stalls the loop: a RuntimeWarning says to await instead, while the work is pending."""
    env = await make_env()
    async with env.create_sync_stream(sim_device(env)) as s:
        g, impl = gate()
        s.wait(g)
        n = s.record()
        try:
            with (
                pytest.warns(
                    RuntimeWarning, match=r"Notification .*wait\(\) blocks the event loop"
                ),
                pytest.raises(TimeoutError),
            ):
                n.wait(0.001)
            # A gate notification of no stream, too.
            with (
                pytest.warns(RuntimeWarning, match="use 'await' on it instead"),
                pytest.raises(TimeoutError),
            ):
                g.wait(0)
            # The same wait on a worker thread is the right tool: no warning (filterwarnings =
            # error would raise it there).
            with pytest.raises(TimeoutError):
                await anyio.to_thread.run_sync(n.wait, 0.001)
        finally:
            impl.set()  # (or the stream's close waits for the gate forever)
        await n
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            n.wait()  # done: nothing blocks, so no warning
            g.wait(0)


async def test_huge_finite_timeouts_wait_as_long_as_it_takes(make_env: MakeEnv) -> None:
    """``wait(timeout=1e300)`` (or an int past a float's range) on pending work waits like
    ``timeout=None``: threading would refuse it with an OverflowError."""
    env = await make_env()
    dev = sim_device(env)
    buf = device_empty(env, dev, 8)
    async with env.create_sync_stream(dev) as s:
        for timeout in (1e300, 10**400, threading.TIMEOUT_MAX * 2):
            g, impl = gate()
            s.wait(g)
            fut = aioep.copy_tensors([np.arange(8, dtype=np.int64)], [buf], stream=s)
            n = s.record()
            threading.Timer(0.02, impl.set).start()
            # On a worker thread (the place for a blocking wait), while the gate is shut.
            await anyio.to_thread.run_sync(n.wait, timeout)
            assert n.done()
            assert (await anyio.to_thread.run_sync(fut.wait, timeout)) == [buf]
            g, impl = gate()
            s.wait(g)
            fut = aioep.copy_tensors([np.arange(8, dtype=np.int64)], [buf], stream=s)
            threading.Timer(0.02, impl.set).start()
            assert (await anyio.to_thread.run_sync(fut.wait, timeout)) == [buf]
        for bad in (-1, float("nan"), -(10**400)):
            with pytest.raises(aioep.InvalidArgument, match="timeout must be >= 0"):
                n.wait(bad)
            with pytest.raises(aioep.InvalidArgument, match="timeout must be >= 0"):
                fut.wait(bad)


async def test_aioeps_own_blocking_paths_do_not_warn_on_the_loop_thread(
    anyio_backend: str,
) -> None:
    """``SyncStream.close()`` and ``Environment.close()`` block on purpose (they are the
    synchronous forms): called on the loop's thread with work pending (behind a gate that a
    timer opens), they wait without the warning, and without skipping the wait."""
    from aioep_sim import SimFactory

    env = aioep.Environment(autoload=False).open()
    try:
        (dev,) = env.register_library("sim", SimFactory)[:1]
        buf = device_empty(env, dev, 8)
        s = dev.create_sync_stream()
        g, impl = gate()
        s.wait(g)
        fut = aioep.copy_tensors([np.arange(8, dtype=np.int64)], [buf], stream=s)
        threading.Timer(0.05, impl.set).start()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s.close()  # waits for the gate, then the copy
        assert [str(w.message) for w in caught] == []
        assert fut.done()
        assert s.closed

        s = dev.create_sync_stream()
        g, impl = gate()
        s.wait(g)
        fut = aioep.copy_tensors([np.arange(8, dtype=np.int64)], [buf], stream=s)
        threading.Timer(0.05, impl.set).start()
    finally:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            env.close()  # waits for the copy in flight, then closes the stream
    assert [str(w.message) for w in caught] == []
    assert fut.done()
    assert fut.exception() is None
    assert s.closed
    del buf


async def test_aclose_waits_for_work_enqueued_meanwhile_before_releasing(make_env: MakeEnv) -> None:
    # Releasing a sim stream joins its worker thread: that must find it idle, or the
    # join would run the late work on the event loop.
    env = await make_env(latency_us=30_000)
    dev = sim_device(env)
    x = device_empty(env, dev, (4,))
    src = np.arange(4, dtype=np.int64)
    s = env.create_sync_stream(dev)
    idle_at_release: list[bool | None] = []
    impl = s.impl
    real_close = impl.close

    def close() -> None:
        idle_at_release.append(impl.query())
        real_close()

    impl.close = close  # type: ignore[method-assign]
    aioep.copy_tensors([src], [x], stream=s)
    late: list[aioep.CopyFuture] = []

    async def enqueue_while_closing() -> None:
        await anyio.lowlevel.checkpoint()  # aclose is now waiting for the first copy
        late.append(aioep.copy_tensors([src + 1], [x], stream=s))

    async with anyio.create_task_group() as tg:
        tg.start_soon(s.aclose)
        tg.start_soon(enqueue_while_closing)
    assert s.closed
    assert late[0].done()
    assert idle_at_release == [True]
    out = np.zeros(4, np.int64)
    await aioep.copy_tensors([x], [out])
    np.testing.assert_array_equal(out, src + 1)


async def test_strided_sources_are_packed_on_the_stream_in_order(
    make_env: MakeEnv, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aioep._plugin.transfer import PACK_INLINE_BYTES, CopyPlan

    packed_on: list[int] = []
    real_pack = CopyPlan.pack

    def pack(self: CopyPlan) -> None:
        packed_on.append(threading.get_ident())
        real_pack(self)

    monkeypatch.setattr(CopyPlan, "pack", pack)
    env = await make_env()
    dev = stream_device(env, kind)
    n = 2 * PACK_INLINE_BYTES
    a = np.arange(2 * n, dtype=np.uint8)
    x = device_empty(env, dev, (n,), "uint8")
    out = np.zeros(n, np.uint8)
    async with env.create_sync_stream(dev) as s:
        g, impl = gate()
        s.wait(g)  # the stream is held: the pack must wait its turn, like the copy
        aioep.copy_tensors([a[::2]], [x], stream=s)
        expected = a[::2].copy()
        # Changing a source before its copy completes is a user error; here it shows that
        # the source was read at the stream's turn, not when the copy was enqueued.
        a[::2] = 7
        expected[:] = 7
        fut = aioep.copy_tensors([x], [out], stream=s)
        assert packed_on == []
        impl.set()
        await fut
    np.testing.assert_array_equal(out, expected)
    assert len(packed_on) == 1
    assert threading.get_ident() not in packed_on


async def test_thousand_awaiters_do_not_make_a_thousand_threads(make_env: MakeEnv) -> None:
    env = await make_env()
    async with env.create_sync_stream(sim_device(env)) as s:
        g, impl = gate()
        s.wait(g)
        notes = [s.record() for _ in range(1000)]
        before = threading.active_count()
        woken = 0

        async def waiter(n: aioep.Notification) -> None:
            nonlocal woken
            await n
            woken += 1

        async with anyio.create_task_group() as tg:
            for n in notes:
                tg.start_soon(waiter, n)
            await anyio.wait_all_tasks_blocked()
            assert threading.active_count() <= before + 2
            assert woken == 0
            impl.set()
        assert woken == 1000


async def test_a_pure_host_notification_wakes_a_task_from_another_thread() -> None:
    n, impl = gate()
    timer = threading.Timer(0.01, impl.set)
    timer.start()
    with anyio.fail_after(10):
        await n
    timer.join()


# -- keepalive ---------------------------------------------------------------------------------


async def test_buffers_live_until_the_stream_passes_the_copy(make_env: MakeEnv) -> None:
    env = await make_env()
    dev = sim_device(env)
    async with env.create_sync_stream(dev) as s:
        g, impl = gate()
        s.wait(g)
        src = np.arange(1024, dtype=np.int64)
        dst = device_empty(env, dev, 1024)
        refs = [weakref.ref(src), weakref.ref(dst), weakref.ref(dst.buffer)]
        fut = aioep.copy_tensors([src], [dst], stream=s)
        with pytest.raises(aioep.InUseError):
            dst.buffer.free()  # pinned while the copy is in flight
        note = fut.notification
        del src, dst, fut
        gc.collect()
        assert all(r() is not None for r in refs)
        impl.set()
        await s
        await note
        assert note.exception() is None
        gc.collect()
        assert all(r() is None for r in refs)


async def test_cancelled_awaiter_does_not_cancel_the_copy(make_env: MakeEnv) -> None:
    env = await make_env(latency_us=2000)
    dev = sim_device(env)
    out = np.zeros(64, np.int64)
    async with env.create_sync_stream(dev) as s:

        async def copier() -> None:
            buf = device_empty(env, dev, 64)
            aioep.copy_tensors([np.full(64, 4, np.int64)], [buf], stream=s)
            await aioep.copy_tensors([buf], [out], stream=s)

        with anyio.move_on_after(0.001):
            await copier()
        alloc = env.get_shared_allocator(dev.memory_info(MemoryType.DEFAULT))
        assert alloc is not None
        await s
        gc.collect()
        assert alloc.live_buffers == 0
    assert (out == 4).all()


async def test_cancellation_storm(make_env: MakeEnv) -> None:
    # 1000 tasks start copies then get cancelled mid-copy and drop every reference:
    # no buffer may be freed while a stream still uses it (the sim never reuses device
    # addresses, so a freed one would fail the copy as an illegal address).
    env = await make_env(latency_us=20)
    devs = [sim_device(env, 0), sim_device(env, 1)]
    streams = [env.create_sync_stream(devs[i % 2]) for i in range(4)]
    g, impl = gate()
    for s in streams:
        s.wait(g)  # hold the streams back so every copy is in flight at the cancel
    outs: list[tuple[int, np.ndarray]] = []
    notes: list[aioep.Notification] = []
    started = 0
    all_started = anyio.Event()

    async def task(k: int) -> None:
        nonlocal started
        s = streams[k % len(streams)]
        buf = device_empty(env, s.ep_device, 16)
        out = np.zeros(16, np.int64)
        outs.append((k, out))
        aioep.copy_tensors([np.full(16, k, np.int64)], [buf], stream=s)
        fut = aioep.copy_tensors([buf], [out], stream=s)
        notes.append(fut.notification)
        started += 1
        if started == 1000:
            all_started.set()
        await fut

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for k in range(1000):
                tg.start_soon(task, k)
            await all_started.wait()
            assert not any(n.done() for n in notes)
            tg.cancel_scope.cancel()
        gc.collect()
        impl.set()
        for s in streams:
            await s.aclose()
    assert all(n.done() and n.exception() is None for n in notes)
    for k, out in outs:
        assert (out == k).all(), k
    gc.collect()
    for dev in devs:
        alloc = env.get_shared_allocator(dev.memory_info(MemoryType.DEFAULT))
        assert alloc is not None
        assert alloc.live_buffers == 0


# -- errors ------------------------------------------------------------------------------------


async def test_device_errors_land_on_the_right_futures_only(make_env: MakeEnv) -> None:
    env = await make_env(fail_after_copies=2, latency_us=100)
    dev = sim_device(env)
    buf = device_empty(env, dev, 8)
    async with env.create_sync_stream(dev) as s:
        futs = [aioep.copy_tensors([np.full(8, i, np.int64)], [buf], stream=s) for i in range(5)]
        for i, fut in enumerate(futs):
            if i == 2:
                with pytest.raises(aioep.DeviceError, match="injected failure of copy 3"):
                    await fut
                assert fut.status is aioep.CopyStatus.FAILED
                assert isinstance(fut.exception(), aioep.DeviceError)
                assert isinstance(fut.notification.exception(), aioep.DeviceError)
            else:
                await fut
                assert fut.exception() is None
        await s  # the stream keeps working
        out = np.zeros(8, np.int64)
        await aioep.copy_tensors([buf], [out], stream=s)
    assert (out == 4).all()


async def test_device_error_on_an_idle_stream_fast_path(make_env: MakeEnv) -> None:
    # No latency: small copies run inline on an idle stream; the error must still land
    # on that copy's future alone.
    env = await make_env(fail_after_copies=0)
    dev = sim_device(env)
    buf = device_empty(env, dev, 8)
    async with env.create_sync_stream(dev) as s:
        bad = aioep.copy_tensors([np.ones(8, np.int64)], [buf], stream=s)
        good = aioep.copy_tensors([np.ones(8, np.int64)], [buf], stream=s)
        with pytest.raises(aioep.DeviceError):
            await bad
        await good
        await s


async def test_sync_wait_raises_device_error(make_env: MakeEnv) -> None:
    env = await make_env(fail_after_copies=0, latency_us=100)
    dev = sim_device(env)
    buf = device_empty(env, dev, 8)
    async with env.create_sync_stream(dev) as s:
        fut = aioep.copy_tensors([np.ones(8, np.int64)], [buf], stream=s)
        with pytest.raises(aioep.DeviceError):
            await anyio.to_thread.run_sync(fut.wait, 10)
        with pytest.raises(aioep.DeviceError):
            fut.notification.wait(10)


async def test_superseded_mark_does_not_swallow_an_error(make_env: MakeEnv) -> None:
    env = await make_env(fail_after_copies=0)
    dev = sim_device(env)
    buf = device_empty(env, dev, 8)
    async with env.create_sync_stream(dev) as s:
        g, impl = gate()
        s.wait(g)
        fut = aioep.copy_tensors([np.ones(8, np.int64)], [buf], stream=s)
        n = fut.notification
        n.activate()  # re-activate before the stream reached the first mark
        impl.set()
        with pytest.raises(aioep.DeviceError):
            await n


# -- host stream -------------------------------------------------------------------------------


async def test_host_stream_copies_in_order() -> None:
    async with aioep.Environment(autoload=False) as env:
        dev = host_device(env)
        async with env.create_sync_stream(dev) as s:
            a = np.arange(100_000, dtype=np.float64)
            b = np.empty_like(a)
            c = np.empty_like(a)
            aioep.copy_tensors([a], [b], stream=s)
            fut = aioep.copy_tensors([b], [c], stream=s)
            (out,) = await fut
            assert out.numpy() is not None
            np.testing.assert_array_equal(c, a)


def test_thread_stream_refuses_work_after_close_with_closed_error() -> None:
    from aioep.abc import ThreadStream

    stream = ThreadStream("closed-test")
    stream.close()
    with pytest.raises(aioep.ClosedError, match="closed-test"):
        stream.enqueue(lambda: None)
