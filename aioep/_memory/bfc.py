"""The best-fit-with-coalescing (BFC) core of the arena: regions, chunks, bins, split, merge.

Pure bookkeeping over address ranges (ORT's ``BFCArena`` without its allocator,
lock or streams): the caller adds regions it got from somewhere, and the core
carves them into chunks. Free chunks sit in bins by size class (256 B << i); a
request takes the smallest free chunk that fits (lowest address on ties) and
splits off the rest when that wastes too much; a freed chunk merges with its free
neighbours.

A bin is a sorted list of ints, ``size << 64 | ptr``: one ``bisect`` finds the
best fit, and inserting or removing a chunk is one ``bisect`` and one list edit
(ints compare in C, several times faster than tuples). ``free_at`` maps each binned
chunk's address to the chunk.

Free chunks carry an opaque ``tag`` (who may still be using the memory; ``None``
means nobody) and an int ``mark`` that the layer above interprets. A request
takes an untagged chunk, one tagged with its own tag, or one its ``accept``
predicate allows; neighbours merge only when their tags are the same object, and
the merged chunk keeps the larger mark. ``tagged`` indexes the binned chunks of
each tag, so the layer above finds a tag's free chunks without walking the bins.
Tags are compared by identity and must hash by it (any object that does not
override ``__eq__``). The arena builds its stream rule on that.

Not thread-safe: the arena calls it under its lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from .._base.errors import InvalidArgument

__all__ = ["MIN_ALLOCATION_SIZE", "NUM_BINS", "BfcCore", "Chunk", "Region", "bin_of"]

MIN_ALLOCATION_BITS = 8
MIN_ALLOCATION_SIZE = 1 << MIN_ALLOCATION_BITS  # 256 B, as ORT's kMinAllocationSize
NUM_BINS = 21  # bin i holds free chunks of [256 << i, 256 << (i + 1)); the last has no top
_KEY_SHIFT = 64  # a bin key is size << 64 | ptr: addresses are below 2**64
_PTR_MASK = (1 << _KEY_SHIFT) - 1
_bisect_left = bisect.bisect_left
_insort = bisect.insort
_new_chunk = object.__new__


def bin_of(size: int) -> int:
    """The bin that holds free chunks of ``size`` bytes."""
    b = (size >> MIN_ALLOCATION_BITS).bit_length() - 1
    return b if b < NUM_BINS else NUM_BINS - 1


class Chunk:
    """A span of a region: in use, or free in a bin (dedicated regions' heads are never binned).

    ``cls``, ``home``, ``key`` and ``req`` belong to the layer above (the size class
    it was handed out for, the list it goes back to when released, its sort key there,
    the bytes requested); the core never reads them.
    """

    __slots__ = (
        "cls",
        "home",
        "in_use",
        "key",
        "mark",
        "next",
        "prev",
        "ptr",
        "region",
        "req",
        "size",
        "tag",
    )

    def __init__(self, ptr: int, size: int, region: Region) -> None:
        self.ptr = ptr
        self.size = size
        self.region = region
        self.in_use = False
        self.tag: object = None
        self.mark = 0
        self.cls = size
        self.home: list[Chunk] | None = None
        self.key = 0
        self.req = 0
        self.prev: Chunk | None = None
        self.next: Chunk | None = None

    def __repr__(self) -> str:
        state = "in use" if self.in_use else f"free tag={self.tag!r} mark={self.mark}"
        return f"<Chunk {self.ptr:#x} size={self.size} {state}>"


class Region:
    """A contiguous range the core carves into chunks; ``handle`` is the caller's (its memory)."""

    __slots__ = ("core", "dedicated", "handle", "head", "ptr", "size")

    def __init__(self, core: BfcCore, ptr: int, size: int, handle: object, dedicated: bool) -> None:
        self.core: BfcCore | None = core  # None once removed
        self.ptr = ptr
        self.size = size
        self.handle = handle
        self.dedicated = dedicated  # one chunk, never split, binned or reused
        self.head = Chunk(ptr, size, self)

    @property
    def wholly_free(self) -> bool:
        """True when the region is one free chunk."""
        head = self.head
        return not head.in_use and head.next is None


class BfcCore:
    """Bins, chunks and regions of one arena pool, in units of ``unit`` bytes.

    Args:
        unit: every chunk size is a multiple of it (>= 256; the memory's alignment).
        max_dead: a chunk is split when the rest would be at least this many bytes
            (or at least the request): ORT's ``max_dead_bytes_per_chunk``.
    """

    def __init__(self, unit: int = MIN_ALLOCATION_SIZE, max_dead: int = 128 << 20) -> None:
        if unit < MIN_ALLOCATION_SIZE:
            raise InvalidArgument(f"BfcCore: unit must be >= {MIN_ALLOCATION_SIZE}, got {unit}")
        self.unit = unit
        self.max_dead = max_dead
        self.bins: list[list[int]] = [[] for _ in range(NUM_BINS)]
        self.free_at: dict[int, Chunk] = {}  # address -> binned free chunk
        self.tagged: dict[object, dict[int, Chunk]] = {}  # tag -> address -> binned chunk
        self.nonempty = 0  # bit i set <=> bin i has a free chunk
        self.regions: list[Region] = []
        self.in_use = 0  # bytes of chunks in use
        self.chunks_in_use = 0
        self.reserved = 0  # bytes of regions

    # -- regions -----------------------------------------------------------------------------
    def add_region(
        self, ptr: int, size: int, handle: object = None, *, dedicated: bool = False
    ) -> Region:
        """Add ``[ptr, ptr + size)``: a free chunk, or with ``dedicated`` one chunk in use.

        Raises:
            InvalidArgument: ``size`` is not a positive multiple of the unit (a
                dedicated region may have any size > 0), or the range passes 2**64.
        """
        if size <= 0 or (not dedicated and size % self.unit):
            raise InvalidArgument(f"BfcCore: region size {size} is not a multiple of {self.unit}")
        if ptr < 0 or ptr + size > 1 << _KEY_SHIFT:
            raise InvalidArgument(f"BfcCore: region {ptr:#x} + {size} is not a 64-bit range")
        region = Region(self, ptr, size, handle, dedicated)
        self.regions.append(region)
        self.reserved += size
        if dedicated:
            region.head.in_use = True
            self.in_use += size
            self.chunks_in_use += 1
        else:
            self._insert(region.head)
        return region

    def remove_region(self, region: Region) -> None:
        """Remove a wholly free region (its memory is the caller's to give back).

        Raises:
            InvalidArgument: it is not this core's, or a chunk of it is in use or split off.
        """
        if region.core is not self or not region.wholly_free:
            raise InvalidArgument(
                f"BfcCore: region {region.ptr:#x} is not a free region of this core"
            )
        if not region.dedicated:
            self._remove(region.head)
        region.core = None
        region.head.tag = None
        self.regions.remove(region)
        self.reserved -= region.size

    def free_regions(self) -> list[Region]:
        """Wholly free regions whose chunk has no tag (dedicated ones included)."""
        return [r for r in self.regions if r.wholly_free and r.head.tag is None]

    # -- chunks ------------------------------------------------------------------------------
    def round(self, nbytes: int) -> int:
        """``nbytes`` rounded up to the unit."""
        unit = self.unit
        return (nbytes + unit - 1) // unit * unit

    def alloc(
        self, nbytes: int, tag: object = None, accept: Callable[[Chunk], bool] | None = None
    ) -> Chunk | None:
        """The best-fitting free chunk of at least ``nbytes`` (rounded up to the unit), now in
        use, or None when none fits. A tagged chunk is taken only when its tag is ``tag``
        or ``accept(chunk)`` is true."""
        unit = self.unit
        rounded = (nbytes + unit - 1) // unit * unit
        b = (rounded >> MIN_ALLOCATION_BITS).bit_length() - 1
        if b >= NUM_BINS:
            b = NUM_BINS - 1
        mask = self.nonempty >> b
        bins = self.bins
        free_at = self.free_at
        lowest = rounded << _KEY_SHIFT
        while mask:
            if not mask & 1:
                skip = (mask & -mask).bit_length() - 1
                b += skip
                mask >>= skip
            keys = bins[b]
            for j in range(_bisect_left(keys, lowest), len(keys)):
                chunk = free_at[keys[j] & _PTR_MASK]
                owner = chunk.tag
                if owner is None or owner is tag or (accept is not None and accept(chunk)):
                    break
            else:
                b += 1
                mask >>= 1
                continue
            # Take it out of its bin (inlined _remove: this is the arena's large path).
            del keys[j]
            if not keys:
                self.nonempty &= ~(1 << b)
            ptr = chunk.ptr
            del free_at[ptr]
            if owner is not None:
                self._unindex(chunk)
            size = chunk.size
            rest = size - rounded
            if rest and (rest >= rounded or rest >= self.max_dead):
                # Split off the rest, a free chunk with the same tag and mark (inlined
                # _split and _insert; every slot set here, cheaper than Chunk(...)).
                new = _new_chunk(Chunk)
                new.ptr = nptr = ptr + rounded
                new.size = rest
                new.region = chunk.region
                new.in_use = False
                new.cls = rest
                new.home = None
                new.key = 0
                new.req = 0
                new.tag = owner
                new.mark = chunk.mark
                new.prev = chunk
                nxt = new.next = chunk.next
                if nxt is not None:
                    nxt.prev = new
                chunk.next = new
                chunk.size = size = rounded
                rb = (rest >> MIN_ALLOCATION_BITS).bit_length() - 1
                if rb >= NUM_BINS:
                    rb = NUM_BINS - 1
                _insort(bins[rb], rest << _KEY_SHIFT | nptr)
                self.nonempty |= 1 << rb
                free_at[nptr] = new
                if owner is not None:
                    chunks = self.tagged.get(owner)
                    if chunks is None:
                        self.tagged[owner] = {nptr: new}
                    else:
                        chunks[nptr] = new
            chunk.in_use = True
            self.in_use += size
            self.chunks_in_use += 1
            return chunk
        return None

    def free(self, chunk: Chunk, tag: object = None, mark: int = 0) -> Chunk:
        """Free a chunk in use, tagged ``tag`` at ``mark``; returns the chunk it merged into.

        A dedicated region's chunk is not binned: the caller removes the region.

        Raises:
            InvalidArgument: the chunk is not in use in this core (foreign or freed twice).
        """
        region = chunk.region
        if not chunk.in_use or region.core is not self:
            raise InvalidArgument(f"BfcCore: {chunk!r} is not a chunk in use in this core")
        chunk.in_use = False
        self.in_use -= chunk.size
        self.chunks_in_use -= 1
        chunk.tag = tag
        chunk.mark = mark
        if region.dedicated:
            return chunk
        if tag is not None:
            return self._coalesce(chunk)
        # An untagged chunk (the arena's large path): _coalesce with _remove and _insert
        # inlined, no tag index to keep.
        bins = self.bins
        free_at = self.free_at
        nxt = chunk.next
        if nxt is not None and not nxt.in_use and nxt.tag is None:
            size = nxt.size
            b = (size >> MIN_ALLOCATION_BITS).bit_length() - 1
            if b >= NUM_BINS:
                b = NUM_BINS - 1
            keys = bins[b]
            del keys[_bisect_left(keys, size << _KEY_SHIFT | nxt.ptr)]
            if not keys:
                self.nonempty &= ~(1 << b)
            del free_at[nxt.ptr]
            _join(chunk, nxt)
        prev = chunk.prev
        if prev is not None and not prev.in_use and prev.tag is None:
            size = prev.size
            b = (size >> MIN_ALLOCATION_BITS).bit_length() - 1
            if b >= NUM_BINS:
                b = NUM_BINS - 1
            keys = bins[b]
            del keys[_bisect_left(keys, size << _KEY_SHIFT | prev.ptr)]
            if not keys:
                self.nonempty &= ~(1 << b)
            del free_at[prev.ptr]
            _join(prev, chunk)
            chunk = prev
        size = chunk.size
        ptr = chunk.ptr
        b = (size >> MIN_ALLOCATION_BITS).bit_length() - 1
        if b >= NUM_BINS:
            b = NUM_BINS - 1
        _insort(bins[b], size << _KEY_SHIFT | ptr)
        self.nonempty |= 1 << b
        free_at[ptr] = chunk
        return chunk

    def retag(self, chunk: Chunk, tag: object = None, mark: int = 0) -> Chunk | None:
        """Give a free chunk a new tag and merge it; None when it is no longer a free chunk
        (merged into a neighbour meanwhile, or in use)."""
        if not self.is_binned(chunk):
            return None
        self._remove(chunk)
        chunk.tag = tag
        chunk.mark = mark
        return self._coalesce(chunk)

    def is_binned(self, chunk: Chunk) -> bool:
        """True when ``chunk`` is a free chunk in this core's bins."""
        return self.free_at.get(chunk.ptr) is chunk

    def free_chunks(self) -> list[Chunk]:
        """Every binned free chunk."""
        return list(self.free_at.values())

    def tagged_chunks(self, tag: object) -> list[Chunk]:
        """The binned free chunks tagged ``tag`` (not None)."""
        chunks = self.tagged.get(tag)
        return list(chunks.values()) if chunks else []

    def largest_free(self) -> int:
        """The size of the largest binned free chunk (0 when none)."""
        if not self.nonempty:
            return 0
        return self.bins[self.nonempty.bit_length() - 1][-1] >> _KEY_SHIFT

    def walk(self) -> Iterator[Chunk]:
        """Every chunk of every region, in address order."""
        for region in sorted(self.regions, key=lambda r: r.ptr):
            c: Chunk | None = region.head
            while c is not None:
                yield c
                c = c.next

    # -- internals ---------------------------------------------------------------------------
    def _split(self, chunk: Chunk, rounded: int, rest: int) -> None:
        new = _new_chunk(Chunk)  # every slot set here: cheaper than Chunk(...) on this path
        new.ptr = chunk.ptr + rounded
        new.size = rest
        new.region = chunk.region
        new.in_use = False
        new.cls = rest
        new.home = None
        new.key = 0
        new.req = 0
        new.tag = chunk.tag
        new.mark = chunk.mark
        new.prev = chunk
        nxt = new.next = chunk.next
        if nxt is not None:
            nxt.prev = new
        chunk.next = new
        chunk.size = rounded
        self._insert(new)

    def _insert(self, chunk: Chunk) -> None:
        size = chunk.size
        ptr = chunk.ptr
        b = (size >> MIN_ALLOCATION_BITS).bit_length() - 1
        if b >= NUM_BINS:
            b = NUM_BINS - 1
        _insort(self.bins[b], size << _KEY_SHIFT | ptr)
        self.nonempty |= 1 << b
        self.free_at[ptr] = chunk
        tag = chunk.tag
        if tag is not None:
            chunks = self.tagged.get(tag)
            if chunks is None:
                self.tagged[tag] = {ptr: chunk}
            else:
                chunks[ptr] = chunk

    def _remove(self, chunk: Chunk) -> None:
        size = chunk.size
        ptr = chunk.ptr
        b = (size >> MIN_ALLOCATION_BITS).bit_length() - 1
        if b >= NUM_BINS:
            b = NUM_BINS - 1
        keys = self.bins[b]
        del keys[_bisect_left(keys, size << _KEY_SHIFT | ptr)]
        if not keys:
            self.nonempty &= ~(1 << b)
        del self.free_at[ptr]
        if chunk.tag is not None:
            self._unindex(chunk)

    def _unindex(self, chunk: Chunk) -> None:
        tag = chunk.tag
        chunks = self.tagged[tag]
        del chunks[chunk.ptr]
        if not chunks:
            del self.tagged[tag]

    def _coalesce(self, chunk: Chunk) -> Chunk:
        """Merge a free chunk with free neighbours of the same tag and bin the result."""
        tag = chunk.tag
        nxt = chunk.next
        if nxt is not None and not nxt.in_use and nxt.tag is tag:
            self._remove(nxt)
            _join(chunk, nxt)
        prev = chunk.prev
        if prev is not None and not prev.in_use and prev.tag is tag:
            self._remove(prev)
            _join(prev, chunk)
            chunk = prev
        self._insert(chunk)
        return chunk


def _join(left: Chunk, right: Chunk) -> None:
    """``left`` takes in its neighbour ``right`` (the later mark of the two is kept)."""
    left.size += right.size
    if right.mark > left.mark:
        left.mark = right.mark
    after = left.next = right.next
    if after is not None:
        after.prev = left
