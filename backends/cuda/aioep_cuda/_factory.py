"""The CUDA execution-provider factory: discovery, options, allocators, streams, transfer."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aioep import (
    EpDevice,
    HardwareDevice,
    InvalidArgument,
    MemoryDevice,
    MemoryInfo,
    MemoryType,
)
from aioep.abc import (
    Allocator,
    DataTransfer,
    EpFactory,
    FactoryOptions,
    StreamImpl,
    parse_choice_option,
    parse_int_option,
    reject_unknown_options,
)

from ._allocator import CudaDeviceAllocator, CudaPinnedAllocator
from ._device import NVIDIA_VENDOR_ID, CudaDevice
from ._dlpack import CudaMemoryImporter
from ._driver import check, driver, load_driver
from ._staging import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_CHUNKS,
    DEFAULT_THREADS,
    Staging,
    StagingOptions,
)
from ._stream import CudaStream
from ._transfer import CudaDataTransfer
from ._wake import Dispatcher

__all__ = ["CudaFactory", "CudaOptions"]

_OWNER = "cuda backend"
_CHOICES = {"allocator": ("async", "sync"), "wake": ("auto", "hostfn", "poll")}
_STAGING = {  # option: (minimum, maximum)
    "staging_chunk_bytes": (1 << 10, 1 << 40),
    "staging_chunks": (0, 1 << 12),
    "staging_threads": (1, 256),
}
_KNOWN = (*_CHOICES, "pool_release_threshold", "pinned_pool_limit", *_STAGING)


def _default_pinned_limit() -> int:
    """Half the host's physical memory (the pinned pool's default limit); -1 if unknown."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE")) // 2
    except (ValueError, OSError, AttributeError):
        return -1


DEFAULT_PINNED_POOL_LIMIT = _default_pinned_limit()


@dataclass(frozen=True)
class CudaOptions:
    """The CUDA backend's options (``backend_options={"cuda": {...}}``).

    Attributes:
        allocator: ``"async"`` (stream-ordered ``cuMemAllocAsync`` on the device's
            default memory pool; the default) or ``"sync"`` (``cuMemAlloc``).
        wake: ``"auto"`` (the default: the dispatcher thread polls a new waiter's event
            for up to 100 us, then its ``sem_post`` host function wakes it), ``"hostfn"``
            (the host function only) or ``"poll"`` (``cuEventQuery`` with backoff only; for
            comparison).
        pool_release_threshold: bytes the default memory pool keeps cached across
            synchronisations (``CU_MEMPOOL_ATTR_RELEASE_THRESHOLD``); -1 leaves the
            driver's setting (0: return memory at every synchronisation).
        pinned_pool_limit: most bytes of pinned host memory the device's pinned pool holds
            (in use and cached together; default: half the host's memory; -1: no limit).
            Pinned memory is never given back to the driver while an environment runs
            (``cuMemFreeHost`` synchronises the device): freed blocks are reused.
        staging_chunk_bytes: size of one pinned staging chunk for copies to or from
            pageable host memory (default 64 MiB).
        staging_chunks: most staging chunks per device (default 4): the pinned staging
            memory of a device is bounded by ``staging_chunks * staging_chunk_bytes``,
            shared by every copy in flight; 0 turns staging off (the driver's own
            pageable copies, issued by the staging threads).
        staging_threads: worker threads per device that copy between pageable memory and
            the chunks (default ``min(8, cpu_count)``).

    The staging defaults come from one measurement of a hand-written pipeline on an H200
    host and are provisional until ``benchmarks/cuda_pageable.py`` has measured this
    implementation on a GPU.
    """

    allocator: str = "async"
    wake: str = "auto"
    pool_release_threshold: int = -1
    pinned_pool_limit: int = DEFAULT_PINNED_POOL_LIMIT
    staging_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    staging_chunks: int = DEFAULT_CHUNKS
    staging_threads: int = DEFAULT_THREADS

    @property
    def staging(self) -> StagingOptions:
        """The staging options of pageable host copies."""
        return StagingOptions(self.staging_chunk_bytes, self.staging_chunks, self.staging_threads)

    @classmethod
    def from_options(cls, options: FactoryOptions | None) -> CudaOptions:
        """Validate ``options``; an unknown key or a bad value is an `InvalidArgument`.

        Values follow `aioep.abc`'s option rules: ``pool_release_threshold`` is an
        int or an int string (decimal or ``0x`` hex, not a float).
        """
        reject_unknown_options(_OWNER, options, _KNOWN)
        opts = dict(options or {})
        values: dict[str, Any] = {}
        for key, choices in _CHOICES.items():
            if key in opts:
                values[key] = parse_choice_option(_OWNER, key, opts[key], choices)
        if "pool_release_threshold" in opts:
            # -1 leaves the driver's setting; the attribute is a cuuint64_t.
            values["pool_release_threshold"] = parse_int_option(
                _OWNER,
                "pool_release_threshold",
                opts["pool_release_threshold"],
                minimum=-1,
                maximum=(1 << 64) - 1,
            )
        if "pinned_pool_limit" in opts:
            values["pinned_pool_limit"] = parse_int_option(
                _OWNER,
                "pinned_pool_limit",
                opts["pinned_pool_limit"],
                minimum=-1,
                maximum=(1 << 63) - 1,
            )
        for key, (lo, hi) in _STAGING.items():
            if key in opts:
                values[key] = parse_int_option(_OWNER, key, opts[key], minimum=lo, maximum=hi)
        return cls(**values)


