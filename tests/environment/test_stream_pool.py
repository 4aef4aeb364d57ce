"""``env.pooled_stream``: a bounded set of streams per device, shared round-robin by requests,
with each request's device errors kept to itself; closed by the environment only."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import AsyncExitStack

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from _factories import EVENTS, FakeGpuFactory, MakeEnv

import aioep
from aioep import InUseError, InvalidArgument, MemoryType
from aioep.abc import HostNotification, StreamImpl, ThreadStream

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _clear_events() -> Iterator[None]:
    EVENTS.clear()
    yield
    EVENTS.clear()


def sim_device(env: aioep.Environment) -> aioep.EpDevice:
    return env.ep_devices(ep_name="SimExecutionProvider")[0]


def device_empty(env: aioep.Environment, dev: aioep.EpDevice, n: int) -> aioep.Tensor:
    info = dev.memory_info(MemoryType.DEFAULT)
    assert info is not None
    return env.empty(n, np.int64, info)


def sim_threads() -> list[threading.Thread]:
    """The sim's stream worker threads alive now (named ``sim:<device>/stream-<n>``)."""
    return [t for t in threading.enumerate() if t.name.startswith("sim:")]


async def sim_env(pool: int, **options: object) -> aioep.Environment:
    env = await aioep.Environment(autoload=False, stream_pool_size=pool).__aenter__()
    env.register_library("sim", "aioep_sim:SimFactory", {"num_devices": 1, **options})
    return env


# -- lending ---------------------------------------------------------------------------------


async def test_borrowers_share_the_pool_round_robin() -> None:
    env = await sim_env(pool=2)
    try:
        dev = sim_device(env)
        async with AsyncExitStack() as held:
            lent = [await held.enter_async_context(env.pooled_stream(dev)) for _ in range(5)]
            a, b = lent[0], lent[1]
            assert a is not b
            assert lent == [a, b, a, b, a]
            assert all(isinstance(s, aioep.SyncStream) and s.ep_device is dev for s in lent)
            assert "lent to 3" in repr(a)
            assert "lent to 2" in repr(b)
        # Given back: a lone borrower takes a stream no one holds; the pool makes no more.
        for _ in range(3):
            async with env.pooled_stream(dev) as s:
                assert s in (a, b)
                assert not s.closed
        # Each device has its own pool.
        (other, *_) = env.register_library("sim2", "aioep_sim:SimFactory", {"num_devices": 1})
        async with env.pooled_stream(other) as c:
            assert c not in (a, b)
            assert c.ep_device is other
    finally:
        await env.aclose()


async def test_a_thousand_concurrent_requests_use_only_the_pool_s_threads() -> None:
    env = await sim_env(pool=4)
    try:
        dev = sim_device(env)
        requests = 1000
        inside = [0, 0]  # borrowers inside their block now, the most sim threads seen meanwhile
        all_in = anyio.Event()
        handles: set[int] = set()
        outs: dict[int, np.ndarray] = {}

        async def request(i: int) -> None:
            async with env.pooled_stream(dev) as stream:
                handles.add(stream.handle)
                inside[0] += 1
                if inside[0] == requests:
                    all_in.set()
                await all_in.wait()  # every request holds a stream at once
                inside[1] = max(inside[1], len(sim_threads()))
                x = device_empty(env, dev, 4)
                out = np.zeros(4, np.int64)
                env.copy_tensors([np.full(4, i, np.int64)], [x], stream)
                await env.copy_tensors([x], [out], stream)
                outs[i] = out
                del x

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i in range(requests):
                    tg.start_soon(request, i)
        assert len(handles) == 4
        assert inside[1] == 4, "the sim ran a thread per stream: as many as the pool's streams"
        assert all((outs[i] == i).all() for i in range(requests))
    finally:
        await env.aclose()


