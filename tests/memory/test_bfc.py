"""The BFC core on its own (no streams, no locks): a hypothesis state machine checks it
against a model after every step."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from aioep import InvalidArgument
from aioep._memory.bfc import NUM_BINS, BfcCore, Chunk, bin_of

UNIT = 256
TAGS = (None, "a", "b")  # opaque tags: the core only compares them by identity


class BfcMachine(RuleBasedStateMachine):
    """Random regions, allocations (with tags and accept rules), frees, retags and region
    removals; the model is the set of live chunks and the regions' sizes."""

    freed = Bundle("freed")

    def __init__(self) -> None:
        super().__init__()
        self.core = BfcCore(UNIT)
        self.live: list[Chunk] = []
        self.region_sizes: dict[int, int] = {}
        self.next_ptr = 1 << 20

    @initialize(max_dead=st.sampled_from([UNIT, 4 * UNIT, 128 << 20]))
    def setup(self, max_dead: int) -> None:
        self.core = BfcCore(UNIT, max_dead)

    # -- rules -------------------------------------------------------------------------------
    @rule(units=st.integers(1, 64), gap=st.integers(0, 3), dedicated=st.booleans())
    def add_region(self, units: int, gap: int, dedicated: bool) -> None:
        size = units * UNIT - (17 if dedicated and units > 1 else 0)  # dedicated: any size
        ptr = self.next_ptr + gap * UNIT
        self.next_ptr = ptr + units * UNIT
        region = self.core.add_region(ptr, size, dedicated=dedicated)
        self.region_sizes[ptr] = size
        if dedicated:
            assert region.head.in_use
            self.live.append(region.head)

    @rule(
        nbytes=st.integers(1, 20 * UNIT),
        tag=st.sampled_from(TAGS),
        accepted=st.sets(st.sampled_from(TAGS[1:])),
    )
    def alloc(self, nbytes: int, tag: str | None, accepted: set[str]) -> None:
        rounded = -(-nbytes // UNIT) * UNIT

        def ok(c: Chunk) -> bool:
            return c.tag is None or c.tag == tag or c.tag in accepted

        candidates = [
            c
            for c in self.core.walk()
            if not c.in_use and not c.region.dedicated and c.size >= rounded and ok(c)
        ]
        best = min(candidates, key=lambda c: (c.size, c.ptr), default=None)
        best_size = best.size if best is not None else 0
        chunk = self.core.alloc(nbytes, tag, lambda c: c.tag in accepted)
        if not candidates:
            assert chunk is None, "a chunk came out of nowhere"
            return
        assert chunk is not None, "a fitting free chunk was not found"
        assert best is not None
        assert chunk.ptr == best.ptr, "best fit: the smallest fitting chunk, lowest address"
        rest = best_size - rounded  # split off when the rest is >= the request or max_dead
        split = rest and (rest >= rounded or rest >= self.core.max_dead)
        assert chunk.size == (rounded if split else best_size)
        assert chunk.in_use
        assert chunk.size >= nbytes
        assert chunk.size % UNIT == 0
        assert chunk.ptr % UNIT == 0
        self.live.append(chunk)

    @precondition(lambda self: bool(self.live))
    @rule(
        target=freed,
        data=st.data(),
        tag=st.sampled_from(TAGS),
        mark=st.integers(0, 5),
    )
    def free(self, data: st.DataObject, tag: str | None, mark: int) -> Chunk:
        chunk = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        merged = self.core.free(chunk, tag, mark)
        assert not merged.in_use
        assert merged.tag is tag
        assert merged.mark >= mark
        assert merged.ptr <= chunk.ptr < merged.ptr + merged.size
        return chunk

    @rule(chunk=freed)
    def double_or_foreign_free_is_refused(self, chunk: Chunk) -> None:
        if chunk.in_use:  # handed out again since: free it from another core instead
            with pytest.raises(InvalidArgument):
                BfcCore(UNIT).free(chunk)
            return
        with pytest.raises(InvalidArgument):
            self.core.free(chunk)

    @rule(data=st.data(), tag=st.sampled_from(TAGS), mark=st.integers(0, 5))
    def retag(self, data: st.DataObject, tag: str | None, mark: int) -> None:
        free = self.core.free_chunks()
        if not free:
            return
        chunk = free[data.draw(st.integers(0, len(free) - 1))]
        merged = self.core.retag(chunk, tag, mark)
        assert merged is not None
        assert merged.ptr <= chunk.ptr < merged.ptr + merged.size

    @rule(data=st.data())
    def remove_region(self, data: st.DataObject) -> None:
        regions = list(self.core.regions)
        if not regions:
            return
        region = regions[data.draw(st.integers(0, len(regions) - 1))]
        if not region.wholly_free:
            with pytest.raises(InvalidArgument):
                self.core.remove_region(region)
            return
        self.core.remove_region(region)
        del self.region_sizes[region.ptr]
        with pytest.raises(InvalidArgument):
            self.core.remove_region(region)

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def regions_are_tiled_exactly(self) -> None:
        assert {r.ptr: r.size for r in self.core.regions} == self.region_sizes
        for region in self.core.regions:
            ptr, prev = region.ptr, None
            c: Chunk | None = region.head
            while c is not None:
                assert c.ptr == ptr, "chunks tile each region with no gap or overlap"
                assert c.region is region
                assert c.prev is prev
                assert c.size > 0
                ptr += c.size
                prev, c = c, c.next
            assert ptr == region.ptr + region.size

    @invariant()
    def live_chunks_never_overlap(self) -> None:
        spans = sorted((c.ptr, c.ptr + c.size) for c in self.live)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start
        in_use = {c.ptr for c in self.core.walk() if c.in_use}
        assert in_use == {c.ptr for c in self.live}

    @invariant()
    def free_neighbours_of_one_tag_are_merged(self) -> None:
        for region in self.core.regions:
            c = region.head
            while c.next is not None:
                if not c.in_use and not c.next.in_use:
                    assert c.tag is not c.next.tag, "two adjacent free chunks of one tag"
                c = c.next

    @invariant()
    def bins_hold_exactly_the_free_chunks(self) -> None:
        binned = self.core.free_chunks()
        free = [c for c in self.core.walk() if not c.in_use and not c.region.dedicated]
        assert sorted(id(c) for c in binned) == sorted(id(c) for c in free)
        keys = 0
        for i, entries in enumerate(self.core.bins):
            assert entries == sorted(entries)
            assert bool(entries) == bool(self.core.nonempty >> i & 1)
            for key in entries:
                size, ptr = key >> 64, key & ((1 << 64) - 1)
                c = self.core.free_at[ptr]
                assert (size, ptr) == (c.size, c.ptr)
                assert i == min((size // UNIT).bit_length() - 1, NUM_BINS - 1) == bin_of(size)
            keys += len(entries)
        assert keys == len(self.core.free_at) == len(free)

    @invariant()
    def the_tag_index_is_a_brute_force_walk(self) -> None:
        expected: dict[object, set[int]] = {}
        for c in self.core.walk():
            if not c.in_use and not c.region.dedicated and c.tag is not None:
                expected.setdefault(c.tag, set()).add(id(c))
        got = {tag: {id(c) for c in chunks.values()} for tag, chunks in self.core.tagged.items()}
        assert got == expected
        for tag, ids in expected.items():
            assert {id(c) for c in self.core.tagged_chunks(tag)} == ids
            for c in self.core.tagged_chunks(tag):
                assert self.core.tagged[tag][c.ptr] is c

    @invariant()
    def stats_equal_the_models(self) -> None:
        core = self.core
        assert core.in_use == sum(c.size for c in self.live)
        assert core.chunks_in_use == len(self.live)
        assert core.reserved == sum(self.region_sizes.values())
        free = [c.size for c in core.walk() if not c.in_use and not c.region.dedicated]
        assert core.largest_free() == max(free, default=0)


BfcMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_bfc_core_state_machine = BfcMachine.TestCase


def test_add_region_rejects_sizes_off_the_unit() -> None:
    core = BfcCore(UNIT)
    with pytest.raises(InvalidArgument):
        core.add_region(0, UNIT + 1)
    with pytest.raises(InvalidArgument):
        core.add_region(0, 0, dedicated=True)
    with pytest.raises(InvalidArgument):
        BfcCore(128)


def test_split_follows_max_dead_bytes() -> None:
    # A 4-unit chunk serving 3 units leaves 1 unit: split only when max_dead allows it.
    for max_dead, split in ((128 << 20, False), (UNIT, True)):
        core = BfcCore(UNIT, max_dead)
        core.add_region(0, 4 * UNIT)
        chunk = core.alloc(3 * UNIT)
        assert chunk is not None
        assert chunk.size == (3 * UNIT if split else 4 * UNIT)
        assert core.in_use == chunk.size


def test_tags_keep_free_chunks_apart_until_retagged() -> None:
    core = BfcCore(UNIT)
    core.add_region(0, 2 * UNIT)
    a, b = core.alloc(UNIT), core.alloc(UNIT)
    assert a is not None
    assert b is not None
    core.free(a, "s1", 3)
    core.free(b, "s2", 5)
    assert len(core.free_chunks()) == 2  # different tags never merge
    assert core.alloc(UNIT, "s3") is None  # nor go to another tag without accept
    assert core.alloc(UNIT, "s3", lambda c: c.tag == "s2") is b
    core.free(b, "s1", 5)
    (merged,) = core.free_chunks()
    assert (merged.size, merged.mark) == (2 * UNIT, 5)  # merged, keeping the later mark
    assert core.retag(merged) is merged
    assert merged.tag is None
    assert merged.mark == 0