class CudaFactory(EpFactory):
    """NVIDIA GPUs through the CUDA driver API (``cuda.bindings.driver``).

    One EP device per GPU with DEFAULT (device) and HOST_ACCESSIBLE (pinned)
    memory. Without a driver or a GPU the factory still starts, offers no
    device and says why in ``unavailable_reason``.
    """

    name = "CUDAExecutionProvider"
    vendor = "NVIDIA"
    vendor_id = NVIDIA_VENDOR_ID
    version = "0.1.0"

    def __init__(self, options: FactoryOptions | None = None) -> None:
        self.options = CudaOptions.from_options(options)
        self.devices: dict[int, CudaDevice] = {}
        self.dispatcher: Dispatcher | None = None
        self.transfers: list[CudaDataTransfer] = []
        self.staging: Staging | None = None
        """Pageable-copy staging, one stager per device (with the first data transfer)."""
        self._closed = False
        try:
            drv = load_driver()
            count = int(check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
        except Exception as exc:
            self.unavailable_reason = f"CUDA is unavailable: {exc}"
            return
        if count == 0:
            self.unavailable_reason = "no CUDA device found (cuDeviceGetCount returned 0)"
            return
        problems = []
        for ordinal in range(count):
            try:
                self.devices[ordinal] = CudaDevice(
                    ordinal, pinned_pool_limit=self.options.pinned_pool_limit
                )
            except Exception as exc:
                problems.append(f"device {ordinal}: {exc}")
        if not self.devices:
            self.unavailable_reason = "no usable CUDA device: " + "; ".join(problems)
            return
        self._configure_pools()
        self.dispatcher = Dispatcher()
        first = next(iter(self.devices.values()))
        self.dispatcher.on_start = lambda: check(
            driver().cuCtxSetCurrent(first.ctx), "cuCtxSetCurrent"
        )

    def _configure_pools(self) -> None:
        if self.options.allocator != "async":
            return
        drv = driver()
        for dev in self.devices.values():
            if not dev.memory_pools:
                continue
            pool = check(drv.cuDeviceGetDefaultMemPool(dev.cu_device), "cuDeviceGetDefaultMemPool")
            if self.options.pool_release_threshold >= 0:
                check(
                    drv.cuMemPoolSetAttribute(
                        pool,
                        drv.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                        drv.cuuint64_t(self.options.pool_release_threshold),
                    ),
                    "cuMemPoolSetAttribute(RELEASE_THRESHOLD)",
                )
            # Peers may read pool memory directly (D2D peer copies at full speed).
            for other in self.devices.values():
                if other is dev:
                    continue
                ok = drv.cuDeviceCanAccessPeer(other.cu_device, dev.cu_device)
                if ok[0] != drv.CUresult.CUDA_SUCCESS or not ok[1]:
                    continue
                desc = drv.CUmemAccessDesc()
                desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                desc.location.id = other.ordinal
                desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                drv.cuMemPoolSetAccess(pool, [desc], 1)  # best effort

    # -- EpFactory -------------------------------------------------------------------------
    def get_supported_devices(self, hardware: Sequence[HardwareDevice]) -> list[EpDevice]:
        return [
            EpDevice(
                self,
                dev.hardware,
                memory_infos={
                    MemoryType.DEFAULT: dev.default_info,
                    MemoryType.HOST_ACCESSIBLE: dev.pinned_info,
                },
                ep_metadata={"cuda_device": str(dev.ordinal), "name": dev.name},
                ep_options={"device_id": str(dev.ordinal)},
            )
            for dev in self.devices.values()
        ]

    def _device_of(self, memory_device: MemoryDevice, what: str) -> CudaDevice:
        dev = self.devices.get(memory_device.device_id)
        if (
            dev is None
            or memory_device.vendor_id != NVIDIA_VENDOR_ID
            or memory_device not in (dev.default_info.device, dev.pinned_info.device)
        ):
            raise InvalidArgument(f"cuda backend: {what}: {memory_device} is not a CUDA memory")
        return dev

    def create_allocator(
        self, memory_info: MemoryInfo, options: FactoryOptions | None
    ) -> Allocator:
        dev = self._device_of(memory_info.device, "create_allocator")
        reject_unknown_options("cuda allocator", options, ("allocator",))
        mode = parse_choice_option(
            "cuda allocator",
            "allocator",
            (options or {}).get("allocator", self.options.allocator),
            _CHOICES["allocator"],
        )
        if memory_info.memory_type is MemoryType.HOST_ACCESSIBLE:
            return CudaPinnedAllocator(dev)
        return CudaDeviceAllocator(dev, mode)

    def create_data_transfer(self) -> DataTransfer | None:
        if not self.devices:
            return None
        if self.staging is None:
            assert self.dispatcher is not None
            self.staging = Staging(
                self.options.staging, self.dispatcher, wake=self.options.wake, owner=self
            )
        transfer = CudaDataTransfer(self.devices, self, self.staging)
        self.transfers.append(transfer)
        return transfer

    def create_memory_importer(self) -> CudaMemoryImporter | None:
        """Adopts device memory of these GPUs and page-locked host memory handed over by
        DLPack (``kDLCUDA``, ``kDLCUDAHost``) or a CUDA Array Interface."""
        return CudaMemoryImporter(self.devices) if self.devices else None

    def is_stream_aware(self) -> bool:
        return bool(self.devices)

    def create_sync_stream(
        self, memory_device: MemoryDevice, options: Mapping[str, Any] | None
    ) -> StreamImpl:
        reject_unknown_options("cuda stream", options, ())
        dev = self._device_of(memory_device, "create_sync_stream")
        assert self.dispatcher is not None
        return CudaStream(dev, self.dispatcher, wake=self.options.wake, owner=self)

    def close(self) -> None:
        """Open every pending pageable-copy gate (no stream stays held by a copy that will
        never run), let the staged copies already queued finish, stop the dispatcher, destroy
        this factory's streams and leave the devices: the last environment on a device
        releases its shared state there (waiting for the device: the environment closes off
        the event loop)."""
        if self._closed:
            return
        self._closed = True
        for transfer in self.transfers:
            transfer.close()
        if self.staging is not None:
            self.staging.close()  # queued staged copies finish; chunks go back to the pool
        if self.dispatcher is not None:
            self.dispatcher.close()
        for dev in self.devices.values():
            dev.close()
