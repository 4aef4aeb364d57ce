"""The arena's fast path (parked chunks per stream and size class) and region policies:
it never hands out memory a stream may still be using, it gives chunks back to the BFC
core on pressure, and 8 threads churning hypothesis-generated traces keep live chunks
apart and the statistics exact."""

from __future__ import annotations

import ctypes
import itertools
import sys
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_arena import _MockStream, check_invariants, mock_stream

import aioep
from aioep._environment.host import HostAllocator
from aioep._memory.arena import ArenaAllocator, ArenaConfig, ArenaExtendStrategy
from aioep._memory.arena_parking import MAX_PARKED, PARK_MAX
from aioep._plugin.stream import SyncStream

MiB = 1 << 20


def arena(**config: Any) -> ArenaAllocator:
    return ArenaAllocator(HostAllocator(), ArenaConfig(**config))


def complete(stream: SyncStream) -> None:
    impl = stream.impl
    assert isinstance(impl, _MockStream)
    impl.complete()


# -- the stream rule on the fast path ------------------------------------------------------------


def test_a_stream_gets_its_own_freed_chunk_back_at_once() -> None:
    a = arena()
    s1 = mock_stream()
    first = a.alloc(4096, stream=s1)
    ptr = first.ptr
    first.free()
    for _ in range(5):
        again = a.alloc(4096, stream=s1)
        assert again.ptr == ptr
        assert a.stats()["InUse"] == 4096
        again.free()
    assert a.stats()["InUse"] == 0
    assert a.stats()["NumArenaExtensions"] == 1


@pytest.mark.parametrize("n", [1, MAX_PARKED, MAX_PARKED + 3])
def test_parked_chunks_of_a_busy_stream_never_go_to_another(n: int) -> None:
    a = arena()
    s1, s2 = mock_stream(), mock_stream()
    bufs = [a.alloc(4096, stream=s1) for _ in range(n)]
    pending = {b.ptr for b in bufs}
    for b in bufs:
        b.free()  # s1 has not passed the work that used them
    del bufs
    for _ in range(3):
        taken = [a.alloc(4096, stream=s2) for _ in range(n)]
        taken += [a.alloc(4096) for _ in range(n)]  # nor a host request
        assert not pending & {b.ptr for b in taken}
        for b in taken:
            b.free()
    s2.wait(s1.record())  # now s2 may take them (and its own, and anyone's)
    after = [a.alloc(4096, stream=s2) for _ in range(3 * n)]
    assert pending <= {b.ptr for b in after}
    check_invariants(a, after)


def test_host_requests_take_a_streams_parked_chunk_once_it_is_done() -> None:
    a = arena()
    s1 = mock_stream()
    buf = a.alloc(4096, stream=s1)
    ptr = buf.ptr
    buf.free()
    other = a.alloc(4096)  # kept: no freed host chunk of this class waits
    assert other.ptr != ptr
    complete(s1)
    assert a.alloc(4096).ptr == ptr
    del other


def test_a_stream_that_was_idle_at_the_free_leaves_the_chunk_to_anyone() -> None:
    a = arena()
    s1, s2 = mock_stream(), mock_stream()
    buf = a.alloc(4096, stream=s1)
    ptr = buf.ptr
    complete(s1)
    buf.free()
    assert a.alloc(4096, stream=s2).ptr == ptr


def test_lowest_address_wins_among_the_chunks_a_request_may_take() -> None:
    a = arena()
    s1 = mock_stream()
    bufs = [a.alloc(4096, stream=s1) for _ in range(4)]
    ptrs = sorted(b.ptr for b in bufs)
    for b in reversed(bufs):
        b.free()
    del bufs
    got = [a.alloc(4096, stream=s1) for _ in range(4)]
    assert [b.ptr for b in got] == ptrs


# -- pressure ------------------------------------------------------------------------------------


def test_parked_chunks_go_back_before_the_arena_would_extend() -> None:
    a = arena(initial_chunk_size_bytes=MiB, max_mem=MiB)
    small = [a.alloc(n) for n in (4096, 8192, 20_000, 300, 70_000)]
    for b in small:
        b.free()  # parked: in the way of a request for the whole region
    del small
    whole = a.alloc(MiB)  # no room to extend: the parked chunks must merge back
    assert a.stats()["TotalAllocated"] == MiB
    assert a.stats()["NumArenaExtensions"] == 1
    whole.free()


def test_pressure_frees_only_the_parked_chunks_in_the_way() -> None:
    a = arena(initial_chunk_size_bytes=MiB, max_mem=MiB)
    low = a.alloc(4096)  # [0, 4K): parked below a live chunk, out of the way
    live = a.alloc(4096)
    top = a.alloc(65536)  # [8K, 72K): parked next to the free tail
    low_ptr = low.ptr
    low.free()
    top.free()
    big = a.alloc(MiB - 65536)  # a size class of its own; needs the tail and top's chunk
    assert big.ptr == live.ptr + 4096
    assert [c.ptr for c in a._pool.parked[4096]] == [low_ptr]  # still parked
    assert a.alloc(4096).ptr == low_ptr
    assert a.stats()["NumArenaExtensions"] == 1
    del live, big


def test_shrink_and_close_return_parked_chunks() -> None:
    base = HostAllocator()
    a = ArenaAllocator(base, ArenaConfig(initial_chunk_size_bytes=MiB))
    for n in (4096, 4096, 100, PARK_MAX):
        a.alloc(n).free()
    assert a.shrink() == MiB
    assert a.stats()["TotalAllocated"] == 0
    a.alloc(4096).free()
    a.close()
    assert base.closed
    assert base.live_buffers == 0


