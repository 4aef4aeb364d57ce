"""Copies between host memory and an ORT plugin EP's memory through ``onnxruntime.copy_tensors``.

ORT's binding holds the GIL for a whole ``copy_tensors`` call and does not
check sizes, counts or dtypes (a mismatch corrupts the heap). The core has
already validated each batch; this module adds the ORT side: every OrtValue it
hands to ORT has exactly the size of its partner (uint8 on both sides), all
sources of one call share one memory info (as ORT requires), and a large copy
is split into calls with the GIL released between them, so the event loop keeps
running during a long copy. Calls are sized by time (`CallPacer`): each
direction's measured throughput gives the largest call that holds the GIL for
about ``chunk_ms``; a fixed ``chunk_bytes`` replaces that with a byte limit.
"""

from __future__ import annotations

import threading
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

__all__ = ["CallPacer", "OrtDataTransfer"]

_MIB = 1 << 20


class CallPacer:
    """Sizes ``copy_tensors`` calls by time, per direction (``h2d``, ``d2h``, ``d2d``).

    ORT's binding holds the GIL for a whole call, so the event loop stalls for
    as long as one call lasts; every call also has a fixed cost (on WebGPU each
    device-to-host call waits for the device queue). The pacer keeps an
    exponential average of each direction's seconds per byte, measured on the
    calls themselves, and answers the largest call that should last about
    ``target_s``, within ``[min_bytes, max_bytes]``. Before a direction has
    been measured it answers ``initial_bytes``. A single sample moves the
    average at most 4x, so the slow first copy of a direction (70-230 ms on
    WebGPU while the device warms up) and calls that return early (WebGPU's
    asynchronous uploads) cannot swing it far.

    With ``fixed_bytes`` (the ``chunk_bytes`` option) it always answers that
    (``0``: no limit) and measures nothing.
    """

    min_bytes = 1 * _MIB
    max_bytes = 256 * _MIB
    initial_bytes = 8 * _MIB
    """Before any measurement: about 7 ms at the ~1.2 GB/s of WebGPU on Mesa lavapipe."""
    min_segment_bytes = 1 * _MIB
    max_segment_bytes = 16 * _MIB
    """A partial write reads and rewrites one whole segment: segments stay this small."""
    alpha = 0.3

    def __init__(self, target_s: float, fixed_bytes: int | None = None) -> None:
        self.target_s = target_s
        self.fixed_bytes = fixed_bytes
        self._lock = threading.Lock()
        self._spb: dict[str, float] = {}

    def call_bytes(self, direction: str) -> int:
        """Bytes for the next call in ``direction`` (``0``: one call, no limit)."""
        if self.fixed_bytes is not None:
            return self.fixed_bytes
        spb = self._spb.get(direction)
        if spb is None:
            return self.initial_bytes
        return int(min(self.max_bytes, max(self.min_bytes, self.target_s / spb)))

    def record(self, direction: str, nbytes: int, seconds: float) -> None:
        """Feed one finished call of ``nbytes`` that held the GIL ``seconds``."""
        if self.fixed_bytes is not None or nbytes < 64 * 1024:
            return  # tiny calls measure the fixed cost, not the throughput
        with self._lock:
            old = self._spb.get(direction, self.target_s / self.initial_bytes)
            sample = min(4 * old, max(old / 4, seconds / nbytes))
            self._spb[direction] = old + self.alpha * (sample - old)

    def segment_bytes(self) -> int:
        """Segment size for a new buffer with opaque device pointers (``0``: one segment).

        The smaller of the two host directions' call sizes, rounded down to a
        power of two within ``[min_segment_bytes, max_segment_bytes]``: one
        segment is the least one call can move on such a buffer.
        """
        if self.fixed_bytes is not None:
            return self.fixed_bytes
        n = min(self.call_bytes("h2d"), self.call_bytes("d2h"))
        n = 1 << (n.bit_length() - 1)
        return min(self.max_segment_bytes, max(self.min_segment_bytes, n))


# One end of a piece: a host byte view, or (block, segment index, offset in segment, length).
_Host = np.ndarray
_Dev = tuple[Block, int, int, int]