async def test_a_cancelled_borrower_gives_its_stream_back() -> None:
    env = await sim_env(pool=1)
    try:
        dev = sim_device(env)
        with anyio.CancelScope() as scope:
            async with env.pooled_stream(dev) as stream:
                scope.cancel()
                await anyio.sleep_forever()
        assert "lent to 0" in repr(stream)
        env.unregister_library("sim")  # nothing lent: the idle pool closes
        assert stream.closed
    finally:
        await env.aclose()


async def test_a_lease_is_entered_once_at_a_time() -> None:
    env = await sim_env(pool=1)
    try:
        lease = env.pooled_stream(sim_device(env))
        async with lease as stream:
            with pytest.raises(InUseError, match="already holds"):
                await lease.__aenter__()
        async with lease as again:  # given back: the lease may borrow again
            assert again is stream
    finally:
        await env.aclose()


class _SlowStreams(FakeGpuFactory):
    """Makes a stream only once the test lets it (a driver may wait in cuStreamCreate)."""

    name = "SlowStreamsExecutionProvider"

    def __init__(self, options: object = None) -> None:
        super().__init__({"tag": "slow"})
        self.go = threading.Event()
        self.called = threading.Event()
        self.threads: list[threading.Thread] = []

    def create_sync_stream(self, memory_device: aioep.MemoryDevice, options: object) -> StreamImpl:
        self.threads.append(threading.current_thread())
        self.called.set()
        self.go.wait(30)
        return super().create_sync_stream(memory_device, None)


async def test_streams_are_made_off_the_event_loop_once_per_place() -> None:
    env = await aioep.Environment(autoload=False, stream_pool_size=1).__aenter__()
    try:
        factory = _SlowStreams()
        (dev,) = env.register_library("slow", factory)
        got: list[aioep.SyncStream] = []
        entered = anyio.Event()

        async def borrower() -> None:
            async with env.pooled_stream(dev) as stream:
                got.append(stream)
                if len(got) == 2:
                    entered.set()
                await entered.wait()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(borrower)
                tg.start_soon(borrower)
                await anyio.to_thread.run_sync(factory.called.wait)
                # The loop runs while the stream is made; the library is in use meanwhile.
                with pytest.raises(InUseError, match="being made"):
                    env.unregister_library("slow")
                factory.go.set()
        assert len(factory.threads) == 1  # the second borrower waited for the first's stream
        assert factory.threads[0] is not threading.current_thread()
        assert got[0] is got[1]
    finally:
        factory.go.set()
        await env.aclose()


# -- device errors ---------------------------------------------------------------------------


async def test_a_failed_copy_fails_only_its_request_on_a_shared_stream() -> None:
    # Copy 1 of the device fails; latency keeps the stream busy, so B's copies queue after A's.
    env = await sim_env(pool=1, fail_after_copies=0, latency_us=2000)
    try:
        dev = sim_device(env)
        a_enqueued = anyio.Event()
        seen: dict[str, object] = {}

        async def request_a() -> None:
            async with env.pooled_stream(dev) as stream:
                x = device_empty(env, dev, 8)
                future = env.copy_tensors([np.ones(8, np.int64)], [x], stream)
                seen["a_stream"] = stream
                a_enqueued.set()
                with pytest.raises(aioep.DeviceError, match="injected failure of copy 1"):
                    await future
                seen["a"] = "failed"
                del x

        async def request_b() -> None:
            await a_enqueued.wait()
            async with env.pooled_stream(dev) as stream:
                assert stream is seen["a_stream"]  # one stream, shared
                x = device_empty(env, dev, 8)
                out = np.zeros(8, np.int64)
                env.copy_tensors([np.arange(8, dtype=np.int64)], [x], stream)
                await env.copy_tensors([x], [out], stream)
                await stream  # B's own marks report nothing of A's
                seen["b"] = out
                del x

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(request_a)
                tg.start_soon(request_b)
        assert seen["a"] == "failed"
        assert isinstance(seen["b"], np.ndarray)
        assert seen["b"].tolist() == list(range(8))
    finally:
        await env.aclose()


