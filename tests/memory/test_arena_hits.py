"""The arena's hits (a freed chunk handed out again without the lock): they never wait
for the arena, their statistics stay exact, freed large chunks are cached and taken
whole only when they fit closely, the cache goes back before the arena grows (or the
large pool grows when the cache's working set does not fit), and without the GIL
every request takes the locked path."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from test_arena import check_invariants, check_pool_index
from test_arena_pools import _SlowBase

import aioep._memory.arena as arena_module
from aioep._environment.host import HostAllocator
from aioep._memory.arena import ArenaAllocator, ArenaConfig, ArenaExtendStrategy
from aioep._memory.arena_parking import PARK_MAX
from aioep._memory.arena_pool import StreamPool

MiB = 1 << 20


def arena(**config: Any) -> ArenaAllocator:
    return ArenaAllocator(HostAllocator(), ArenaConfig(**config))


def test_a_hit_never_waits_for_the_arena_lock() -> None:
    """A thread inside the arena (growing it through a slow base allocator) holds its
    lock; another thread's requests whose freed chunks wait for them (a small class
    and a cached large chunk) are served at once."""
    base = _SlowBase()
    a = ArenaAllocator(base)
    held = [a.alloc(4096), a.alloc(3 * MiB)]  # freed (onto their lists) once it is busy
    grower = threading.Thread(target=lambda: a.alloc(32 * MiB).free())
    grower.start()
    assert base.entered.wait(30)
    served = threading.Event()
    got: list[int] = []

    def hits() -> None:
        for buf in held:
            buf.free()
        for n in (4096, 3 * MiB, 4000):
            buf = a.alloc(n)
            got.append(buf.ptr)
            buf.free()
        served.set()

    worker = threading.Thread(target=hits)
    worker.start()
    try:
        assert served.wait(10), "a hit waited for the arena's lock"
    finally:
        base.go.set()
        grower.join(30)
        worker.join(30)
    assert got == [held[0].ptr, held[1].ptr, held[0].ptr]  # 4000 and 4096: one class
    held.clear()
    stats = a.stats()
    assert stats["LiveBuffers"] == 0
    assert stats["NumAllocs"] == 6
    check_invariants(a, [])


def test_hits_keep_the_statistics_exact() -> None:
    a = arena()
    small, mid = a._size_class(4000), a._size_class(70_000)
    a.alloc(4096).free()  # misses: the chunks are made, then wait in their lists
    a.alloc(70_000).free()
    assert a._max_in_use == max(small, mid)  # (stats() would take the chunks back)
    hits = a._hit_count()
    x, y = a.alloc(4000), a.alloc(70_000)  # hits, both live at once: a new peak
    assert a._hit_count() == hits + 2
    stats = a.stats()
    assert stats["NumAllocs"] == 4
    assert stats["LiveBuffers"] == 2
    assert stats["InUse"] == small + mid
    assert stats["MaxInUse"] == small + mid
    assert stats["InUseRequested"] == 74_000
    check_pool_index(a, [x, y])
    del x, y
    stats = a.stats()
    assert (stats["InUse"], stats["InUseRequested"], stats["LiveBuffers"]) == (0, 0, 0)
    assert stats["MaxInUse"] == small + mid


def test_a_cached_large_chunk_is_taken_whole_only_when_it_fits_closely() -> None:
    a = arena()
    big = a.alloc(8 * MiB)
    ptr = big.ptr
    big.free()
    assert [c.ptr for chunks in a._pool.cached for c in chunks] == [ptr]  # cached, unmerged
    assert a._pool.take_cached(a._size_class(9 * MiB)) is None  # too small
    assert a._pool.take_cached(a._size_class(5 * MiB)) is None  # 8 MiB >= 1.5 x 5 MiB
    close = a.alloc(6 * MiB)  # 8 MiB < 1.5 x 6 MiB: the cached chunk, whole
    assert close.ptr == ptr
    assert a.stats()["InUse"] == 8 * MiB
    close.free()
    extensions = a.stats()["NumArenaExtensions"]
    loose = a.alloc(3 * MiB)  # 8 MiB would waste too much: it goes back and is split
    assert loose.ptr == ptr
    assert a.stats()["InUse"] == 3 * MiB
    assert a.stats()["NumArenaExtensions"] == extensions  # no growth for it
    loose.free()
    check_invariants(a, [])


def test_cached_large_chunks_go_back_before_the_arena_grows() -> None:
    a = arena()
    a.alloc(16 * MiB).free()
    regions = a.regions()
    parts = [a.alloc(4 * MiB) for _ in range(4)]  # the 16 MiB region, in four chunks
    assert a.regions() == regions
    for buf in parts:
        buf.free()  # cached: each too small for what comes next
    assert sum(len(chunks) for chunks in a._pool.cached) == 4
    whole = a.alloc(15 * MiB)  # fits once the cached chunks merge
    assert a.regions() == regions
    del whole


def test_same_as_requested_caches_no_large_chunk() -> None:
    a = arena(extend_strategy=ArenaExtendStrategy.SAME_AS_REQUESTED)
    a.alloc(8 * MiB).free()
    assert not any(a._pool.cached)
    assert a._take_cached is arena_module._no_chunk
    assert [in_use for _, _, in_use, _ in a.chunks()] == [False]


def test_a_working_set_of_large_sizes_grows_the_large_pool_instead_of_thrashing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Large sizes cycled one at a time, whose cached chunks together pass the large
    pool: the arena first gives cached chunks back to make room, then, as that keeps
    evicting chunks the next requests want while little of it is in use, grows; after
    that every request is a hit."""
    a = arena()
    sizes = [3 * MiB, 5 * MiB, 9 * MiB, 14 * MiB, 22 * MiB, 40 * MiB]
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
    for _ in range(3):
        for n in sizes:
            a.alloc(n).free()
    assert takes == 0  # no miss: every size came from the cache
    assert a.stats()["TotalAllocated"] < 4 * sum(sizes)


def test_a_busy_arena_evicts_its_cache_rather_than_grow() -> None:
    """When much of the arena is in use, cached chunks go back before it grows, however
    often that evicts: the cache never makes a busy arena bigger."""
    a = arena()
    a.alloc(64 * MiB).free()
    keep = a.alloc(30 * MiB)
    regions = a.regions()
    for _ in range(20):
        for n in (8 * MiB, 12 * MiB, 10 * MiB, 20 * MiB):  # together, more than is free
            a.alloc(n).free()
    assert a._pool.parking.evicted_large > a._pool.large.reserved  # past the thrashing mark
    assert a.regions() == regions
    del keep


def test_without_the_gil_every_request_takes_the_locked_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(arena_module, "_LOCK_FREE", False)
    a = arena()
    assert a._table is arena_module._NO_TABLE
    assert a._take_cached is arena_module._no_chunk
    first = a.alloc(4096)
    ptr = first.ptr
    first.free()
    assert a._returned  # released through the list the locked path takes back
    again = a.alloc(4096)
    assert again.ptr == ptr
    again.free()
    again._released = False  # a racing second release, replayed
    again.free()
    live = [a.alloc(4096), a.alloc(4096)]
    assert live[0].ptr == ptr != live[1].ptr  # came back once: never handed out twice
    live += [a.alloc(n) for n in (100, 70_000, PARK_MAX + 1, 3 * MiB)]
    check_pool_index(a, live)
    check_invariants(a, live)
    del live
    stats = a.stats()
    assert (stats["InUse"], stats["InUseRequested"], stats["LiveBuffers"]) == (0, 0, 0)
