"""The arena's two pools (small and large requests), its miss path (indexed: no walk of
the chunks), its growth policy for the fast path's working set, and its release list
(a release never waits for the arena; the release point is the free)."""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Any

import pytest
from test_arena import _MockStream, mock_stream

from aioep._environment.host import HostAllocator
from aioep._memory.arena import ArenaAllocator, ArenaConfig, ArenaExtendStrategy
from aioep._memory.arena_parking import PARK_MAX
from aioep._memory.arena_pool import StreamPool
from aioep._plugin.stream import SyncStream

MiB = 1 << 20


def arena(**config: Any) -> ArenaAllocator:
    return ArenaAllocator(HostAllocator(), ArenaConfig(**config))


def region_of(a: ArenaAllocator, ptr: int) -> tuple[int, int]:
    return next(r for r in a.regions() if r[0] <= ptr < r[0] + r[1])


# -- two pools -----------------------------------------------------------------------------------


def test_a_large_request_leaves_the_parked_small_chunks_alone() -> None:
    a = arena(initial_chunk_size_bytes=4 * MiB)
    for n in (256, 4096, 65536, PARK_MAX):
        a.alloc(n).free()
    assert a.live_buffers == 0  # (the arena takes the released chunks back)
    parked = {cls: [c.ptr for c in chunks] for cls, chunks in a._pool.parked.items() if chunks}
    assert len(parked) == 4  # the small requests' chunks are parked
    big = a.alloc(8 * MiB)  # the arena grows for it: nothing parked is taken back
    after = {cls: [c.ptr for c in chunks] for cls, chunks in a._pool.parked.items() if chunks}
    assert after == parked
    small_regions = {region_of(a, ptr) for ptrs in parked.values() for ptr in ptrs}
    assert region_of(a, big.ptr) not in small_regions  # a region of its own pool
    assert a.alloc(4096).ptr == parked[4096][-1]  # the fast path still has it
    del big


def test_a_large_request_takes_free_room_in_a_small_region_before_the_arena_grows() -> None:
    a = arena(initial_chunk_size_bytes=8 * MiB)
    small = a.alloc(4096)  # the arena's first region: 8 MiB, the small pool's
    big = a.alloc(3 * MiB)
    assert a.regions() == [(small.ptr, 8 * MiB)]
    assert a.stats()["NumArenaExtensions"] == 1
    del small, big