class OrtDataTransfer(DataTransfer):
    """Host <-> device and device <-> device copies for the memory of one ORT factory."""

    def __init__(
        self,
        devices: set[MemoryDevice],
        address_map: AddressMap,
        pacer: CallPacer,
        owns_stream: Callable[[StreamImpl], bool],
    ) -> None:
        self._devices = frozenset(devices)
        self._map = address_map
        self.pacer = pacer
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
        batch = _Batch(self.pacer)
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
        direction = _DIRECTIONS[bool(s_seg), bool(d_seg)]
        pos = 0
        while pos < n:
            # A piece never crosses a segment boundary of either side; between host
            # memories (no segments) it is as large as the pacer allows.
            end = n
            for base, seg in ((s_base, s_seg), (d_base, d_seg)):
                if seg:
                    end = min(end, ((base + pos) // seg + 1) * seg - base)
            if not s_seg and not d_seg:
                step = self.pacer.call_bytes(direction)
                if step:
                    end = min(end, pos + step)
            sp = s[pos:end] if not s_seg else _dev_piece(s, s_base + pos, end - pos)
            dp = d[pos:end] if not d_seg else _dev_piece(d, d_base + pos, end - pos)
            batch.add(sp, dp, direction)
            pos = end


# (source is device, destination is device) -> direction name for the pacer
_DIRECTIONS = {
    (False, True): "h2d",
    (True, False): "d2h",
    (True, True): "d2d",
    (False, False): "h2h",
}


def _dev_piece(block: Block, pos: int, length: int) -> _Dev:
    index, offset = divmod(pos, block.segment_bytes)
    return block, index, offset, length


def _whole(piece: _Dev) -> bool:
    block, index, offset, length = piece
    return offset == 0 and length == block.size(index)


def _ov(piece: Any) -> Any:
    if isinstance(piece, np.ndarray):
        return ort().OrtValue.ortvalue_from_numpy(piece)
    return piece[0].segment(piece[1])[0]


def _key(piece: Any) -> int:
    return 0 if isinstance(piece, np.ndarray) else id(piece[0].ort_memory_info)


_HOST_ONLY = threading.RLock()  # pairs of host-accessible memory touch no device


def _device_lock(sp: Any, dp: Any) -> threading.RLock:
    """The lock of the library whose device a piece pair touches."""
    for piece in (sp, dp):
        if not isinstance(piece, np.ndarray):
            lock: threading.RLock = piece[0].device_lock
            return lock
    return _HOST_ONLY


def _ort_copy(src: list[Any], dst: list[Any], lock: threading.RLock) -> None:
    try:
        with lock:
            ort().copy_tensors(src, dst, None)
    except Exception as exc:
        raise translate(exc, f"onnxruntime.copy_tensors of {len(src)} tensor(s)") from exc


def _yield_gil() -> None:
    time.sleep(0)  # let other threads (the event loop) take the GIL between ORT calls


class _Batch:
    """Direct pieces grouped into ORT calls of one (source, destination) memory and at most
    the pacer's call size (several segments per call where one is smaller than that);
    pieces that cover part of a device segment go through a host bounce."""

    def __init__(self, pacer: CallPacer) -> None:
        self._pacer = pacer
        self._src: list[Any] = []
        self._dst: list[Any] = []
        self._key: tuple[int, int] | None = None
        self._lock: threading.RLock | None = None
        self._direction = ""
        self._limit = 0
        self._bytes = 0

    def add(self, sp: Any, dp: Any, direction: str) -> None:
        s_host, d_host = isinstance(sp, np.ndarray), isinstance(dp, np.ndarray)
        if (s_host or _whole(sp)) and (d_host or _whole(dp)):
            key = (_key(sp), _key(dp))
            nbytes = sp.nbytes if s_host else sp[3]
            if self._key != key or (self._limit and self._bytes + nbytes > self._limit):
                self.flush()
            if not self._src:
                self._key, self._direction = key, direction
                self._lock = _device_lock(sp, dp)
                self._limit = self._pacer.call_bytes(direction)
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
        src, dst, nbytes, lock = self._src, self._dst, self._bytes, self._lock
        self._src, self._dst, self._key, self._bytes = [], [], None, 0
        assert lock is not None
        t0 = time.perf_counter()
        _ort_copy(src, dst, lock)
        self._pacer.record(self._direction, nbytes, time.perf_counter() - t0)
        del src, dst
        _yield_gil()


def _read(piece: _Dev) -> np.ndarray:
    """The bytes of a device piece, through a host copy of its whole segment."""
    block, index, offset, length = piece
    value, size = block.segment(index)
    tmp = np.empty(size, np.uint8)
    _ort_copy([value], [ort().OrtValue.ortvalue_from_numpy(tmp)], block.device_lock)
    _yield_gil()
    return tmp[offset : offset + length]


def _write(piece: _Dev, data: np.ndarray) -> None:
    """Write ``data`` into part of a device segment: read, patch, write the whole segment.

    A partial upload is not safe: WebGPU rounds uploads up to 4 bytes and would
    clobber the bytes after the piece; and ORT's binding cannot address a byte
    offset inside an opaque buffer, so no part of a segment can be written alone.
    """
    block, index, offset, length = piece
    value, size = block.segment(index)
    with block.lock:
        tmp = np.empty(size, np.uint8)
        _ort_copy([value], [ort().OrtValue.ortvalue_from_numpy(tmp)], block.device_lock)
        tmp[offset : offset + length] = data
        _yield_gil()
        _ort_copy([ort().OrtValue.ortvalue_from_numpy(tmp)], [value], block.device_lock)
    _yield_gil()