def test_large_chunks_are_not_parked_but_cached_until_looked_at() -> None:
    a = arena()
    big = a.alloc(PARK_MAX + 1)
    big.free()
    assert not any(a._pool.parked.values())
    assert [c.ptr for chunks in a._pool.cached for c in chunks] == [big.ptr]
    chunks = a.chunks()
    assert all(not in_use for _, _, in_use, _ in chunks)
    assert len(chunks) == 1  # merged back into the region once the chunks are looked at


# -- region policies -----------------------------------------------------------------------------


def test_fragmented_free_memory_extends_by_the_request_not_a_doubling() -> None:
    a = arena(initial_chunk_size_bytes=MiB)
    one, two, three = a.alloc(512 << 10), a.alloc(256 << 10), a.alloc(256 << 10)
    one.free()
    three.free()  # 768 KiB free, but no 600 KiB piece: fragmentation, not a lack of memory
    a.shrink()
    big = a.alloc(600 << 10)
    assert sorted(size for _, size in a.regions()) == [a._size_class(600 << 10), MiB]
    del two, big


def test_capacity_growth_still_doubles() -> None:
    a = arena()
    live = [a.alloc(MiB) for _ in range(7)]
    assert sorted(size for _, size in a.regions()) == [MiB, 2 * MiB, 4 * MiB]
    del live


def test_same_as_requested_resizes_a_free_region_that_would_waste_much() -> None:
    a = arena(extend_strategy=ArenaExtendStrategy.SAME_AS_REQUESTED)
    a.alloc(8 * MiB).free()
    buf = a.alloc(5 * MiB)  # taking the 8 MiB region whole would leave 3 MiB dead
    assert a.regions() == [(buf.ptr, 5 * MiB)]
    stats = a.stats()
    assert stats["InUse"] == 5 * MiB
    assert stats["MaxTotalAllocated"] == 8 * MiB  # given back first: the peak never grows
    assert stats["NumArenaShrinkages"] == 1
    buf.free()


def test_same_as_requested_keeps_a_region_a_stream_may_still_use() -> None:
    a = arena(extend_strategy=ArenaExtendStrategy.SAME_AS_REQUESTED)
    s1 = mock_stream()
    a.alloc(8 * MiB, stream=s1).free()
    region = a.regions()[0]
    buf = a.alloc(5 * MiB, stream=s1)  # its own stream: taken whole, never given back
    assert a.regions() == [region]
    buf.free()


# -- 8 threads -----------------------------------------------------------------------------------

_SIZES = st.sampled_from([256, 4096, 4096, 5000, 70_000, PARK_MAX, PARK_MAX + 4096, 3 * MiB])
_THREAD_OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "alloc", "free"]), _SIZES, st.booleans()),
    max_size=40,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    traces=st.lists(_THREAD_OPS, min_size=8, max_size=8), initial=st.sampled_from([MiB, 8 * MiB])
)
def test_eight_threads_churning_keep_chunks_apart_and_stats_exact(
    traces: list[list[tuple[str, int, bool]]], initial: int
) -> None:
    """Threads 0-3 allocate on their own stream (never completed, never waited on) or on
    none; 4-7 on none. Memory a stream freed stays that stream's (nobody else may take
    it), live buffers never overlap (each thread writes a pattern and checks it), and
    the statistics equal the live buffers at the end."""
    a = arena(initial_chunk_size_bytes=initial)
    streams = [mock_stream() if i < 4 else None for i in range(8)]
    seq = itertools.count()
    log: list[tuple[int, str, int, int, int]] = []  # (seq, kind, ptr, size, stream index)
    kept: list[list[aioep.Buffer]] = [[] for _ in range(8)]
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(i: int, ops: list[tuple[str, int, bool]]) -> None:
        mine: list[tuple[aioep.Buffer, int]] = []
        try:
            start.wait()
            for kind, n, on_stream in ops:
                if kind == "free" and mine:
                    buf, tag = mine.pop(0)
                    got = ctypes.string_at(buf.ptr, buf.nbytes)
                    assert got == bytes([tag]) * buf.nbytes, "another thread wrote into my chunk"
                    owner = i if buf.stream is not None else -1
                    log.append((next(seq), "free", buf.ptr, buf.nbytes, owner))
                    buf.free()
                elif kind == "alloc":
                    stream = streams[i] if on_stream else None
                    buf = a.alloc(n, stream=stream)
                    log.append((next(seq), "alloc", buf.ptr, n, i if stream is not None else -1))
                    tag = (i * 31 + len(mine)) % 255 + 1
                    ctypes.memset(buf.ptr, tag, n)
                    mine.append((buf, tag))
            kept[i] = [buf for buf, _ in mine]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, ops)) for i, ops in enumerate(traces)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so short traces really interleave
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    live = [buf for bufs in kept for buf in bufs]
    check_invariants(a, live)
    # Replay in log order: bytes a stream freed are that stream's from then on.
    owned: list[tuple[int, int, int]] = []  # (start, end, stream index)
    for _, kind, ptr, n, who in sorted(log):
        if kind == "free" and who >= 0:
            owned.append((ptr, ptr + n, who))
        elif kind == "alloc":
            for lo, hi, owner in owned:
                assert not (ptr < hi and lo < ptr + n and owner != who), (
                    f"thread {who} got memory stream {owner} freed and may still use"
                )
    for buf in live:
        buf.free()
    check_invariants(a, [])
    assert a.stats()["InUse"] == 0
    assert a.stats()["InUseRequested"] == 0