def test_a_small_request_borrows_the_large_pool_only_when_the_arena_cannot_grow() -> None:
    a = arena(initial_chunk_size_bytes=4 * MiB, max_mem=4 * MiB)
    big = a.alloc(3 * MiB // 2)  # the 4 MiB initial region, the large pool's, split
    assert a.regions() == [(big.ptr, 4 * MiB)]
    small = a.alloc(4096)  # no room under the limit for a small region: the tail it is
    assert big.ptr < small.ptr < big.ptr + 4 * MiB
    ptr = small.ptr
    small.free()
    assert a._pool.parked.get(4096) in (None, [])  # a large region's chunk is never parked
    assert len(a.chunks()) == 2  # merged back into the tail at once
    assert a.alloc(4096).ptr == ptr
    del big


def test_a_pool_that_starts_later_starts_at_the_growth_size() -> None:
    # ORT's first region is the initial chunk and its second the growth size; a large
    # initial chunk (preallocation) is reserved once, not once per pool.
    a = arena(initial_chunk_size_bytes=MiB, initial_growth_chunk_size_bytes=2 * MiB)
    big = a.alloc(3 * MiB)  # first region: the initial chunk doubled to fit, 4 MiB
    small = a.alloc(PARK_MAX)  # the small pool starts at the growth size
    assert sorted(size for _, size in a.regions()) == [2 * MiB, 4 * MiB]
    assert a.stats()["NumArenaExtensions"] == 2
    del big, small


# -- the miss path -------------------------------------------------------------------------------


def _lines_in_the_pool(fn: Any) -> int:
    """Lines of aioep/_memory/arena_pool.py and bfc.py run while calling ``fn``."""
    count = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        name = frame.f_code.co_filename
        if name.endswith(("arena_pool.py", "bfc.py")):
            if event == "line":
                count += 1
            return trace
        return None

    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def _misses_with_live_chunks(live: int) -> int:
    """The pool's lines for misses (requests that find no free chunk and no parked one of
    their class, so the arena gives parked chunks back or grows) with ``live`` small
    chunks in use in the same region."""
    a = arena(initial_chunk_size_bytes=4 * MiB)
    keep = [a.alloc(256) for _ in range(live)]
    for n in (4096, 8192, 12288):  # parked, in the way of nothing
        a.alloc(n).free()

    def misses() -> None:
        held = [a.alloc(n) for n in (200_000, 300_000, 400_000, 600_000, 900_000)]
        held += [a.alloc(n) for n in (3 * MiB, 5 * MiB)]
        del held

    lines = _lines_in_the_pool(misses)
    del keep
    return lines


def test_the_miss_path_does_not_walk_the_chunks() -> None:
    few, many = _misses_with_live_chunks(20), _misses_with_live_chunks(2000)
    assert many < 1.5 * few, (few, many)  # a walk of the chunks would be 100x the lines


# -- the fast path's working set -----------------------------------------------------------------


def test_a_working_set_larger_than_the_pool_grows_it_instead_of_thrashing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sizes cycled one at a time whose parked chunks together pass the pool: the arena
    first gives parked chunks back to make room (ORT reuses freed memory), then, as it
    keeps evicting chunks the fast path reuses, grows; after that every request is a
    fast-path hit."""
    a = arena(initial_chunk_size_bytes=MiB)
    sizes = [96 << 10, 160 << 10, 224 << 10, 320 << 10, 448 << 10, 640 << 10, 896 << 10]
    assert sum(a._size_class(n) for n in sizes) > MiB
    for _ in range(12):
        for n in sizes:
            a.alloc(n).free()
    takes = 0
    take = StreamPool.take

    def counted(self: StreamPool, *args: Any) -> Any:
        nonlocal takes
        takes += 1
        return take(self, *args)

    monkeypatch.setattr(StreamPool, "take", counted)
    for _ in range(5):
        for n in sizes:
            a.alloc(n).free()
    assert takes == 0  # no miss: every size came off its parked list
    assert a.stats()["NumArenaExtensions"] > 1


def test_cold_parked_chunks_go_back_before_the_arena_grows() -> None:
    a = arena(initial_chunk_size_bytes=MiB)
    a.alloc(512 << 10).free()  # parked once, never reused: cold
    buf = a.alloc(768 << 10)  # fits only once the parked chunk merges back
    assert a.stats()["NumArenaExtensions"] == 1
    assert a.regions() == [region_of(a, buf.ptr)]
    del buf


# -- the release list ----------------------------------------------------------------------------


class _SlowBase(HostAllocator):
    """A base allocator that blocks inside ``_allocate`` until told to go on."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.go = threading.Event()

    def _allocate(self, nbytes: int, stream: Any) -> int:
        if nbytes > 8 * MiB:
            self.entered.set()
            self.go.wait(30)
        return super()._allocate(nbytes, stream)


def test_a_release_never_waits_for_the_arena() -> None:
    """A thread inside the arena (growing it through a slow base allocator) holds its
    lock; freeing or dropping a buffer on another thread (the event loop's, say) still
    returns at once, and the chunk comes back with the arena's next call."""
    base = _SlowBase()
    a = ArenaAllocator(base)
    bufs = [a.alloc(4096) for _ in range(3)]
    grower = threading.Thread(target=lambda: a.alloc(32 * MiB).free())
    grower.start()
    assert base.entered.wait(30)
    released = threading.Event()

    def release() -> None:
        bufs[0].free()
        bufs.pop(0)
        bufs.pop(0)  # dropped
        released.set()

    releaser = threading.Thread(target=release)
    releaser.start()
    try:
        assert released.wait(10), "releasing a buffer waited for the arena's lock"
    finally:
        base.go.set()
        grower.join(30)
        releaser.join(30)
    assert a.stats()["LiveBuffers"] == 1
    assert a.live_buffers == 1
    bufs.clear()
    assert a.stats()["InUse"] == 0


def test_the_release_point_is_the_free_not_when_the_arena_takes_the_chunk_back() -> None:
    a = arena()
    s1, s2 = mock_stream(), mock_stream()
    buf = a.alloc(4096, stream=s1)
    ptr = buf.ptr
    buf.free()  # the arena has not taken the chunk back yet
    s2.wait(s1.record())  # recorded after the free: s2 is ordered after that work
    assert a.alloc(4096, stream=s2).ptr == ptr


def test_a_reserved_region_goes_back_to_the_base_at_once() -> None:
    base = HostAllocator()
    a = ArenaAllocator(base)
    big = a.reserve(4 * MiB)
    assert base.live_buffers == 1
    big.free()
    assert base.live_buffers == 0  # with no arena call in between
    dropped = a.reserve(4 * MiB)
    del dropped
    assert base.live_buffers == 0


def test_stream_lists_do_not_keep_streams_alive() -> None:
    a = arena()
    s = mock_stream()
    a.alloc(4096, stream=s).free()
    a.alloc(4096, stream=s)  # the fast path empties the stream's list
    assert all(s not in per for per in a._pool.stream_parked.values())
    assert 4096 not in a._pool.stream_parked


@pytest.mark.parametrize("strategy", list(ArenaExtendStrategy))
def test_both_pools_return_every_region_on_close(strategy: ArenaExtendStrategy) -> None:
    base = HostAllocator()
    a = ArenaAllocator(base, ArenaConfig(extend_strategy=strategy))
    s = mock_stream()
    live = [a.alloc(n, stream=st) for n in (300, 70_000, 3 * MiB) for st in (None, s)]
    for buf in live[::2]:
        buf.free()
    impl = s.impl
    assert isinstance(impl, _MockStream)
    impl.complete()
    a.close()
    assert not base.closed  # buffers are still live
    del live, buf
    assert base.closed
    assert base.live_buffers == 0


def test_streams_are_sync_streams() -> None:
    a = arena()
    with pytest.raises(Exception, match="SyncStream"):
        a.alloc(4096, stream=object())  # type: ignore[arg-type]
    assert isinstance(mock_stream(), SyncStream)
