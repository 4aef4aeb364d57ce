"""Enums and frozen value types that describe devices and memory (ORT's OrtHardwareDevice,
OrtMemoryDevice and OrtMemoryInfo)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .errors import InvalidArgument
from .validate import check_int, check_type, describe

_MAX_ID = (1 << 32) - 1  # vendor and device ids are uint32 in ORT

__all__ = [
    "HOST_EP_NAME",
    "HOST_MEMORY_DEVICE",
    "AllocatorType",
    "DeviceType",
    "HardwareDevice",
    "MemoryDevice",
    "MemoryInfo",
    "MemoryType",
]


class DeviceType(enum.Enum):
    """The kind of hardware (ORT's ``OrtHardwareDeviceType``)."""

    CPU = "cpu"
    GPU = "gpu"
    NPU = "npu"
    FPGA = "fpga"


class MemoryType(enum.Enum):
    """Which memory of a device: its own (DEFAULT) or host memory it can reach (HOST_ACCESSIBLE)."""

    DEFAULT = "default"
    HOST_ACCESSIBLE = "host_accessible"


class AllocatorType(enum.Enum):
    """A plain device allocator, or a (BFC) arena on top of one."""

    DEVICE = "device"
    ARENA = "arena"


def _frozen_mapping(value: Mapping[str, str] | None) -> Mapping[str, str]:
    return MappingProxyType(dict(value or {}))


@dataclass(frozen=True)
class HardwareDevice:
    """A physical (or simulated) device: what ORT calls an ``OrtHardwareDevice``."""

    type: DeviceType
    vendor_id: int
    device_id: int
    vendor: str
    metadata: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.type, DeviceType):
            raise InvalidArgument(f"HardwareDevice.type must be a DeviceType, got {self.type!r}")
        check_int("HardwareDevice", "vendor_id", self.vendor_id, maximum=_MAX_ID)
        check_int("HardwareDevice", "device_id", self.device_id, maximum=_MAX_ID)
        check_type("HardwareDevice", "vendor", self.vendor, str, "a str")
        if not isinstance(self.metadata, Mapping):
            raise InvalidArgument(
                f"HardwareDevice: metadata must be a mapping, got {describe(self.metadata)}"
            )
        if self.vendor_id < 0 or self.device_id < 0:
            raise InvalidArgument(
                f"HardwareDevice ids must be >= 0, got vendor_id={self.vendor_id}, "
                f"device_id={self.device_id}"
            )
        object.__setattr__(self, "metadata", _frozen_mapping(self.metadata))


@dataclass(frozen=True)
class MemoryDevice:
    """Where memory lives: the key for data-transfer routing and shared allocators."""

    device_type: DeviceType
    memory_type: MemoryType
    vendor_id: int = 0
    device_id: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.device_type, DeviceType):
            raise InvalidArgument(
                f"MemoryDevice.device_type must be a DeviceType, got {self.device_type!r}"
            )
        if not isinstance(self.memory_type, MemoryType):
            raise InvalidArgument(
                f"MemoryDevice.memory_type must be a MemoryType, got {self.memory_type!r}"
            )
        check_int("MemoryDevice", "vendor_id", self.vendor_id, maximum=_MAX_ID)
        check_int("MemoryDevice", "device_id", self.device_id, maximum=_MAX_ID)
        # Routing and allocator lookups hash these on every copy: compute the hash once.
        object.__setattr__(
            self,
            "_hash",
            hash((self.device_type.value, self.memory_type.value, self.vendor_id, self.device_id)),
        )
        object.__setattr__(
            self,
            "_host_accessible",
            self.device_type is DeviceType.CPU or self.memory_type is MemoryType.HOST_ACCESSIBLE,
        )

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined,no-any-return]

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild on unpickling: the cached hash depends on the process's string hash seed.
        return (type(self), (self.device_type, self.memory_type, self.vendor_id, self.device_id))

    @property
    def is_host_accessible(self) -> bool:
        """True when the CPU can read this memory directly (host RAM or pinned memory)."""
        return self._host_accessible  # type: ignore[attr-defined,no-any-return]

    def __str__(self) -> str:
        kind = self.device_type.value
        mem = "" if self.memory_type is MemoryType.DEFAULT else "/host_accessible"
        return f"{kind}:{self.vendor_id:#x}:{self.device_id}{mem}"


HOST_MEMORY_DEVICE = MemoryDevice(DeviceType.CPU, MemoryType.DEFAULT, 0, 0)


@dataclass(frozen=True)
class MemoryInfo:
    """A named memory description: device, alignment and allocator type (ORT's ``OrtMemoryInfo``)."""

    name: str
    device: MemoryDevice
    alignment: int = 64
    allocator_type: AllocatorType = AllocatorType.DEVICE

    def __post_init__(self) -> None:
        check_type("MemoryInfo", "name", self.name, str, "a str")
        check_type("MemoryInfo", "device", self.device, MemoryDevice, "an aioep.MemoryDevice")
        check_int("MemoryInfo", "alignment", self.alignment, minimum=1, maximum=1 << 30)
        check_type(
            "MemoryInfo", "allocator_type", self.allocator_type, AllocatorType, "an AllocatorType"
        )
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise InvalidArgument(
                f"MemoryInfo {self.name!r}: alignment must be a power of two, got {self.alignment}"
            )

    @property
    def memory_type(self) -> MemoryType:
        """Shorthand for ``device.memory_type``."""
        return self.device.memory_type

    @property
    def device_type(self) -> DeviceType:
        """Shorthand for ``device.device_type``."""
        return self.device.device_type


HOST_EP_NAME = "host"
"""The name the host library registers under in every environment."""
