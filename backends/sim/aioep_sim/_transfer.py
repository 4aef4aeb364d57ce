"""The sim data transfer: host <-> device, device <-> device (same or peer), device <-> pinned."""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any

from aioep import DeviceType, MemoryDevice, Tensor
from aioep.abc import CopyPair, DataTransfer, StreamImpl

from ._device import SIM_VENDOR_ID, SimDevice
from ._options import SimOptions
from ._stream import SimStream

__all__ = ["SimDataTransfer"]

INLINE_BYTES = 64 * 1024
"""Free copies (no latency, no bandwidth limit) up to this size run on the caller when the
stream is idle, as a driver stages a small pageable copy and returns."""

_memmove = ctypes.memmove  # releases the GIL while it copies


class SimDataTransfer(DataTransfer):
    """Copies between sim device memory, sim pinned memory and any host-accessible memory.

    Each copy counts toward its device's fault injection, waits ``latency_us``,
    then (with ``bandwidth_gbps`` set) holds its copy engine for
    ``nbytes / bandwidth``: host-to-device copies hold the target's H2D engine,
    device-to-host copies the source's D2H engine, same-device copies its D2D
    engine, and peer copies the source's D2H and the target's H2D engines.
    """

    def __init__(self, devices: Mapping[int, SimDevice], options: SimOptions) -> None:
        self._devices = dict(devices)
        self._latency = options.latency_us * 1e-6
        self._bytes_per_s = options.bandwidth_gbps * 1e9
        free = self._latency == 0 and self._bytes_per_s == 0
        self.max_inline_bytes = INLINE_BYTES if free else 0

    def _sim_device(self, memory: MemoryDevice) -> SimDevice | None:
        if memory.vendor_id != SIM_VENDOR_ID or memory.device_type is not DeviceType.GPU:
            return None
        return self._devices.get(memory.device_id)

    def can_copy(self, src: MemoryDevice, dst: MemoryDevice) -> bool:
        s, d = self._sim_device(src), self._sim_device(dst)
        if s is None and d is None:
            return False
        # The other side may be any memory the host can address (RAM, another backend's pinned).
        return (s is not None or src.is_host_accessible) and (
            d is not None or dst.is_host_accessible
        )

    def can_use_stream(self, stream: StreamImpl) -> bool:
        return isinstance(stream, SimStream)

    def copy_tensors(self, pairs: Sequence[CopyPair], stream: StreamImpl | None) -> None:
        batch = list(pairs)
        if stream is None:
            self._run(batch)
            return
        assert isinstance(stream, SimStream)
        inline = bool(self.max_inline_bytes) and (
            sum(s.nbytes for s, _ in batch) <= self.max_inline_bytes
        )
        # The closure holds the tensors, so their buffers outlive the copy.
        stream.enqueue(functools.partial(self._run, batch), inline=inline)

    def _run(self, pairs: list[CopyPair]) -> None:
        for src, dst in pairs:
            self._copy(src, dst)

    def _side(self, t: Tensor, dev: SimDevice | None, n: int) -> tuple[int, Any]:
        """(host address to copy at, object to keep alive while copying)."""
        if dev is None:
            return t.data_ptr, t
        block, addr = dev.memory.resolve(t.data_ptr, n)
        return addr, block

    def _copy(self, src: Tensor, dst: Tensor) -> None:
        n = src.nbytes
        if n == 0:
            return
        sinfo, dinfo = src.device, dst.device
        sdev = None if sinfo.is_host_accessible else self._sim_device(sinfo)
        ddev = None if dinfo.is_host_accessible else self._sim_device(dinfo)
        if ddev is not None and sdev is not ddev:
            ddev.check_alive("copy")
        owner = sdev or ddev or self._sim_device(sinfo) or self._sim_device(dinfo)
        assert owner is not None  # can_copy checked it
        owner.begin_copy()  # raises if lost (or injected to fail)
        # Resolve device addresses when the copy runs: freed memory is an illegal address.
        src_addr, src_keep = self._side(src, sdev, n)
        dst_addr, dst_keep = self._side(dst, ddev, n)
        if self._latency:
            # Runs on a stream's worker thread or the core's copy executor, never inline on
            # the event loop: max_inline_bytes is 0 whenever latency or bandwidth is set.
            time.sleep(self._latency)  # loop-safe
        if not self._bytes_per_s:
            _memmove(dst_addr, src_addr, n)
            return
        if sdev is not None and ddev is not None:
            if sdev is ddev:
                engines = [(sdev, "d2d")]
            else:
                engines = sorted([(sdev, "d2h"), (ddev, "h2d")], key=lambda e: e[0].device_id)
        elif sdev is not None:
            engines = [(sdev, "d2h")]
        elif ddev is not None:
            engines = [(ddev, "h2d")]
        else:
            engines = []  # host <-> pinned: a host memcpy, no engine
        for dev, name in engines:
            dev.engines[name].acquire()
        try:
            start = time.perf_counter()
            _memmove(dst_addr, src_addr, n)
            remaining = start + n / self._bytes_per_s - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)  # loop-safe: bandwidth set means never inline (see above)
            for dev, name in engines:
                dev.record_engine_use(name, n, start)
        finally:
            for dev, name in reversed(engines):
                dev.engines[name].release()
        del src_keep, dst_keep
