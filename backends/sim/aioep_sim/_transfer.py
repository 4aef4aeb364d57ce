"""The sim data transfer: host <-> device, device <-> device (same or peer), device <-> pinned."""

from __future__ import annotations

import ctypes
import functools
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from aioep import DeviceType, MemoryDevice, Tensor
from aioep.abc import CopyPair, DataTransfer, HostNotification, StreamImpl

from ._device import SIM_VENDOR_ID, SimDevice
from ._options import SimOptions
from ._stream import SimStream

__all__ = ["SimDataTransfer"]

OWN_STREAMS = 4
"""Streams per device for copies without a stream (``enqueue_unstreamed``): a copy goes to
an idle one, so one caller's copy never waits behind another's while one of them is free."""

_memmove = ctypes.memmove  # releases the GIL while it copies


def _gil_holding_memmove() -> Any:
    try:
        memmove = ctypes.PyDLL(None).memmove  # PyDLL: the call keeps the GIL
    except (AttributeError, OSError, TypeError):  # pragma: no cover - no dlopen(NULL) here
        return _memmove
    memmove.restype = ctypes.c_void_p
    memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memmove


_small_memmove = _gil_holding_memmove()
SMALL_COPY_BYTES = 64 << 10
"""Copies up to this size keep the GIL: giving it up costs more than the copy, and lets
another thread keep it meanwhile (an inline copy on the event loop would wait for it)."""

_Engines = tuple[tuple[SimDevice, str], ...]
_Route = tuple[
    SimDevice | None, SimDevice | None, SimDevice, SimDevice | None, _Engines, tuple[Any, ...]
]
_perf_counter = time.perf_counter


