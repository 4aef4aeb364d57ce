"""The copy fast paths (a few tensors or arrays on a route already taken) accept exactly
what the general path accepts, copy the same bytes, and leave every refusal to it with the
same error; their caches follow the environment (libraries going, streams closing)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest
from _factories import FAKE_INFO, FakeGpuFactory, MakeEnv, RecordingTransfer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioep
import aioep._copies.dispatcher as dispatcher
from aioep.abc import HostNotification, ThreadStream

pytestmark = pytest.mark.anyio


@contextlib.contextmanager
def general_path_only() -> Iterator[None]:
    """Every copy takes the general path (validation, planning and routing from scratch)."""
    cls = dispatcher.CopyDispatcher
    saved = (cls._fast_streamed, cls._fast_unstreamed, dispatcher._copy_small_arrays)
    cls._fast_streamed = lambda self, src, dst, stream: None  # type: ignore[method-assign]
    cls._fast_unstreamed = lambda self, src, dst: None  # type: ignore[method-assign]
    dispatcher._copy_small_arrays = lambda src, dst, transfers, budget: None  # type: ignore[assignment]
    try:
        yield
    finally:
        cls._fast_streamed, cls._fast_unstreamed, dispatcher._copy_small_arrays = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def counting_plans() -> Iterator[list[int]]:
    """Count the general path's plans (each call of ``plan_copies``)."""
    real = dispatcher.plan_copies
    calls: list[int] = []

    def plan_copies(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    dispatcher.plan_copies = plan_copies  # type: ignore[assignment]
    try:
        yield calls
    finally:
        dispatcher.plan_copies = real  # type: ignore[assignment]


# -- the fast path is taken --------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_route_taken_before_needs_no_plan(make_env: MakeEnv, streamed: bool) -> None:
    env = await make_env(num_devices=1, bandwidth_gbps=1000)
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    dst = env.empty(256, "float32", dev.memory_info(aioep.MemoryType.DEFAULT))
    back = np.zeros(256, np.float32)
    async with env.create_sync_stream(dev) as stream:
        s = stream if streamed else None
        await aioep.copy_tensors([np.zeros(256, np.float32)], [dst], s)  # routes it
        await aioep.copy_tensors([dst], [back], s)
        with counting_plans() as plans:
            for i in range(5):
                src = np.full(256, i, np.float32)
                await aioep.copy_tensors([src], [dst], s)
                await env.copy_tensors((dst,), (back,), s)
                assert (back == i).all()
        assert plans == []
    del dst


async def test_small_host_copies_need_no_plan() -> None:
    async with aioep.Environment(autoload=False) as env:
        src, dst = np.arange(64, dtype=np.int32), np.zeros(64, np.int32)
        with counting_plans() as plans:
            out = await env.copy_tensors([src], [dst])
        assert plans == []
        assert dst.tolist() == src.tolist()
        assert out[0].data_ptr == dst.ctypes.data


# -- the caches follow the environment ---------------------------------------------------------


async def test_a_route_cache_forgets_a_library_that_went() -> None:
    async with aioep.Environment(autoload=False) as env:
        env.register_library("a", FakeGpuFactory, {"tag": "a"})
        env.register_library("b", FakeGpuFactory, {"tag": "b"})
        transfer_a = env._libraries["a"].transfer
        transfer_b = env._libraries["b"].transfer
        assert isinstance(transfer_a, RecordingTransfer)
        assert isinstance(transfer_b, RecordingTransfer)
        # "Device" memory nobody's allocator made: it does not keep library "a" in use.
        backing = np.zeros(64, np.uint8)
        dst = aioep.Tensor(
            aioep.Buffer(backing.ctypes.data, 64, FAKE_INFO, owner=backing), 64, "uint8"
        )
        for _ in range(3):
            await aioep.copy_tensors([np.full(64, 1, np.uint8)], [dst])
        assert (transfer_a.calls, transfer_b.calls) == (3, 0)  # the first capable one
        env.unregister_library("a")
        await aioep.copy_tensors([np.full(64, 2, np.uint8)], [dst])
        assert (transfer_a.calls, transfer_b.calls) == (3, 1)  # never a's again
        assert (backing == 2).all()
        env.unregister_library("b")
        with pytest.raises(aioep.NotImplementedByEp, match="no registered data transfer"):
            aioep.copy_tensors([np.full(64, 3, np.uint8)], [dst])
        assert (backing == 2).all()


async def test_a_closed_stream_takes_no_more_copies(make_env: MakeEnv) -> None:
    env = await make_env(num_devices=1, bandwidth_gbps=1000)
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    dst = env.empty(16, "uint8", dev.memory_info(aioep.MemoryType.DEFAULT))
    stream = env.create_sync_stream(dev)
    for _ in range(3):
        await aioep.copy_tensors([np.ones(16, np.uint8)], [dst], stream)
    await stream.aclose()
    with pytest.raises(aioep.ClosedError, match="closed"):
        aioep.copy_tensors([np.ones(16, np.uint8)], [dst], stream)
    with pytest.raises(aioep.ClosedError, match="closed"):
        env.copy_tensors([np.ones(16, np.uint8)], [dst], stream)
    del dst


async def test_a_stream_of_another_environment_is_refused_after_its_own_copies(
    make_env: MakeEnv,
) -> None:
    env = await make_env(num_devices=1)
    other = await make_env(num_devices=1)
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    async with env.create_sync_stream(dev) as stream:
        out = np.zeros(4)
        for _ in range(3):
            await env.copy_tensors([np.ones(4)], [out], stream)
        with pytest.raises(aioep.InvalidArgument, match="does not belong"):
            other.copy_tensors([np.ones(4)], [out], stream)
        await env.copy_tensors([np.full(4, 2.0)], [out], stream)  # still its own
        assert out.tolist() == [2.0] * 4


# -- what the fast path refuses, the general path refuses with its message ---------------------


@pytest.mark.parametrize("streamed", [False, True])
async def test_refusals_after_a_route_is_cached(make_env: MakeEnv, streamed: bool) -> None:
    env = await make_env(num_devices=1, bandwidth_gbps=1000)
    other = await make_env(num_devices=1)
    (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
    (other_dev,) = other.ep_devices(ep_name="SimExecutionProvider")
    info = dev.memory_info(aioep.MemoryType.DEFAULT)
    dst = env.empty(8, "float32", info)
    src = np.arange(8, dtype=np.float32)
    async with env.create_sync_stream(dev) as stream:
        s = stream if streamed else None
        for _ in range(2):
            await aioep.copy_tensors([src], [dst], s)  # the route is cached from here on
        foreign = other.empty(8, "float32", other_dev.memory_info(aioep.MemoryType.DEFAULT))
        with pytest.raises(aioep.InvalidArgument, match="another environment"):
            env.copy_tensors([src], [foreign], s)
        with pytest.raises(aioep.InvalidArgument, match="dtype float64 differs"):
            env.copy_tensors([src.astype(np.float64)], [dst], s)
        freed = env.empty(8, "float32", info)
        freed.buffer.free()
        with pytest.raises(aioep.InvalidArgument, match=r"destination buffer .* was freed"):
            env.copy_tensors([src], [freed], s)
        with pytest.raises(aioep.InvalidArgument, match="destinations must not overlap"):
            env.copy_tensors([src, src], [dst, dst], s)
        with pytest.raises(aioep.InvalidArgument, match="shape"):
            env.copy_tensors([src.reshape(2, 4)], [dst], s)
        readonly = src.copy()
        readonly.flags.writeable = False
        with pytest.raises(aioep.InvalidArgument, match="read-only"):
            env.copy_tensors([dst], [readonly], s)
        back = np.zeros(8, np.float32)
        await env.copy_tensors([dst], [back], s)
        assert back.tolist() == src.tolist()  # nothing refused wrote anything
    del dst, foreign, freed


# -- fast and general paths agree on random batches --------------------------------------------


class _Pool:
    """The arguments a random batch draws from, remade for every example."""

    def __init__(self, env: aioep.Environment, other: aioep.Environment) -> None:
        (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
        (other_dev,) = other.ep_devices(ep_name="SimExecutionProvider")
        info = dev.memory_info(aioep.MemoryType.DEFAULT)
        backing = np.zeros(32, np.float32)
        readonly = np.zeros(8, np.float32)
        readonly.flags.writeable = False
        freed = env.empty(8, "float32", info)
        freed.buffer.free()
        self.items: list[Any] = [
            np.zeros(8, np.float32),  # 0
            np.zeros(8, np.float32),  # 1
            np.zeros((2, 4), np.float32),  # 2
            np.zeros(8, np.int64),  # 3
            readonly,  # 4
            backing[::2][:8],  # 5: strided
            backing[:8],  # 6: overlaps 7
            backing[4:12],  # 7
            np.array([None] * 8, dtype=object),  # 8
            env.empty(8, "float32"),  # 9: host tensor
            env.empty(8, "float32", info),  # 10: device
            env.empty(8, "float32", info),  # 11: device
            env.empty((2, 4), "float32", info),  # 12: device
            env.empty(8, "int64", info),  # 13: device
            freed,  # 14
            other.empty(8, "float32", other_dev.memory_info(aioep.MemoryType.DEFAULT)),  # 15
            aioep.Tensor.from_numpy(readonly),  # 16: read-only host tensor
            "not a tensor",  # 17
        ]
        self.env = env

    def fill(self, seed: int) -> None:
        """Give every writable item fresh contents."""
        rng = np.random.default_rng(seed)
        for i, item in enumerate(self.items):
            if isinstance(item, np.ndarray):
                if item.flags.writeable and item.dtype != object:
                    item[...] = rng.integers(0, 100, item.shape)
            elif isinstance(item, aioep.Tensor) and self.readable(i) and not item.buffer.readonly:
                values = rng.integers(0, 100, item.shape).astype(item.dtype)
                self.env.copy_tensors([values], [item]).wait(30)

    def readable(self, i: int) -> bool:
        item = self.items[i]
        if isinstance(item, np.ndarray):
            return item.dtype != object
        return isinstance(item, aioep.Tensor) and i != 15 and not item.buffer.freed

    def read(self, i: int) -> bytes | None:
        if not self.readable(i):
            return None
        item = self.items[i]
        if isinstance(item, np.ndarray):
            return item.tobytes()
        out = np.empty(item.shape, item.dtype)
        self.env.copy_tensors([item], [out]).wait(30)
        return out.tobytes()


def _outcome(
    pool: _Pool, src: list[int], dst: list[int], kind: Any, stream: Any, seed: int
) -> tuple[str, Any]:
    pool.fill(seed)
    sources = kind(pool.items[i] for i in src)
    dests = kind(pool.items[i] for i in dst)
    before = [pool.read(i) for i in src]
    try:
        future = pool.env.copy_tensors(sources, dests, stream)
        future.wait(30)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    after = [pool.read(i) for i in dst]
    assert after == before  # every destination holds its source's bytes
    return "copied", after


_envs: dict[str, Any] = {}


def _environments() -> tuple[aioep.Environment, aioep.Environment, aioep.SyncStream]:
    if not _envs:
        from aioep_sim import SimFactory

        env = aioep.Environment(autoload=False).open()
        env.register_library("sim", SimFactory, {"num_devices": 1, "bandwidth_gbps": 1000})
        other = aioep.Environment(autoload=False).open()
        other.register_library("sim", SimFactory, {"num_devices": 1})
        (dev,) = env.ep_devices(ep_name="SimExecutionProvider")
        _envs.update(env=env, other=other, stream=env.create_sync_stream(dev))
    return _envs["env"], _envs["other"], _envs["stream"]


@pytest.fixture(scope="module", autouse=True)
def _close_environments() -> Iterator[None]:
    yield
    if _envs:
        _envs["stream"].close()
        _envs["env"].close()
        _envs["other"].close()
        _envs.clear()


# A pair: anything with anything, or items of one dtype and shape (most of which copy).
_FLOAT8 = [0, 1, 4, 5, 6, 7, 9, 10, 11, 14, 15, 16]
_valid = st.one_of(
    st.tuples(st.sampled_from([0, 4, 6, 9, 16]), st.sampled_from([10, 11])),  # host -> device
    st.tuples(st.sampled_from([10, 11]), st.sampled_from([1, 7, 9])),  # device -> host
    st.tuples(st.sampled_from([0, 4, 16]), st.sampled_from([1, 9])),  # host -> host
    st.tuples(st.just(10), st.just(11)),  # device -> device
    st.tuples(st.just(2), st.just(12)),
    st.tuples(st.just(13), st.just(3)),
)
pairs = st.one_of(
    _valid,
    _valid,
    _valid,
    st.tuples(st.sampled_from(_FLOAT8), st.sampled_from(_FLOAT8)),
    st.tuples(st.integers(0, 17), st.integers(0, 17)),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batch=st.lists(pairs, min_size=0, max_size=3),
    extra=st.sampled_from([None] * 8 + ["src", "dst"]),
    kind=st.sampled_from([list, tuple]),
    streamed=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_fast_and_general_paths_agree(
    batch: list[tuple[int, int]], extra: str | None, kind: Any, streamed: bool, seed: int
) -> None:
    src = [s for s, _ in batch] + ([0] if extra == "src" else [])
    dst = [d for _, d in batch] + ([1] if extra == "dst" else [])
    env, other, stream = _environments()
    pool = _Pool(env, other)
    s = stream if streamed else None
    with general_path_only():
        expected = _outcome(pool, src, dst, kind, s, seed)
    # The general path cached its routes: the fast path may take this batch now.
    assert _outcome(pool, src, dst, kind, s, seed) == expected


# -- completions on a stream's worker ----------------------------------------------------------


async def test_a_worker_wakes_the_loop_before_it_runs_more_work() -> None:
    stream = ThreadStream("fast-path-wake")
    try:
        release = threading.Event()
        note = aioep.Notification(stream.create_notification())
        stream.enqueue(lambda: None)
        note.activate()
        stream.enqueue(lambda: release.wait(30) and None)  # long device work after the mark
        with anyio.fail_after(10):
            await note  # woken when the worker passed the mark, not after the work behind it
        assert not release.is_set()
    finally:
        release.set()
        stream.close()


async def test_a_worker_wakes_the_loop_once_it_passed_the_marks_in_a_row(
    wakeups: list[str],
) -> None:
    stream = ThreadStream("fast-path-batch")
    try:
        gate = HostNotification()
        stream.enqueue_wait(gate)
        marks = [aioep.Notification(stream.create_notification()) for _ in range(20)]
        for mark in marks:
            mark.activate()
        done: list[int] = []

        async def waiter(i: int) -> None:
            await marks[i]
            done.append(i)

        async with anyio.create_task_group() as tg:
            for i in range(len(marks)):
                tg.start_soon(waiter, i)
            await anyio.sleep(0.01)
            # What the worker did, in order: each mark's callbacks, the loop's wake-up.
            for i, mark in enumerate(marks):
                mark.impl.add_done_callback(lambda i=i: wakeups.append(f"mark {i}"))
            wakeups.clear()
            gate.set()  # the worker passes 20 marks in a row, then parks
        assert sorted(done) == list(range(20))
        # One wake-up, scheduled by the worker once it passed the last mark (a loop woken
        # earlier would wait for the worker to let go of the interpreter).
        assert wakeups == [f"mark {i}" for i in range(20)] + ["fast-path-batch"]
    finally:
        stream.close()


async def test_a_done_callback_that_blocks_holds_back_no_earlier_awaiter() -> None:
    from aioep._copies.future import CopyFuture

    stream = ThreadStream("fast-path-blocking-callback")
    resumed = threading.Event()
    try:
        gate = HostNotification()
        stream.enqueue_wait(gate)
        first = aioep.Notification(stream.create_notification())
        first.activate()
        second = aioep.Notification(stream.create_notification())
        second.activate()  # passed right after the first: no work in between
        future = CopyFuture([], [], second)
        future.add_done_callback(lambda _: resumed.wait(10) and None)  # blocks the worker
        gate.set()
        with anyio.fail_after(5):
            await first  # woken although the worker is stuck in the second's callback
        resumed.set()
        with anyio.fail_after(10):
            await future
    finally:
        resumed.set()
        stream.close()