async def test_a_kernel_error_reaches_its_own_request_not_the_next_mark() -> None:
    """A's work fails and A records its next mark only later: B's copy, enqueued in between on
    the same stream, must not report A's error (the next mark of the stream is B's)."""
    env = await sim_env(pool=1, latency_us=2000)
    try:
        dev = sim_device(env)
        a_enqueued = anyio.Event()
        b_done = anyio.Event()
        seen: dict[str, object] = {}

        def faulting_kernel() -> None:
            raise RuntimeError("A's kernel faulted")

        async def request_a() -> None:
            async with env.pooled_stream(dev) as stream:
                impl = stream.impl
                assert isinstance(impl, ThreadStream)
                impl.enqueue(faulting_kernel)  # as an EP enqueues its kernels
                a_enqueued.set()
                await b_done.wait()
                with pytest.raises(aioep.DeviceError, match="A's kernel faulted"):
                    await stream
                await stream  # reported once
                seen["a"] = "failed"

        async def request_b() -> None:
            await a_enqueued.wait()
            async with env.pooled_stream(dev) as stream:
                x = device_empty(env, dev, 8)
                out = np.zeros(8, np.int64)
                env.copy_tensors([np.arange(8, dtype=np.int64)], [x], stream)
                await env.copy_tensors([x], [out], stream)
                seen["b"] = out
                del x
            b_done.set()

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(request_a)
                tg.start_soon(request_b)
        assert seen["a"] == "failed"
        assert isinstance(seen["b"], np.ndarray)
        assert seen["b"].tolist() == list(range(8))
    finally:
        await env.aclose()


async def test_a_lost_device_reaches_every_borrower() -> None:
    env = await sim_env(pool=1, lose_device_after_copies=0)
    try:
        dev = sim_device(env)
        async with env.pooled_stream(dev) as a, env.pooled_stream(dev) as b:
            assert a is b
            x = device_empty(env, dev, 8)
            with pytest.raises(aioep.DeviceError, match="device lost"):
                await env.copy_tensors([np.ones(8, np.int64)], [x], a)
            with pytest.raises(aioep.DeviceError, match="device lost"):
                await b  # sticky: every mark reports it, in every lane
            del x
    finally:
        await env.aclose()


# -- closing ---------------------------------------------------------------------------------


async def test_closing_a_lent_stream_is_refused() -> None:
    env = await sim_env(pool=1)
    try:
        dev = sim_device(env)
        async with env.pooled_stream(dev) as stream:
            with pytest.raises(InUseError, match=r"pooled_stream"):
                await stream.aclose()
            with pytest.raises(InUseError, match=r"pooled_stream"):
                stream.close()
            with pytest.raises(InUseError, match=r"pooled_stream"):
                async with stream:
                    pass  # pragma: no cover
            x = device_empty(env, dev, 4)
            out = np.zeros(4, np.int64)
            env.copy_tensors([np.full(4, 7, np.int64)], [x], stream)
            await env.copy_tensors([x], [out], stream)  # still open and working
            assert out.tolist() == [7] * 4
            del x
        with pytest.raises(InUseError):
            await stream.aclose()  # given back, it is still the pool's
        assert not stream.closed
    finally:
        await env.aclose()
    assert stream.closed


async def test_unregister_closes_the_idle_pool_and_refuses_while_lent_or_busy() -> None:
    env = await sim_env(pool=2)
    try:
        dev = sim_device(env)
        async with env.pooled_stream(dev) as stream:
            with pytest.raises(InUseError, match=r"1 pooled stream\(s\) lent"):
                env.unregister_library("sim")
            assert "sim" in env.libraries
            # Leave with work still on the stream: not lent, but busy.
            gate = HostNotification()
            stream.wait(aioep.Notification(gate))
            mark = stream.record()
        with pytest.raises(InUseError, match="work in flight"):
            env.unregister_library("sim")
        gate.set()
        await mark
        assert len(sim_threads()) == 1
        env.unregister_library("sim")
        assert "sim" not in env.libraries
        assert stream.closed
        assert sim_threads() == []  # its worker thread is gone
    finally:
        await env.aclose()


