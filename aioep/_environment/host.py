"""The host CPU device, built into the core: an aligned allocator, a parallel memcpy data
transfer and an in-order worker-thread stream."""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base.errors import DeviceError, InvalidArgument
from .._base.options import parse_int_option, reject_unknown_options
from .._base.types import (
    HOST_EP_NAME,
    DeviceType,
    HardwareDevice,
    MemoryDevice,
    MemoryInfo,
    MemoryType,
)
from .._copies.workers import COPY_THREAD_NICE, lower_thread_priority
from .._plugin.allocator import Allocator
from .._plugin.buffer import HOST_MEMORY_INFO, Buffer
from .._plugin.device import EpDevice
from .._plugin.factory import EpFactory, FactoryOptions
from .._plugin.importer import HostMemoryImporter, MemoryImporter
from .._plugin.stream_impl import StreamImpl
from .._plugin.thread_stream import ThreadStream
from .._plugin.transfer import CopyPair, DataTransfer

if TYPE_CHECKING:
    from .._plugin.stream import SyncStream

__all__ = ["HostAllocator", "HostDataTransfer", "HostFactory", "host_hardware_device"]

_CPU_VENDORS = {"GenuineIntel": (0x8086, "Intel"), "AuthenticAMD": (0x1022, "AMD")}


def host_hardware_device() -> HardwareDevice:
    """The machine's CPU as a hardware device (vendor read from /proc/cpuinfo where present)."""
    vendor_id, vendor = 0, platform.machine() or "cpu"
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    vendor_id, vendor = _CPU_VENDORS.get(line.split(":", 1)[1].strip(), (0, vendor))
                    break
    except OSError:
        pass
    return HardwareDevice(
        DeviceType.CPU, vendor_id, 0, vendor, {"cpu_count": str(os.cpu_count() or 1)}
    )


class HostAllocator(Allocator):
    """Aligned host memory backed by numpy (not zero-filled)."""

    def __init__(self, memory_info: MemoryInfo = HOST_MEMORY_INFO) -> None:
        super().__init__(memory_info)
        self._blocks: dict[int, np.ndarray[Any, Any]] = {}
        self._blocks_lock = threading.Lock()

    def _allocate(self, nbytes: int, stream: SyncStream | None) -> int:
        align = self.memory_info.alignment
        try:
            raw = np.empty(nbytes + align - 1, dtype=np.uint8)
        except (MemoryError, ValueError) as exc:  # ValueError: beyond numpy's size limit
            raise DeviceError(
                f"host allocator {self.memory_info.name!r}: out of memory allocating {nbytes} bytes"
            ) from exc
        base = int(raw.__array_interface__["data"][0])
        ptr = (base + align - 1) & ~(align - 1)
        with self._blocks_lock:
            self._blocks[ptr] = raw
        return ptr

    def _free(self, ptr: int, nbytes: int, stream: SyncStream | None) -> None:
        with self._blocks_lock:
            self._blocks.pop(ptr, None)

    def alloc(self, nbytes: int, *, stream: SyncStream | None = None) -> Buffer:
        buffer = super().alloc(nbytes, stream=stream)
        # The buffer (and any numpy view of it) owns the block too: an explicit free()
        # returns it to the allocator's books, but memory a view can still read stays mapped.
        with self._blocks_lock:
            buffer._owner = self._blocks.get(buffer.ptr)
        return buffer


_memmove = ctypes.memmove  # a C call that releases the GIL while it copies


def _gil_holding_memmove() -> Any:
    try:
        # PyDLL: the call keeps the GIL (libc's memmove, found in the process's own symbols).
        memmove = ctypes.PyDLL(None).memmove
    except (AttributeError, OSError, TypeError):  # pragma: no cover - no dlopen(NULL) here
        return _memmove
    memmove.restype = ctypes.c_void_p
    memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memmove


small_memmove = _gil_holding_memmove()
"""``memmove(dst, src, n)`` that keeps the GIL: for copies up to ``SMALL_COPY_BYTES``,
where giving the GIL up costs more than the copy and lets another thread take it for as
long as it wants (on the loop thread, an inline copy would then wait for it)."""

SMALL_COPY_BYTES = 64 << 10
"""Copies up to this size keep the GIL (``small_memmove``); larger ones release it."""

MAX_COPY_THREADS = 1024
"""The most ``copy_threads`` the host backend accepts."""


