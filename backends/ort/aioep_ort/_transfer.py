"""Copies between host memory and an ORT plugin EP's memory through ``onnxruntime.copy_tensors``.

ORT's binding holds the GIL for a whole ``copy_tensors`` call and does not
check sizes, counts or dtypes (a mismatch corrupts the heap). The core has
already validated each batch; this module adds the ORT side: every OrtValue it
hands to ORT has exactly the size of its partner (uint8 on both sides), all
sources of one call share one memory info (as ORT requires), and a large copy
is split into calls of at most ``chunk_bytes`` with the GIL released between
them, so the event loop keeps running during a long copy.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from aioep import MemoryDevice
from aioep.abc import CopyPair, DataTransfer, StreamImpl

from ._memory import AddressMap, Block
from ._ort import ort, translate

if TYPE_CHECKING:
    from aioep import Tensor

__all__ = ["OrtDataTransfer"]

# One end of a piece: a host byte view, or (block, segment index, offset in segment, length).
_Host = np.ndarray
_Dev = tuple[Block, int, int, int]


class OrtDataTransfer(DataTransfer):
    """Host <-> device and device <-> device copies for the memory of one ORT factory."""

    def __init__(
        self,
        devices: set[MemoryDevice],
        address_map: AddressMap,
        chunk_bytes: int,
        owns_stream: Callable[[StreamImpl], bool],
    ) -> None:
        self._devices = frozenset(devices)
        self._map = address_map
        self._chunk = chunk_bytes
        self._owns_stream = owns_stream

    def can_copy(self, src: MemoryDevice, dst: MemoryDevice) -> bool:
        ours_src, ours_dst = src in self._devices, dst in self._devices
        if ours_src and ours_dst:
            return True
        if ours_src:
            return dst.is_host_accessible
        if ours_dst:
            return src.is_host_accessible
        return False

    def can_use_stream(self, stream: StreamImpl) -> bool:
        return self._owns_stream(stream)

    def copy_tensors(self, pairs: Sequence[CopyPair], stream: StreamImpl | None) -> None:
        if stream is not None:
            # OrtStream is a ThreadStream: copies run in order on its worker thread.
            stream.enqueue(lambda: self._copy(pairs))  # type: ignore[attr-defined]
            return
        self._copy(pairs)

    # -- the copy ----------------------------------------------------------------------------
    def _copy(self, pairs: Sequence[CopyPair]) -> None:
        batch = _Batch(self._chunk)
        for src, dst in pairs:
            if src.nbytes:
                self._copy_pair(src, dst, batch)
        batch.flush()

    def _side(self, t: Tensor) -> tuple[Any, int, int]:
        """(host uint8 view | block, offset in block, segment size) for one tensor."""
        # Host-accessible memory (this EP's included) has real addresses: read it via numpy.
        if t.device in self._devices and not t.device.is_host_accessible:
            block = self._map.find(t.data_ptr, t.nbytes)
            return block, t.data_ptr - block.start, block.segment_bytes
        return t.numpy().reshape(-1).view(np.uint8), 0, 0

    def _copy_pair(self, src: Tensor, dst: Tensor, batch: _Batch) -> None:
        n = src.nbytes
        s, s_base, s_seg = self._side(src)
        d, d_base, d_seg = self._side(dst)
        cuts = {0, n}
        for base, seg in ((s_base, s_seg), (d_base, d_seg)):
            if seg:
                first = (base // seg + 1) * seg - base
                cuts.update(range(first, n, seg))
        if not s_seg and not d_seg:
            cuts.update(range(self._chunk, n, self._chunk) if self._chunk else ())
        edges = sorted(cuts)
        for a, b in itertools.pairwise(edges):
            sp = s[a:b] if not s_seg else _dev_piece(s, s_base + a, b - a)
            dp = d[a:b] if not d_seg else _dev_piece(d, d_base + a, b - a)
            batch.add(sp, dp)


def _dev_piece(block: Block, pos: int, length: int) -> _Dev:
    index, offset = divmod(pos, block.segment_bytes)
    return block, index, offset, length


def _whole(piece: _Dev) -> bool:
    block, index, offset, length = piece
    return offset == 0 and length == block.segment(index)[1]


def _ov(piece: Any) -> Any:
    if isinstance(piece, np.ndarray):
        return ort().OrtValue.ortvalue_from_numpy(piece)
    return piece[0].segment(piece[1])[0]


def _key(piece: Any) -> int:
    return 0 if isinstance(piece, np.ndarray) else id(piece[0].ort_memory_info)


def _ort_copy(src: list[Any], dst: list[Any]) -> None:
    try:
        ort().copy_tensors(src, dst, None)
    except Exception as exc:
        raise translate(exc, f"onnxruntime.copy_tensors of {len(src)} tensor(s)") from exc


class _Batch:
    """Direct pieces grouped into ORT calls of one (source, destination) memory and at most
    ``chunk`` bytes; pieces that cover part of a device segment go through a host bounce."""

    def __init__(self, chunk: int) -> None:
        self._chunk = chunk
        self._src: list[Any] = []
        self._dst: list[Any] = []
        self._key: tuple[int, int] | None = None
        self._bytes = 0

    def add(self, sp: Any, dp: Any) -> None:
        s_host, d_host = isinstance(sp, np.ndarray), isinstance(dp, np.ndarray)
        if (s_host or _whole(sp)) and (d_host or _whole(dp)):
            key = (_key(sp), _key(dp))
            nbytes = sp.nbytes if s_host else sp[3]
            if self._key != key or (self._chunk and self._bytes + nbytes > self._chunk):
                self.flush()
            self._key = key
            self._src.append(_ov(sp))
            self._dst.append(_ov(dp))
            self._bytes += nbytes
            return
        self.flush()
        data = sp if s_host else _read(sp)
        if d_host:
            dp[...] = data
        else:
            _write(dp, np.ascontiguousarray(data))

    def flush(self) -> None:
        if not self._src:
            return
        src, dst = self._src, self._dst
        self._src, self._dst, self._key, self._bytes = [], [], None, 0
        _ort_copy(src, dst)
        del src, dst
        time.sleep(0)  # let other threads (the event loop) take the GIL between ORT calls


def _read(piece: _Dev) -> np.ndarray:
    """The bytes of a device piece, through a host copy of its whole segment."""
    block, index, offset, length = piece
    value, size = block.segment(index)
    tmp = np.empty(size, np.uint8)
    _ort_copy([value], [ort().OrtValue.ortvalue_from_numpy(tmp)])
    return tmp[offset : offset + length]


def _write(piece: _Dev, data: np.ndarray) -> None:
    """Write ``data`` into part of a device segment: read, patch, write the whole segment.

    A partial upload is not safe: WebGPU rounds uploads up to 4 bytes and would
    clobber the bytes after the piece.
    """
    block, index, offset, length = piece
    value, size = block.segment(index)
    with block.lock:
        tmp = np.empty(size, np.uint8)
        _ort_copy([value], [ort().OrtValue.ortvalue_from_numpy(tmp)])
        tmp[offset : offset + length] = data
        _ort_copy([ort().OrtValue.ortvalue_from_numpy(tmp)], [value])