async def test_closing_the_environment_waits_for_pooled_work_then_closes_streams_first() -> None:
    env = await aioep.Environment(autoload=False, stream_pool_size=2).__aenter__()
    (dev,) = env.register_library("fake", FakeGpuFactory, {"tag": "f"})
    ran = threading.Event()
    gate = HostNotification()

    def slow_work() -> None:
        gate.wait_on_host(None)
        ran.set()

    async with env.pooled_stream(dev) as stream:
        impl = stream.impl
        assert isinstance(impl, ThreadStream)
        impl.enqueue(slow_work)
    # The borrower left without awaiting its work: closing waits for it.
    async with anyio.create_task_group() as tg:
        tg.start_soon(env.aclose)
        while env.state != "closing":
            await anyio.lowlevel.checkpoint()
        assert not stream.closed
        assert not ran.is_set()
        gate.set()
    assert ran.is_set()
    assert stream.closed
    assert env.state == "closed"
    kinds = [k for k, _ in EVENTS]
    assert kinds.index("stream") < kinds.index("transfer") < kinds.index("factory")


async def test_a_stream_still_lent_at_close_is_reported_and_closed_after_its_work() -> None:
    env = await sim_env(pool=1, latency_us=20_000)
    dev = sim_device(env)
    x = device_empty(env, dev, 4)
    out = np.zeros(4, np.int64)
    async with env.pooled_stream(dev) as stream:
        env.copy_tensors([np.full(4, 3, np.int64)], [x], stream)
        env.copy_tensors([x], [out], stream)
        del x  # the copies hold it until they are done
        await env.aclose()  # no warning: what was still lent is in the close report
        report = env.close_report
        assert report is not None
        assert any("still lent by env.pooled_stream()" in s for s in report.streams), report
        assert stream.closed
        assert out.tolist() == [3] * 4  # its work ran before the stream closed


# -- arguments and state ---------------------------------------------------------------------


async def test_the_pool_size_is_an_environment_option() -> None:
    assert aioep.Environment(autoload=False).stream_pool_size == 4
    assert aioep.Environment(autoload=False, stream_pool_size=16).stream_pool_size == 16
    for bad in (0, -1, 1025, True, 2.0, "4", None):
        with pytest.raises(InvalidArgument, match="stream_pool_size"):
            aioep.Environment(autoload=False, stream_pool_size=bad)  # type: ignore[arg-type]


async def test_pooled_stream_refuses_bad_devices_and_closed_environments(
    make_env: MakeEnv,
) -> None:
    env = await sim_env(pool=1)
    other = await make_env()
    dev = sim_device(env)
    with pytest.raises(InvalidArgument, match=r"ep_device must be an aioep\.EpDevice"):
        env.pooled_stream("sim:0")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="not registered in this environment"):
        env.pooled_stream(sim_device(other))
    lease = env.pooled_stream(dev)
    await env.aclose()
    with pytest.raises(aioep.ClosedError):
        env.pooled_stream(dev)
    with pytest.raises(aioep.ClosedError):
        await lease.__aenter__()


async def test_pooled_stream_needs_a_stream_aware_device() -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("nostreams", _NoStreams)
        lease = env.pooled_stream(dev)
        with pytest.raises(aioep.NotImplementedByEp, match="does not support streams"):
            async with lease:
                pass  # pragma: no cover
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            env.unregister_library("nostreams")


class _NoStreams(FakeGpuFactory):
    name = "NoStreamsExecutionProvider"

    def is_stream_aware(self) -> bool:
        return False