class SimDataTransfer(DataTransfer):
    """Copies between sim device memory, sim pinned memory and any host-accessible memory.

    Each copy counts toward its device's fault injection, waits ``latency_us``,
    then (with ``bandwidth_gbps`` set) holds its copy engine for
    ``nbytes / bandwidth``: host-to-device copies hold the target's H2D engine,
    device-to-host copies the source's D2H engine, same-device copies its D2D
    engine, and peer copies the source's D2H and the target's H2D engines.

    Free copies (no latency, no bandwidth limit) are plain memmoves
    (`can_copy_inline`): the core runs small ones on the caller while its inline
    budget allows. Copies without a stream otherwise go to one of the device's own
    streams (`enqueue_unstreamed`), whose worker wakes the awaiting task.
    """

    def __init__(self, devices: Mapping[int, SimDevice], options: SimOptions) -> None:
        self._devices = dict(devices)
        self._latency = options.latency_us * 1e-6
        self._bytes_per_s = options.bandwidth_gbps * 1e9
        self._free = self._latency == 0 and self._bytes_per_s == 0
        # Per memory device: the sim device whose private memory it is (None for memory the
        # host addresses), and the sim device it belongs to at all (pinned memory too).
        self._private: dict[MemoryDevice, SimDevice | None] = {}
        self._owner: dict[MemoryDevice, SimDevice | None] = {}
        self._engines: dict[tuple[SimDevice | None, SimDevice | None], _Engines] = {}
        # (source memory device, destination memory device) -> what _copy needs of the pair
        self._routes: dict[tuple[MemoryDevice, MemoryDevice], _Route] = {}
        self._lock = threading.Lock()
        self._own: dict[int, list[SimStream]] = {}  # device id -> its streams for un-streamed
        self._turn = 0
        self._closed = False

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

    def can_copy_inline(self, pairs: Sequence[CopyPair]) -> bool:
        """True for free copies (no latency, no bandwidth limit): memmoves that never wait."""
        return self._free

    def copy_tensors(self, pairs: Sequence[CopyPair], stream: StreamImpl | None) -> None:
        batch = list(pairs)
        if stream is None:
            self._run(batch)
            return
        assert isinstance(stream, SimStream)
        # The closure holds the tensors, so their buffers outlive the copy.
        stream.enqueue(functools.partial(self._run, batch))

    def enqueue_unstreamed(self, pairs: Sequence[CopyPair]) -> HostNotification | None:
        """Enqueue the batch on an idle stream of the device (one of ``OWN_STREAMS``) and
        return its mark: the stream's worker runs the copies and wakes the awaiting task."""
        batch = list(pairs)
        stream = self._own_stream(self._batch_device(batch))
        if stream is None:
            return None  # closed: the core runs it
        stream.enqueue(functools.partial(self._run, batch))
        mark = stream.create_notification()
        mark.activate()
        return mark

    def _batch_device(self, pairs: list[CopyPair]) -> SimDevice:
        for s, d in pairs:
            for t in (d, s):
                dev = self._owner_of(t.device)
                if dev is not None:
                    return dev
        raise AssertionError("can_copy routed a batch with no sim memory to the sim")

    def _own_stream(self, device: SimDevice) -> SimStream | None:
        with self._lock:
            if self._closed:
                return None
            streams = self._own.setdefault(device.device_id, [])
            for stream in streams:
                if stream.query():
                    return stream
            if len(streams) < OWN_STREAMS:
                stream = SimStream(device)
                streams.append(stream)
                return stream
            self._turn += 1  # all busy: take turns
            return streams[self._turn % len(streams)]

    def close(self) -> None:
        """Close the device's own streams (the core drained the copies first)."""
        with self._lock:
            self._closed = True
            streams = [s for own in self._own.values() for s in own]
            self._own.clear()
        for stream in streams:
            stream.close()

    def _run(self, pairs: list[CopyPair]) -> None:
        for src, dst in pairs:
            self._copy(src, dst)

    def _private_of(self, memory: MemoryDevice) -> SimDevice | None:
        try:
            return self._private[memory]
        except KeyError:
            dev = None if memory.is_host_accessible else self._sim_device(memory)
            self._private[memory] = dev
            return dev

    def _owner_of(self, memory: MemoryDevice) -> SimDevice | None:
        try:
            return self._owner[memory]
        except KeyError:
            dev = self._owner[memory] = self._sim_device(memory)
            return dev

    def _engines_for(self, sdev: SimDevice | None, ddev: SimDevice | None) -> _Engines:
        key = (sdev, ddev)
        engines = self._engines.get(key)
        if engines is None:
            if sdev is not None and ddev is not None:
                if sdev is ddev:
                    engines = ((sdev, "d2d"),)
                else:
                    pair = sorted([(sdev, "d2h"), (ddev, "h2d")], key=lambda e: e[0].device_id)
                    engines = tuple(pair)
            elif sdev is not None:
                engines = ((sdev, "d2h"),)
            elif ddev is not None:
                engines = ((ddev, "h2d"),)
            else:
                engines = ()  # host <-> pinned: a host memcpy, no engine
            self._engines[key] = engines
        return engines

    def _route(self, sinfo: MemoryDevice, dinfo: MemoryDevice) -> _Route:
        """What a copy from ``sinfo`` to ``dinfo`` memory needs: (source device, destination
        device (each None where the host addresses the memory), the device that counts the
        copy, the device whose loss fails it first, the engines it holds)."""
        route = self._routes.get((sinfo, dinfo))
        if route is None:
            sdev, ddev = self._private_of(sinfo), self._private_of(dinfo)
            owner = sdev or ddev or self._owner_of(sinfo) or self._owner_of(dinfo)
            assert owner is not None  # can_copy checked it
            check = ddev if ddev is not None and sdev is not ddev else None
            engines = self._engines_for(sdev, ddev)
            locks = tuple(dev.engines[name] for dev, name in engines)
            route = (sdev, ddev, owner, check, engines, locks)
            self._routes[(sinfo, dinfo)] = route
        return route

    def _copy(self, src: Tensor, dst: Tensor) -> None:
        n = src.nbytes
        if n == 0:
            return
        sbuf, dbuf = src.buffer, dst.buffer
        sdev, ddev, owner, check, engines, locks = self._route(
            sbuf.memory_info.device, dbuf.memory_info.device
        )
        if check is not None:
            check.check_alive("copy")
        owner.begin_copy()  # raises if lost (or injected to fail)
        # Resolve device addresses when the copy runs: freed memory is an illegal address.
        # The blocks resolved are held while copying (a free meanwhile cannot unmap them).
        if sdev is None:
            src_addr, src_keep = sbuf.ptr + src.byte_offset, None
        else:
            src_keep, src_addr = sdev.memory.resolve(sbuf.ptr + src.byte_offset, n)
        if ddev is None:
            dst_addr, dst_keep = dbuf.ptr + dst.byte_offset, None
        else:
            dst_keep, dst_addr = ddev.memory.resolve(dbuf.ptr + dst.byte_offset, n)
        memmove = _small_memmove if n <= SMALL_COPY_BYTES else _memmove
        if self._free:
            memmove(dst_addr, src_addr, n)
            return
        if self._latency:
            # Runs on a stream's worker thread or a copy thread, never inline on the event
            # loop: can_copy_inline is False whenever latency or bandwidth is set.
            time.sleep(self._latency)  # loop-safe
        if not self._bytes_per_s:
            memmove(dst_addr, src_addr, n)
            return
        for lock in locks:
            lock.acquire()
        try:
            start = _perf_counter()
            memmove(dst_addr, src_addr, n)
            remaining = start + n / self._bytes_per_s - _perf_counter()
            if remaining > 0:
                time.sleep(remaining)  # loop-safe: bandwidth set means never inline (see above)
            for dev, name in engines:
                dev.record_engine_use(name, n, start)
        finally:
            for lock in reversed(locks):
                lock.release()
        del src_keep, dst_keep
