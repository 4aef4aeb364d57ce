"""The arena: ArenaConfig parsing, BFC behaviour (ORT's bfc_arena_test), stream rules
(ORT's StreamAwareArenaTest), property-based invariants, threads, and a real race on sim."""

from __future__ import annotations

import ctypes
import gc
import itertools
import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioep
from aioep import AllocatorType, DeviceError, InvalidArgument, MemoryType
from aioep._environment.host import HostAllocator, HostFactory
from aioep._memory.arena import SIZE_MAX, ArenaAllocator, ArenaConfig, ArenaExtendStrategy
from aioep._memory.arena_parking import MAX_PARKED, PARK_MAX
from aioep._plugin.stream import SyncStream
from aioep._plugin.stream_impl import NotificationImpl, StreamImpl
from aioep._plugin.thread_stream import HostNotification

MiB = 1 << 20
ORT_STATS = (
    "Limit",
    "InUse",
    "TotalAllocated",
    "MaxInUse",
    "NumAllocs",
    "NumReserves",
    "NumArenaExtensions",
    "NumArenaShrinkages",
    "MaxAllocSize",
    "LargestFreeBlock",
)


def arena(**config: Any) -> ArenaAllocator:
    return ArenaAllocator(HostAllocator(), ArenaConfig(**config))


# -- fake streams: never complete unless the test says so (ORT's StreamMock) --------------------


class _MockNotification(NotificationImpl):
    def __init__(self, stream: _MockStream) -> None:
        self.stream = stream
        self.mark = 0

    def activate(self) -> None:
        self.mark = self.stream.enqueued

    def wait_on_device(self, stream: StreamImpl) -> None:
        pass

    def query(self) -> bool:
        return self.stream.completed >= self.mark

    def add_done_callback(self, fn: Callable[[], None]) -> bool:
        if not self.stream.callbacks:
            return False  # the base class's answer: this notification cannot call back
        if self.query():
            fn()
        else:
            self.stream.waiters.append(fn)
        return True


class _MockStream(StreamImpl):
    def __init__(self, *, callbacks: bool = False) -> None:
        self.enqueued = 1  # pretend work was enqueued: not idle until the test completes it
        self.completed = 0
        self.callbacks = callbacks
        self.waiters: list[Callable[[], None]] = []

    def create_notification(self) -> NotificationImpl:
        return _MockNotification(self)

    def query(self) -> bool | None:
        return self.completed >= self.enqueued

    def complete(self) -> None:
        """The device passed everything enqueued so far."""
        self.completed = self.enqueued
        waiters, self.waiters = self.waiters, []
        for fn in waiters:
            fn()

    def close(self) -> None:
        pass


_HOST_EP_DEVICE = HostFactory().get_supported_devices([])[0]


def mock_stream(*, callbacks: bool = False) -> SyncStream:
    return SyncStream(_MockStream(callbacks=callbacks), _HOST_EP_DEVICE)


# -- ArenaConfig ---------------------------------------------------------------------------------


def test_config_defaults_are_orts() -> None:
    cfg = ArenaConfig.from_options({})
    assert cfg == ArenaConfig()
    assert cfg.extend_strategy is ArenaExtendStrategy.NEXT_POWER_OF_TWO
    assert cfg.initial_chunk_size_bytes == 1 * MiB
    assert cfg.max_dead_bytes_per_chunk == 128 * MiB
    assert cfg.initial_growth_chunk_size_bytes == 2 * MiB
    assert cfg.max_power_of_two_extend_bytes == 1 << 30
    assert cfg.max_mem == 0
    assert cfg.limit == SIZE_MAX
    assert ArenaConfig.from_options(None) == cfg


def test_config_every_key_as_str_and_int() -> None:
    opts = {
        "arena.extend_strategy": "1",
        "arena.initial_chunk_size_bytes": "25600",
        "arena.max_dead_bytes_per_chunk": 0,
        "arena.initial_growth_chunk_size_bytes": 4096,
        "arena.max_power_of_two_extend_bytes": str(1 << 40),
        "arena.max_mem": "0x10000",
    }
    cfg = ArenaConfig.from_options(opts)
    assert cfg == ArenaConfig(ArenaExtendStrategy.SAME_AS_REQUESTED, 25600, 0, 4096, 1 << 40, 65536)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("next_power_of_two", ArenaExtendStrategy.NEXT_POWER_OF_TWO),
        ("same_as_requested", ArenaExtendStrategy.SAME_AS_REQUESTED),
        (-1, ArenaExtendStrategy.NEXT_POWER_OF_TWO),
        ("0", ArenaExtendStrategy.NEXT_POWER_OF_TWO),
        (1, ArenaExtendStrategy.SAME_AS_REQUESTED),
    ],
)
def test_config_strategy_values(value: Any, expected: ArenaExtendStrategy) -> None:
    assert ArenaConfig.from_options({"arena.extend_strategy": value}).extend_strategy is expected


