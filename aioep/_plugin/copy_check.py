"""The copy fast path's check: which copy batches it takes as they are (tensors and numpy
arrays that pass every check of the general path at once)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .exports import _holds, free_deferred
from .tensor import Tensor, wrap_array

__all__ = ["copy_pair", "copy_pairs"]


def copy_pairs(
    src: Sequence[object], dst: Sequence[object]
) -> tuple[list[tuple[Tensor, Tensor]], list[Tensor], list[Tensor], list[Tensor]] | None:
    """The tensors of a copy batch that passes every check of the general path at once:
    ``(pairs, sources, destinations, user_tensors)``; None for any batch it does not take
    (the general path then accepts or refuses it, with the full message).

    Each argument is a `Tensor` (not a subclass) whose buffer is not freed, and not
    read-only for a destination, or a C-contiguous numpy array of plain values (writable
    for a destination), wrapped here; each pair agrees in dtype, size and shape; no
    destination overlaps another tensor of the batch in memory. ``user_tensors`` are the
    tensors the caller passed (arrays wrapped here are nobody else's: no one can free
    them). The owners of device memory are not checked here (``ownership.owned_by``).
    """
    n = len(src)
    if n != len(dst):
        return None
    if n == 1:
        return copy_pair(src[0], dst[0])
    pairs: list[tuple[Tensor, Tensor]] = []
    sources: list[Tensor] = []
    dests: list[Tensor] = []
    users: list[Tensor] = []
    for k in range(n):
        s: Any = src[k]
        kind = type(s)
        if kind is Tensor:
            buffer = s.buffer
            if buffer._released or (_holds and free_deferred(buffer)):
                return None
            users.append(s)
        elif kind is np.ndarray:
            flags = s.flags
            if not flags.c_contiguous or s.dtype.hasobject:
                return None
            s = wrap_array(s, not flags.writeable)
        else:
            return None
        d: Any = dst[k]
        kind = type(d)
        if kind is Tensor:
            buffer = d.buffer
            if buffer._released or buffer.readonly or (_holds and free_deferred(buffer)):
                return None
            users.append(d)
        elif kind is np.ndarray:
            flags = d.flags
            if not (flags.c_contiguous and flags.writeable) or d.dtype.hasobject:
                return None
            d = wrap_array(d, False)
        else:
            return None
        sd, dd = s.dtype, d.dtype
        if (sd is not dd and sd != dd) or s.nbytes != d.nbytes or s.shape != d.shape:
            return None
        pairs.append((s, d))
        sources.append(s)
        dests.append(d)
    for i, d in enumerate(dests):  # a destination may overlap nothing else
        for t in sources:
            if _overlap(d, t):
                return None
        for t in dests[i + 1 :]:
            if _overlap(d, t):
                return None
    return pairs, sources, dests, users


def copy_pair(
    s: Any, d: Any
) -> tuple[list[tuple[Tensor, Tensor]], list[Tensor], list[Tensor], list[Tensor]] | None:
    """`copy_pairs` for a batch of one pair (source ``s``, destination ``d``), the common
    case, in a straight line."""
    kind = type(s)
    if kind is Tensor:
        buffer = s.buffer
        if buffer._released or (_holds and free_deferred(buffer)):
            return None
        users = [s]
    elif kind is np.ndarray:
        flags = s.flags
        if not flags.c_contiguous or s.dtype.hasobject:
            return None
        s = wrap_array(s, not flags.writeable)
        users = []
    else:
        return None
    kind = type(d)
    if kind is Tensor:
        buffer = d.buffer
        if buffer._released or buffer.readonly or (_holds and free_deferred(buffer)):
            return None
        users.append(d)
    elif kind is np.ndarray:
        flags = d.flags
        if not (flags.c_contiguous and flags.writeable) or d.dtype.hasobject:
            return None
        d = wrap_array(d, False)
    else:
        return None
    sd, dd = s.dtype, d.dtype
    if (sd is not dd and sd != dd) or s.nbytes != d.nbytes or s.shape != d.shape:
        return None
    if _overlap(s, d):
        return None
    return [(s, d)], [s], [d], users


def _overlap(a: Tensor, b: Tensor) -> bool:
    """True when ``a`` and ``b`` share bytes of one address space (host memory, pinned
    included, is one; each device's memory another)."""
    an, bn = a.nbytes, b.nbytes
    if not an or not bn:
        return False
    abuf, bbuf = a.buffer, b.buffer
    adev, bdev = abuf.memory_info.device, bbuf.memory_info.device
    if adev is not bdev:
        host = adev.is_host_accessible
        if host != bdev.is_host_accessible or (not host and adev != bdev):
            return False
    astart = abuf.ptr + a.byte_offset
    bstart = bbuf.ptr + b.byte_offset
    return astart < bstart + bn and bstart < astart + an