class HostDataTransfer(DataTransfer):
    """Copies between any host-accessible memories (host RAM, pinned memory of any backend).

    Small batches are copied inline on the caller (the core decides, within its inline
    budget: see `can_copy_inline`). Large ones are split into one contiguous
    share per worker thread (the calling thread copies the first share), each
    copied with as few ``memmove`` calls as possible: memmove releases the GIL,
    and one long call per thread keeps the C library on its fastest path for
    large copies (non-temporal stores above its threshold, which many small
    chunks would fall below).
    """

    parallel_threshold = 4 * 1024 * 1024
    """A batch this large or larger is split across threads (each share at least this big)."""

    def __init__(self, workers: int | None = None, nice: int = COPY_THREAD_NICE) -> None:
        self._workers = max(1, workers or os.cpu_count() or 1)
        self._nice = nice
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def can_copy(self, src: MemoryDevice, dst: MemoryDevice) -> bool:
        return src.is_host_accessible and dst.is_host_accessible

    def can_use_stream(self, stream: StreamImpl) -> bool:
        return isinstance(stream, ThreadStream)

    def can_copy_inline(self, pairs: Sequence[CopyPair]) -> bool:
        """True unless the batch is big enough to be split across threads (which waits
        for them): every other batch is a memmove on the calling thread."""
        return sum(s.nbytes for s, _ in pairs) < 2 * self.parallel_threshold

    def copy_tensors(self, pairs: Sequence[CopyPair], stream: StreamImpl | None) -> None:
        jobs = [(d.data_ptr, s.data_ptr, s.nbytes) for s, d in pairs if s.nbytes]
        if stream is None:
            self._copy(jobs)
        else:
            assert isinstance(stream, ThreadStream)
            stream.enqueue(lambda: self._copy(jobs))

    def _copy(self, jobs: list[tuple[int, int, int]]) -> None:
        total = sum(n for _, _, n in jobs)
        parts = min(self._workers, total // self.parallel_threshold)
        if parts <= 1:
            for dst, src, n in jobs:
                (small_memmove if n <= SMALL_COPY_BYTES else _memmove)(dst, src, n)
            return
        shares = _split(jobs, parts)
        pool = self._get_pool()
        futures: list[Future[Any]] = [pool.submit(_copy_share, share) for share in shares[1:]]
        try:
            _copy_share(shares[0])
        finally:
            for f in futures:
                f.result()

    def _get_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self._workers - 1,
                    thread_name_prefix="aioep-host-copy",
                    initializer=lower_thread_priority,
                    initargs=(self._nice,),
                )
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


_Job = tuple[int, int, int]


def _split(jobs: list[_Job], parts: int) -> list[list[_Job]]:
    """Cut the byte stream of ``jobs`` into ``parts`` contiguous shares of equal size
    (boundaries on 4 KiB so no two threads write the same page)."""
    total = sum(n for _, _, n in jobs)
    per = -(-total // parts)
    per = -(-per // 4096) * 4096
    shares: list[list[_Job]] = [[]]
    room = per
    for dst, src, n in jobs:
        off = 0
        while off < n:
            if room == 0:
                shares.append([])
                room = per
            take = min(room, n - off)
            shares[-1].append((dst + off, src + off, take))
            off += take
            room -= take
    return shares


def _copy_share(share: list[_Job]) -> None:
    for dst, src, n in share:
        _memmove(dst, src, n)


class HostFactory(EpFactory):
    """The built-in host CPU backend; registered under the name ``host`` in every environment.

    Options: ``copy_threads`` (an int in [1, 1024], or an int string; default: the CPU
    count) for large host copies.
    """

    name = HOST_EP_NAME
    vendor = "aioep"
    version = "0.1.0"

    def __init__(self, options: FactoryOptions | None = None) -> None:
        reject_unknown_options("host backend", options, ("copy_threads",))
        threads = (options or {}).get("copy_threads")
        if threads is not None:  # the rules every backend's options follow (aioep.abc)
            threads = parse_int_option(
                "host backend", "copy_threads", threads, minimum=1, maximum=MAX_COPY_THREADS
            )
        self._copy_threads = threads

    def get_supported_devices(self, hardware: Sequence[HardwareDevice]) -> list[EpDevice]:
        cpu = (
            next((h for h in hardware if h.type is DeviceType.CPU), None) or host_hardware_device()
        )
        return [EpDevice(self, cpu, memory_infos={MemoryType.DEFAULT: HOST_MEMORY_INFO})]

    def create_allocator(
        self, memory_info: MemoryInfo, options: FactoryOptions | None
    ) -> Allocator:
        if memory_info.device != HOST_MEMORY_INFO.device:
            raise InvalidArgument(f"host backend has no memory {memory_info.name!r}")
        return HostAllocator(memory_info)

    def create_data_transfer(self) -> DataTransfer:
        return HostDataTransfer(self._copy_threads)

    def create_memory_importer(self) -> MemoryImporter:
        """Host RAM handed over as ``kDLCPU`` (numpy, PyTorch and JAX CPU tensors)."""
        return HostMemoryImporter()

    def is_stream_aware(self) -> bool:
        return True

    def create_sync_stream(
        self, memory_device: MemoryDevice, options: Mapping[str, Any] | None
    ) -> StreamImpl:
        if options:
            raise InvalidArgument(f"host stream: unknown option(s) {sorted(options)}")
        return ThreadStream("aioep-host-stream")