@pytest.mark.parametrize(
    "key",
    [
        "arena.initial_chunk_size_bytes",
        "arena.max_dead_bytes_per_chunk",
        "arena.initial_growth_chunk_size_bytes",
        "arena.max_power_of_two_extend_bytes",
        "arena.max_mem",
    ],
)
def test_config_minus_one_means_default(key: str) -> None:
    assert ArenaConfig.from_options({key: "-1"}) == ArenaConfig()
    assert ArenaConfig.from_options({key: -1}) == ArenaConfig()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("arena.unknown", "1"),
        ("max_mem", "1"),  # CreateArenaCfgV2's names without the prefix are not these keys
        ("arena.use_cuda_mempool", "1"),
        ("arena.initial_chunk_size_bytes", "not_a_number"),  # cuda_plugin_arena_test
        ("arena.initial_chunk_size_bytes", "-100"),
        ("arena.max_mem", "abc"),
        ("arena.initial_chunk_size_bytes", "1.5"),
        ("arena.initial_chunk_size_bytes", " 1024"),
        ("arena.initial_chunk_size_bytes", "1024 "),
        ("arena.initial_chunk_size_bytes", "+1024"),
        ("arena.initial_chunk_size_bytes", "0x400"),  # hex only for the unsigned max_mem
        ("arena.initial_chunk_size_bytes", ""),
        ("arena.initial_chunk_size_bytes", 0),
        ("arena.initial_chunk_size_bytes", 1.0),
        ("arena.initial_chunk_size_bytes", True),
        ("arena.initial_chunk_size_bytes", None),
        ("arena.initial_chunk_size_bytes", str(1 << 31)),  # int overflow
        ("arena.max_dead_bytes_per_chunk", -2),
        ("arena.initial_growth_chunk_size_bytes", "-5"),
        ("arena.max_power_of_two_extend_bytes", str(1 << 63)),  # int64 overflow
        ("arena.max_power_of_two_extend_bytes", "0"),
        ("arena.max_mem", str(1 << 64)),  # size_t overflow
        ("arena.max_mem", "-7"),
        ("arena.max_mem", "0xZZ"),
        ("arena.extend_strategy", "2"),
        ("arena.extend_strategy", 11),  # ORT's Python binding stores this unchecked
        ("arena.extend_strategy", "-2"),
        ("arena.extend_strategy", "fastest"),
        ("arena.extend_strategy", "NEXT_POWER_OF_TWO"),
    ],
)
def test_config_rejects_bad_input_naming_key_and_value(key: str, value: Any) -> None:
    with pytest.raises(InvalidArgument) as info:
        ArenaConfig.from_options({key: value})
    assert key in str(info.value)
    assert repr(value) in str(info.value) or str(value) in str(info.value)
    assert info.value.code is aioep.ErrorCode.INVALID_ARGUMENT


def test_config_rejects_non_mapping_and_bad_fields() -> None:
    with pytest.raises(InvalidArgument):
        ArenaConfig.from_options([("arena.max_mem", "1")])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="extend_strategy"):
        ArenaConfig(extend_strategy=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="initial_chunk_size_bytes"):
        ArenaConfig(initial_chunk_size_bytes=0)
    with pytest.raises(InvalidArgument, match="max_mem"):
        ArenaConfig(max_mem=-1)
    with pytest.raises(InvalidArgument, match="max_mem"):
        ArenaConfig(max_mem=1 << 64)


# -- BFC behaviour -------------------------------------------------------------------------------


def test_memory_info_is_the_bases_as_arena() -> None:
    base = HostAllocator()
    a = ArenaAllocator(base)
    assert a.memory_info.allocator_type is AllocatorType.ARENA
    assert a.memory_info.device == base.memory_info.device
    assert a.memory_info.name == base.memory_info.name
    with pytest.raises(InvalidArgument):
        ArenaAllocator(object())  # type: ignore[arg-type]


def test_add_arena_to_shared_allocator_stats() -> None:
    # ORT's SharedAllocators.AddArenaToSharedAllocator figures.
    a = ArenaAllocator(
        HostAllocator(), ArenaConfig.from_options({"arena.initial_chunk_size_bytes": "25600"})
    )
    buf = a.alloc(16)
    buf.free()
    stats = a.stats()
    assert set(ORT_STATS) <= set(stats)
    assert stats["NumAllocs"] == 1
    assert stats["NumArenaExtensions"] == 1
    assert stats["TotalAllocated"] == 25600
    assert stats["InUse"] == 0


