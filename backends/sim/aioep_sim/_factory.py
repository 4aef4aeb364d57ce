"""The sim backend's factory: the entry point ``sim`` -> ``aioep_sim:SimFactory``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aioep import EpDevice, HardwareDevice, InvalidArgument, MemoryDevice, MemoryInfo, MemoryType
from aioep.abc import (
    Allocator,
    DataTransfer,
    EpFactory,
    FactoryOptions,
    StreamImpl,
    reject_unknown_options,
)

from ._allocator import PinnedAllocator, SimAllocator
from ._device import SIM_VENDOR_ID, SimDevice
from ._dlpack import SimMemoryImporter
from ._ep import SimEp
from ._loader import SimExternalDataLoader
from ._options import SimOptions
from ._stream import SimStream
from ._transfer import SimDataTransfer

__all__ = ["SimFactory"]


class SimFactory(EpFactory):
    """A simulated accelerator backend with ``num_devices`` GPU-type devices.

    Each device has DEFAULT memory the host cannot read (a private address
    space, ``memory_bytes`` of it) and HOST_ACCESSIBLE (pinned) memory; streams
    are worker threads; copies go through per-direction copy engines. Options
    (validated; see the README): ``num_devices``, ``memory_bytes``,
    ``bandwidth_gbps``, ``latency_us``, ``fail_after_copies``,
    ``lose_device_after_copies``.
    """

    name = "SimExecutionProvider"
    vendor = "aioep"
    vendor_id = SIM_VENDOR_ID
    version = "0.1.0"

    def __init__(self, options: FactoryOptions | None = None) -> None:
        self.options = SimOptions.from_options(options)
        self.devices: tuple[SimDevice, ...] = tuple(
            SimDevice(i, self.options) for i in range(self.options.num_devices)
        )
        if not self.devices:
            self.unavailable_reason = "sim backend configured with num_devices=0"

    def device(self, memory: MemoryInfo | MemoryDevice) -> SimDevice:
        """The sim device that owns this memory.

        Raises:
            InvalidArgument: the memory is not one of this factory's devices.
        """
        md = memory.device if isinstance(memory, MemoryInfo) else memory
        dev = None
        if isinstance(md, MemoryDevice) and md.vendor_id == SIM_VENDOR_ID:
            dev = next((d for d in self.devices if d.device_id == md.device_id), None)
        if dev is None:
            raise InvalidArgument(
                f"sim backend: {memory!r} is not memory of a device of this sim factory"
            )
        return dev

    def get_supported_devices(self, hardware: Sequence[HardwareDevice]) -> list[EpDevice]:
        # The sim brings its own hardware: the devices exist because the options say so.
        # Each factory instance is separate hardware with its own memory: where the
        # environment already has sim devices (the factory registered twice, under two
        # names), this one numbers its devices after them, so that no memory device of
        # one instance compares equal to one of the other (routing goes by memory device:
        # a copy for one instance's memory can never reach the other's transfer).
        ours = {id(d.hardware) for d in self.devices}  # identity: equal hardware is not ours
        taken = [
            h.device_id for h in hardware if h.vendor_id == SIM_VENDOR_ID and id(h) not in ours
        ]
        if taken and any(d.device_id in taken for d in self.devices):
            if any(d.memory.live_allocations for d in self.devices):
                raise InvalidArgument(
                    "sim backend: this factory's devices are in use and their ids collide "
                    "with sim devices already registered; use a new SimFactory"
                )
            first = max(taken) + 1
            self.devices = tuple(
                SimDevice(first + i, self.options) for i in range(self.options.num_devices)
            )
        return [
            EpDevice(
                self,
                dev.hardware,
                memory_infos={
                    MemoryType.DEFAULT: dev.memory_info,
                    MemoryType.HOST_ACCESSIBLE: dev.pinned_memory_info,
                },
                ep_metadata={"device_id": str(dev.device_id)},
            )
            for dev in self.devices
        ]

    def create_allocator(
        self, memory_info: MemoryInfo, options: FactoryOptions | None
    ) -> Allocator:
        reject_unknown_options("sim allocator", options, ())
        dev = self.device(memory_info)
        if memory_info.device == dev.memory_info.device:
            return SimAllocator(memory_info, dev)
        if memory_info.device == dev.pinned_memory_info.device:
            return PinnedAllocator(memory_info)
        raise InvalidArgument(f"sim backend has no memory {memory_info!r}")

    def create_data_transfer(self) -> DataTransfer:
        return SimDataTransfer({d.device_id: d for d in self.devices}, self.options)

    def create_external_data_loader(self) -> SimExternalDataLoader:
        """Reads external initializer data straight into sim device memory (no host staging)."""
        return SimExternalDataLoader({d.device_id: d for d in self.devices})

    def create_memory_importer(self) -> SimMemoryImporter:
        """Adopts sim device memory handed over by DLPack (``kDLExtDev``) or a CUDA Array
        Interface (a pointer inside a live sim allocation)."""
        return SimMemoryImporter({d.device_id: d for d in self.devices})

    def is_stream_aware(self) -> bool:
        return True

    def create_sync_stream(
        self, memory_device: MemoryDevice, options: Mapping[str, Any] | None
    ) -> StreamImpl:
        reject_unknown_options("sim stream", options, ())
        dev = self.device(memory_device)
        if memory_device.memory_type is not MemoryType.DEFAULT:
            raise InvalidArgument(
                f"sim stream: {memory_device} is not the DEFAULT memory of a sim device"
            )
        return SimStream(dev)

    def create_ep(self, ep_devices: Sequence[EpDevice], options: Mapping[str, Any] | None) -> SimEp:
        """The sim execution provider (numpy kernels on sim device memory); see ``_ep.py``."""
        return SimEp(self, options)

    def __repr__(self) -> str:
        return f"<SimFactory devices={len(self.devices)} {self.options}>"