def test_allocated_vs_requested_and_zero() -> None:
    a = arena()
    buf = a.alloc(4)
    assert a.stats()["InUse"] == 256
    assert buf.nbytes == 4
    assert a.stats()["InUseRequested"] == 4
    zero = a.alloc(0)  # ORT returns null; aioep a null buffer, as every allocator does
    assert zero.ptr == 0
    assert zero.nbytes == 0
    zero.free()
    with pytest.raises(InvalidArgument):
        a.alloc(-1)
    with pytest.raises(InvalidArgument):
        a.alloc(1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        a.alloc(np.int64(10))  # type: ignore[arg-type]  # as the base class: a plain int


def test_extend_strategy_next_power_of_two_doubles() -> None:
    a = arena()
    live = [a.alloc(MiB) for _ in range(15)]
    sizes = [size for _, size in sorted(a.regions())]
    assert sorted(sizes) == [MiB, 2 * MiB, 4 * MiB, 8 * MiB]
    assert a.stats()["NumArenaExtensions"] == 4
    del live


def test_extend_strategy_cap_and_large_request() -> None:
    a = arena(max_power_of_two_extend_bytes=32 * MiB)
    live = []
    for _ in range(150):
        live.append(a.alloc(MiB))
    sizes = sorted(size for _, size in a.regions())
    assert sizes.count(32 * MiB) > 2
    assert max(sizes) == 32 * MiB
    live.append(a.alloc(64 * MiB))  # still succeeds: one region of the request's size
    assert max(size for _, size in a.regions()) == 64 * MiB


def test_same_as_requested_extends_by_the_request() -> None:
    a = arena(extend_strategy=ArenaExtendStrategy.SAME_AS_REQUESTED)
    live = [a.alloc(n) for n in (1000, 5000, 300)]
    assert sorted(size for _, size in a.regions()) == [512, 1024, 5120]
    del live


def test_max_dead_bytes_per_chunk_decides_splitting() -> None:
    # A 1024-byte free chunk serving 600 bytes (rounded 768): 256 left over.
    for max_dead, split in ((128 * MiB, False), (256, True)):
        a = arena(
            extend_strategy=ArenaExtendStrategy.SAME_AS_REQUESTED, max_dead_bytes_per_chunk=max_dead
        )
        a.alloc(1024).free()
        buf = a.alloc(600)
        assert a.stats()["InUse"] == (768 if split else 1024)
        del buf


def test_max_mem_limits_and_errors_name_request_limit_in_use() -> None:
    a = ArenaAllocator(HostAllocator(), ArenaConfig.from_options({"arena.max_mem": "65536"}))
    assert a.stats()["Limit"] == 65536
    with pytest.raises(DeviceError) as info:
        a.reserve(128 * 1024)
    assert "131072" in str(info.value)
    assert "65536" in str(info.value)
    whole = a.alloc(65536)
    with pytest.raises(DeviceError) as info:
        a.alloc(256)
    msg = str(info.value)
    assert "256 bytes" in msg
    assert "limit 65536" in msg
    assert "65536 bytes in use" in msg
    whole.free()
    a.alloc(256).free()  # room again


def test_unlimited_when_max_mem_is_zero() -> None:
    a = ArenaAllocator(HostAllocator(), ArenaConfig.from_options({"arena.max_mem": "0"}))
    assert a.stats()["Limit"] == SIZE_MAX
    a.alloc(4 * MiB).free()


def test_reserve_is_outside_the_pool() -> None:
    a = arena()
    first = a.alloc(256)
    big = a.reserve(4 * MiB)
    assert a.stats()["NumReserves"] == 1
    assert a.stats()["TotalAllocated"] == MiB + 4 * MiB
    big.free()
    assert a.stats()["TotalAllocated"] == MiB
    first.free()


def test_shrink_frees_only_wholly_free_regions() -> None:
    a = arena(initial_chunk_size_bytes=4096)
    one = a.alloc(4096)
    two = a.alloc(8 * 1024)  # a second region
    total = a.stats()["TotalAllocated"]
    assert a.shrink() == 0
    assert a.stats()["TotalAllocated"] == total
    two.free()
    freed = a.shrink()
    assert freed > 0
    assert a.stats()["TotalAllocated"] == total - freed == 4096
    assert a.stats()["NumArenaShrinkages"] == 1
    one.free()
    assert a.shrink() == 4096
    assert a.stats()["TotalAllocated"] == 0


def test_base_failure_backs_off_and_reports() -> None:
    class Tight(HostAllocator):
        def _allocate(self, nbytes: int, stream: Any) -> int:
            if nbytes > 3 * MiB:
                raise DeviceError(f"tight: no {nbytes} bytes")
            return super()._allocate(nbytes, stream)

    a = ArenaAllocator(Tight(), ArenaConfig(initial_chunk_size_bytes=4 * MiB))
    buf = a.alloc(MiB)  # 4 MiB fails; the arena backs off to a smaller region
    assert 0 < a.stats()["TotalAllocated"] <= 3 * MiB
    with pytest.raises(DeviceError, match="8388608 bytes") as info:
        a.alloc(8 * MiB)
    assert isinstance(info.value.__cause__, DeviceError)
    del buf


def test_alignment_and_no_overlap() -> None:
    a = arena(initial_chunk_size_bytes=64 * 1024)
    bufs = [a.alloc(n) for n in (1, 255, 256, 257, 1000, 4096, 3)]
    spans = sorted((b.ptr, b.ptr + b.nbytes) for b in bufs)
    for (_s0, e0), (s1, _) in itertools.pairwise(spans):
        assert e0 <= s1
    assert all(b.ptr % 256 == 0 or b.ptr % a.memory_info.alignment == 0 for b in bufs)
    assert all(b.ptr % a.memory_info.alignment == 0 for b in bufs)


def test_host_memory_is_usable_and_views_survive_free() -> None:
    a = arena()
    buf = a.alloc(4096)
    t = aioep.Tensor(buf, (1024,), "int32")
    view = t.numpy()
    view[:] = np.arange(1024)
    assert t.numpy()[100] == 100
    del t
    buf.free()
    a.shrink()
    assert view[100] == 100  # the region's memory is still owned by the view


def test_close_returns_regions_and_closes_base() -> None:
    base = HostAllocator()
    a = ArenaAllocator(base)
    a.alloc(100).free()
    a.close()
    assert a.closed
    assert base.closed
    assert base.live_buffers == 0
    with pytest.raises(aioep.ClosedError):
        a.alloc(10)


def test_close_with_live_buffers_waits_for_them() -> None:
    base = HostAllocator()
    a = ArenaAllocator(base)
    buf = a.alloc(100)
    other = a.alloc(5 * MiB)
    other.free()
    a.close()
    assert not base.closed
    assert base.live_buffers == 1
    buf.free()
    assert base.closed
    assert base.live_buffers == 0


def test_retire_closes_after_last_buffer() -> None:
    base = HostAllocator()
    a = ArenaAllocator(base)
    buf = a.alloc(100)
    a.retire()
    assert not a.closed
    del buf
    gc.collect()
    assert a.closed
    assert base.closed


def test_dropping_buffers_frees_them() -> None:
    a = arena()
    for _ in range(100):
        a.alloc(1000)
    assert a.stats()["InUse"] == 0
    assert a.live_buffers == 0


# -- invariants ----------------------------------------------------------------------------------


def check_invariants(a: ArenaAllocator, live: list[aioep.Buffer]) -> None:
    chunks = a.chunks()  # coalesces parked chunks first
    regions = a.regions()
    by_region: dict[int, list[tuple[int, int, bool, Any]]] = {}
    it = iter(chunks)
    for start, size in regions:
        ptr = start
        group = by_region.setdefault(start, [])
        while ptr < start + size:
            c = next(it)
            assert c[0] == ptr, "chunks tile each region with no gap or overlap"
            group.append(c)
            ptr += c[1]
        assert ptr == start + size, "every byte of a region is in exactly one chunk"
    assert next(it, None) is None
    reserved = a.stats()
    for group in by_region.values():
        for left, right in itertools.pairwise(group):
            if not left[2] and not right[2]:
                assert left[3] is not right[3], "coalescing left two free same-stream chunks"
    in_use_chunks = {c[0]: c[1] for c in chunks if c[2]}
    for buf in live:
        assert buf.ptr in in_use_chunks
        assert buf.nbytes <= in_use_chunks[buf.ptr]
        assert buf.ptr % a.memory_info.alignment == 0
    spans = sorted((b.ptr, b.ptr + b.nbytes) for b in live)
    for (_, e0), (s1, _) in itertools.pairwise(spans):
        assert e0 <= s1
    stats = reserved
    assert stats["InUse"] == sum(in_use_chunks.values())
    assert stats["InUseRequested"] == sum(b.nbytes for b in live)
    assert stats["TotalAllocated"] == sum(size for _, size in regions)
    assert stats["LiveBuffers"] == len(live) == len(in_use_chunks)
    assert stats["MaxInUse"] >= stats["InUse"]
    free_sizes = [c[1] for c in chunks if not c[2]]
    assert stats["LargestFreeBlock"] == max(free_sizes, default=0)


def check_pool_index(a: ArenaAllocator, live: list[aioep.Buffer]) -> None:
    """The pool's indexes (each core's bins, address map and per-stream index of free
    chunks; the parked and cached lists and the table hits look in) against a
    brute-force walk of the chunks, without taking the parked chunks back (as
    ``chunks()`` does)."""
    assert a.live_buffers == len(live)  # (takes released chunks back, parks them)
    assert not a._returned
    pool = a._pool
    parked_ids: set[int] = set()
    for core in pool.cores:
        chunks = [c for r in core.regions for c in _region_chunks(r.head)]
        free = [c for c in chunks if not c.in_use and not c.region.dedicated]
        assert {c.ptr: id(c) for c in free} == {p: id(c) for p, c in core.free_at.items()}
        keys = sorted(c.size << 64 | c.ptr for c in free)
        assert sorted(k for b in core.bins for k in b) == keys
        tagged: dict[object, set[int]] = {}
        for c in free:
            if c.tag is not None:
                tagged.setdefault(c.tag, set()).add(id(c))
        assert {t: {id(c) for c in d.values()} for t, d in core.tagged.items()} == tagged
    lists = [(None, cls, chunks) for cls, chunks in pool.parked.items()]
    for cls, per in pool.stream_parked.items():
        assert per, "no empty stream dicts"
        lists += [(owner, cls, chunks) for owner, chunks in per.items()]
    for owner, cls, chunks in lists:
        assert owner is None or chunks, "no empty stream lists"
        assert len(chunks) <= MAX_PARKED
        if owner is None:  # smallest, lowest address first (hits pop(0))
            assert [c.key for c in chunks] == sorted(c.key for c in chunks)
            assert all(c.key == c.size << 64 | c.ptr for c in chunks)
        else:  # highest address first (pop() gives the lowest)
            assert [c.ptr for c in chunks] == sorted((c.ptr for c in chunks), reverse=True)
        for c in chunks:
            assert c.in_use
            assert c.tag is owner
            assert c.cls == cls
            assert c.region.core is pool.small
            assert owner is not None or c.home is chunks, "a host chunk's home is its list"
            assert id(c) not in parked_ids, "a chunk parked twice"
            parked_ids.add(id(c))
    for octave, chunks in enumerate(pool.cached):  # freed large host chunks, as they are
        assert len(chunks) <= MAX_PARKED
        assert [c.key for c in chunks] == sorted(c.key for c in chunks)
        assert all(c.key == c.size << 64 | c.ptr for c in chunks)
        for c in chunks:
            assert c.in_use
            assert c.tag is None
            assert c.size > PARK_MAX
            assert c.size.bit_length() == octave
            assert c.home is chunks
            assert not c.region.dedicated
            assert id(c) not in parked_ids, "a chunk cached twice"
            parked_ids.add(id(c))
    # The lists hits pop are the host lists, each under the sizes of its class.
    for i, chunks in enumerate(a._table):
        if chunks is not None:
            assert pool.parked[a._size_class((i << 8) + 1)] is chunks
            assert pool.parked[a._size_class((i + 1) << 8)] is chunks
    # The statistics the hits keep, against the live buffers (stats() would take the
    # parked and cached chunks back first).
    sized = [b for b in live if b.nbytes]
    assert a._in_use == sum(b._chunk.size for b in sized)  # type: ignore[attr-defined]
    assert a._max_in_use >= a._in_use
    held = {id(b._chunk) for b in sized}  # type: ignore[attr-defined]
    in_use = {
        id(c)
        for core in pool.cores
        for r in core.regions
        for c in _region_chunks(r.head)
        if c.in_use
    }
    assert in_use == held | parked_ids, "every chunk in use is a live buffer's or parked"


def _region_chunks(head: Any) -> list[Any]:
    out = []
    while head is not None:
        out.append(head)
        head = head.next
    return out


_op = st.one_of(
    st.tuples(st.just("alloc"), st.integers(1, 300_000), st.integers(0, 2)),
    st.tuples(st.just("alloc"), st.sampled_from([256, 4096, 5000, 70_000]), st.integers(0, 2)),
    st.tuples(st.just("alloc"), st.integers(PARK_MAX, 4 * MiB), st.integers(0, 2)),
    st.tuples(st.just("free"), st.integers(0, 1000), st.just(0)),
    st.tuples(st.just("drop"), st.integers(0, 1000), st.just(0)),
    st.tuples(st.just("sync"), st.integers(0, 2), st.integers(0, 2)),
    st.tuples(st.just("complete"), st.integers(1, 2), st.just(0)),
    st.tuples(st.just("release"), st.integers(1, 2), st.just(0)),
    st.tuples(st.just("shrink"), st.just(0), st.just(0)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(_op, max_size=60),
    initial=st.sampled_from([4096, 65536, MiB]),
    strategy=st.sampled_from(list(ArenaExtendStrategy)),
)
def test_random_sequences_keep_invariants(
    ops: list[tuple[str, int, int]], initial: int, strategy: ArenaExtendStrategy
) -> None:
    """Random allocations on three streams (none, and two that never finish unless told
    to), frees, drops, waits, completions, stream releases and shrinks: the pool's
    indexes match a brute-force walk after every step, then the chunks tile the regions
    and the statistics match the live buffers."""
    a = arena(initial_chunk_size_bytes=initial, extend_strategy=strategy)
    streams: list[SyncStream | None] = [None, mock_stream(), mock_stream()]
    live: list[aioep.Buffer] = []
    for step, (kind, x, y) in enumerate(ops):
        if kind == "alloc":
            live.append(a.alloc(x, stream=streams[y]))
        elif kind == "free" and live:
            live.pop(x % len(live)).free()
        elif kind == "drop" and live:
            del live[x % len(live)]
        elif kind == "sync" and x and y and x != y:
            producer, consumer = streams[x], streams[y]
            assert producer is not None
            assert consumer is not None
            consumer.wait(producer.record())
        elif kind == "complete":
            impl = streams[x].impl  # type: ignore[union-attr]
            assert isinstance(impl, _MockStream)
            impl.complete()
        elif kind == "release":
            a.release_stream_buffers(streams[x])  # type: ignore[arg-type]
        elif kind == "shrink":
            a.shrink()
        check_pool_index(a, live)
        if step % 4 == 3:  # (it takes the parked and cached chunks back: not every step)
            check_invariants(a, live)
    check_invariants(a, live)
    for buf in live:
        buf.free()
    check_pool_index(a, [])
    check_invariants(a, [])
    assert a.stats()["InUse"] == 0


# -- stream rules --------------------------------------------------------------------------------


def test_two_stream_allocation_replays_ort() -> None:
    """ORT's StreamAwareArenaTest.TwoStreamAllocation, step by step (4 KiB chunks)."""
    a = arena(max_mem=1 << 30)
    s1, s2 = mock_stream(), mock_stream()
    k4 = 4096
    s1_a = a.alloc(k4, stream=s1)
    s2_a = a.alloc(k4, stream=s2)
    s1_a_ptr, s2_a_ptr = s1_a.ptr, s2_a.ptr
    s1_a.free()
    s2_b = a.alloc(k4, stream=s2)
    assert s2_b.ptr != s1_a_ptr  # s2 cannot reuse s1's chunk
    s2_a.free()
    s1_c = a.alloc(k4, stream=s1)
    assert s1_c.ptr == s1_a_ptr  # the same stream reuses it
    s1_d = a.alloc(k4, stream=s1)
    assert s1_d.ptr != s2_a_ptr
    s2_b.free()
    a.release_stream_buffers(s2)
    s1_e = a.alloc(2 * k4, stream=s1)
    assert s1_e.ptr == s2_a_ptr  # s2's two chunks, coalesced and released
    s1_c_ptr, s1_d_ptr, s1_e_ptr = s1_c.ptr, s1_d.ptr, s1_e.ptr
    s1_c.free()
    s1_d.free()
    # s2 waits on a notification s1 recorded after those frees (s1 sync id 0 -> 1)
    s2.wait(s1.record())
    s2_c = a.alloc(k4, stream=s2)
    assert s2_c.ptr == s1_c_ptr
    s2_d = a.alloc(k4, stream=s2)
    assert s2_d.ptr == s1_d_ptr
    s1_f = a.alloc(k4, stream=s1)
    s1_f_ptr = s1_f.ptr
    s1_f.free()  # freed after the notification s2 waited on
    s2_e = a.alloc(k4, stream=s2)
    assert s2_e.ptr != s1_f_ptr
    s1_e.free()
    a.release_stream_buffers(s1)
    s2_f = a.alloc(2 * k4, stream=s2)
    assert s2_f.ptr == s1_e_ptr
    for b in (s2_c, s2_d, s2_e, s2_f):
        b.free()
    check_invariants(a, [])


def test_notification_recorded_before_the_free_does_not_count() -> None:
    a = arena()
    s1, s2 = mock_stream(), mock_stream()
    early = s1.record()
    buf = a.alloc(4096, stream=s1)
    ptr = buf.ptr
    buf.free()
    s2.wait(early)
    other = a.alloc(4096, stream=s2)
    assert other.ptr != ptr
    s2.wait(s1.record())  # recorded after the free: now it may
    again = a.alloc(4096, stream=s2)
    assert again.ptr == ptr
    del other, again


def test_waits_propagate_through_a_third_stream() -> None:
    # s3 waits on s2, which had waited on s1: s3 has transitively waited on s1 (ORT's sync table).
    a = arena()
    s1, s2, s3 = mock_stream(), mock_stream(), mock_stream()
    buf = a.alloc(4096, stream=s1)
    ptr = buf.ptr
    buf.free()
    s2.wait(s1.record())
    s3.wait(s2.record())
    assert a.alloc(4096, stream=s3).ptr == ptr


def test_completed_point_allows_reuse() -> None:
    a = arena()
    s1, s2 = mock_stream(), mock_stream()
    buf = a.alloc(4096, stream=s1)
    ptr = buf.ptr
    buf.free()
    mark = s1.record()
    taken = a.alloc(4096, stream=s2)
    assert taken.ptr != ptr
    taken.free()
    impl = s1.impl
    assert isinstance(impl, _MockStream)
    impl.completed = impl.enqueued  # the device passed the mark
    assert mark.done()
    assert a.alloc(4096, stream=s2).ptr == ptr
    # a host (stream-less) request may take it too once the stream is done
    b2 = a.alloc(4096, stream=s1)
    b2.free()
    assert a.alloc(4096).ptr == b2.ptr


def _free_in_thread(buf: aioep.Buffer) -> None:
    """Free ``buf`` on another thread and fail if that blocks (as it would on the loop)."""
    freed = threading.Event()
    t = threading.Thread(target=lambda: (buf.free(), freed.set()), daemon=True)
    t.start()
    assert freed.wait(10), "freeing the buffer blocked until its stream passed"


@pytest.mark.parametrize("callbacks", [True, False], ids=["notified", "polled"])
def test_reserved_region_goes_back_only_once_its_stream_passes(callbacks: bool) -> None:
    base = HostAllocator()
    a = ArenaAllocator(base)
    s = mock_stream(callbacks=callbacks)
    big = a.reserve(4 * MiB, stream=s)
    region = (big.ptr, 4 * MiB)
    _free_in_thread(big)
    del big
    assert region in a.regions()  # the stream may still be using it
    assert base.stats()["LiveBuffers"] == 1
    impl = s.impl
    assert isinstance(impl, _MockStream)
    impl.complete()
    if not callbacks:
        assert region in a.regions()  # nothing told the arena: its next call checks
        assert a.shrink() == 4 * MiB
    assert region not in a.regions()
    assert base.stats()["LiveBuffers"] == 0
    assert a.stats()["TotalAllocated"] == 0


def test_polled_region_goes_back_before_the_arena_extends() -> None:
    base = HostAllocator()
    a = ArenaAllocator(base, ArenaConfig(max_mem=6 * MiB))
    s = mock_stream()
    _free_in_thread(a.reserve(4 * MiB, stream=s))
    with pytest.raises(DeviceError, match="out of memory"):
        a.alloc(4 * MiB)  # the stream has not passed: the region still counts
    impl = s.impl
    assert isinstance(impl, _MockStream)
    impl.complete()
    buf = a.alloc(4 * MiB)  # the region went back, so the arena could extend
    assert a.stats()["TotalAllocated"] == 4 * MiB
    buf.free()


def test_closing_waits_for_a_polled_region_then_retires_the_base() -> None:
    base = HostAllocator()
    a = ArenaAllocator(base)
    s = mock_stream()
    _free_in_thread(a.reserve(4 * MiB, stream=s))
    closer = threading.Thread(target=a.close, daemon=True)
    closer.start()
    closer.join(0.1)
    assert closer.is_alive()  # closing, off the loop, waits for the stream
    assert base.stats()["LiveBuffers"] == 1
    impl = s.impl
    assert isinstance(impl, _MockStream)
    impl.complete()
    closer.join(10)
    assert not closer.is_alive()
    assert base.stats()["LiveBuffers"] == 0
    assert a.regions() == []


def test_unsynchronised_stream_never_gets_pending_memory() -> None:
    a = arena(initial_chunk_size_bytes=8192)
    s1, s2 = mock_stream(), mock_stream()
    bufs = [a.alloc(4096, stream=s1) for _ in range(2)]
    ptrs = {b.ptr for b in bufs}
    del bufs
    taken = [a.alloc(4096, stream=s2) for _ in range(4)]  # the arena extends instead
    assert not ptrs & {b.ptr for b in taken}
    assert a.alloc(4096).ptr not in ptrs  # nor a stream-less request
    assert a.stats()["NumArenaExtensions"] >= 2


def test_closed_stream_chunks_become_anyones() -> None:
    a = arena(initial_chunk_size_bytes=4096)
    s1 = mock_stream()
    buf = a.alloc(4096, stream=s1)
    ptr = buf.ptr
    buf.free()
    s1._release()  # closed: all its work is complete
    assert a.alloc(4096).ptr == ptr
    assert a.stats()["NumArenaExtensions"] == 1


# -- threads -------------------------------------------------------------------------------------


def test_threads_alloc_and_free_concurrently() -> None:
    a = arena(initial_chunk_size_bytes=64 * 1024)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[tuple[aioep.Buffer, int]] = []
        try:
            for _ in range(400):
                if mine and rng.random() < 0.45:
                    buf, tag = mine.pop(rng.randrange(len(mine)))
                    got = ctypes.string_at(buf.ptr, buf.nbytes)
                    assert got == bytes([tag]) * buf.nbytes, "another thread wrote into my chunk"
                    buf.free()
                else:
                    n = rng.choice((64, 300, 4096, 20_000, 100_000))
                    buf = a.alloc(n)
                    tag = rng.randrange(256)
                    ctypes.memset(buf.ptr, tag, n)
                    mine.append((buf, tag))
        except BaseException as exc:
            errors.append(exc)
        finally:
            mine.clear()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    check_invariants(a, [])
    assert a.stats()["InUse"] == 0


# -- a real race on the sim backend --------------------------------------------------------------


@pytest.mark.anyio
async def test_sim_cross_stream_reuse_races_without_the_wait_and_the_arena_avoids_it() -> None:
    """A "kernel" on stream s1 reads x after a gate; x is freed on the host meanwhile (as a
    session frees an activation once its last kernel is enqueued). Handing x's memory to s2
    without a wait really corrupts what s1 reads; the arena never does that, and after
    ``s2.wait(s1.record())`` it may, safely."""
    aioep_sim = pytest.importorskip("aioep_sim")
    n = 1 << 16
    src1 = np.full(n, 1, np.uint8)
    src2 = np.full(n, 2, np.uint8)
    async with aioep.Environment(autoload=False) as env:
        env.register_library("sim", aioep_sim.SimFactory, {"latency_us": 200})
        dev = env.ep_devices(ep_name="SimExecutionProvider")[0]
        info = dev.memory_info(MemoryType.DEFAULT)
        assert info is not None
        sim = dev.factory.device(info)
        a = env.create_shared_allocator(dev, MemoryType.DEFAULT, AllocatorType.ARENA)
        assert isinstance(a, ArenaAllocator)

        async def scenario(how: str) -> tuple[np.ndarray, bool]:
            out = np.zeros(n, np.uint8)
            async with dev.create_sync_stream() as s1, dev.create_sync_stream() as s2:
                x = a.alloc(n, stream=s1)
                await aioep.copy_tensors([src1], [aioep.Tensor(x, (n,), "uint8")], stream=s1)
                gate = HostNotification()
                try:
                    s1.wait(aioep.Notification(gate))
                    ptr = x.ptr

                    def kernel() -> None:  # reads x by address, as a device kernel would
                        out[:] = sim.memory.view(ptr, n)

                    s1.impl.enqueue(kernel)
                    x.free()  # on the host, while s1's kernel is still pending
                    if how == "raw":  # what a stream-unaware allocator would hand to s2
                        target = aioep.Buffer(ptr, n, a.memory_info)
                    else:
                        if how == "wait":
                            s2.wait(s1.record())
                        target = a.alloc(n, stream=s2)
                    write = aioep.copy_tensors(
                        [src2], [aioep.Tensor(target, (n,), "uint8")], stream=s2
                    )
                    if how != "wait":
                        await write  # s2 does not depend on s1: its write lands first
                finally:
                    gate.set()
                await s1
                await write
                return out, target.ptr == ptr

        corrupted, _ = await scenario("raw")
        assert (corrupted == 2).all(), "without the wait, reusing the memory really races"
        safe, same = await scenario("arena")
        assert not same
        assert (safe == 1).all()
        waited, same = await scenario("wait")
        assert same
        assert (waited == 1).all()


def test_wholly_free_regions_are_given_back_before_extending() -> None:
    a = arena(extend_strategy=ArenaExtendStrategy.SAME_AS_REQUESTED)
    keep = a.alloc(MiB)
    a.alloc(2 * MiB).free()  # a wholly free 2 MiB region that cannot serve 3 MiB
    assert sorted(size for _, size in a.regions()) == [MiB, 2 * MiB]
    big = a.alloc(3 * MiB)
    assert sorted(size for _, size in a.regions()) == [MiB, 3 * MiB]
    assert a.stats()["MaxTotalAllocated"] == 4 * MiB  # never 1 + 2 + 3 MiB at once
    assert a.stats()["NumArenaShrinkages"] == 1
    del keep, big


def test_a_region_a_stream_may_still_use_is_kept_when_extending() -> None:
    a = arena(extend_strategy=ArenaExtendStrategy.SAME_AS_REQUESTED)
    s1 = mock_stream()
    a.alloc(2 * MiB, stream=s1).free()  # s1 has not passed the work that used it
    big = a.alloc(3 * MiB)
    assert sorted(size for _, size in a.regions()) == [2 * MiB, 3 * MiB]
    del big


def test_size_classes_bound_the_rounding_and_make_nearby_sizes_reuse() -> None:
    a = arena()
    for n in (1, 255, 257, 4096, 5000, 4097, 3 * MiB + 1, 64 * MiB - 1):
        c = a._size_class(n)
        assert c >= n
        assert c % 256 == 0
        assert c - n < max(256, n // 8 + 1)  # at most 12.5% (or one 256-byte unit) more
    buf = a.alloc(3 * MiB + 1000)
    ptr, chunk_bytes = buf.ptr, a.stats()["InUse"]
    buf.free()
    other = a.alloc(3 * MiB + 5000)  # same class: the parked chunk is reused as is
    assert other.ptr == ptr
    assert a.stats()["InUse"] == chunk_bytes


def test_arena_buffer_free_is_idempotent_pinned_and_released_on_drop() -> None:
    a = arena()
    buf = a.alloc(1000)
    buf._pin()
    with pytest.raises(aioep.InUseError):
        buf.free()
    buf._unpin()
    assert not buf.freed
    buf.free()
    buf.free()
    assert buf.freed
    assert a.live_buffers == 0
    a.alloc(1000)  # dropped at once
    assert a.live_buffers == 0
    assert a.stats()["InUse"] == 0


@pytest.mark.parametrize("nbytes", [9151314442816847873, 1 << 63, (1 << 64) - 1])
def test_sizes_near_two_to_the_64_are_out_of_memory_not_a_crash(nbytes: int) -> None:
    """The fast path rounds such a size to a class whose cache list has no larger neighbour
    (it raised IndexError): the arena says it is out of memory, and stays usable."""
    arena = ArenaAllocator(HostAllocator())
    with pytest.raises(DeviceError, match="out of memory"):
        arena.alloc(nbytes)
    arena.alloc(64).free()
    assert arena.stats()["NumAllocs"] >= 1
