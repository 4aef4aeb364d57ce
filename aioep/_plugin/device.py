"""EP devices: what a factory offers for one hardware device (ORT's ``OrtEpDevice``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from .._base.errors import InvalidArgument
from .._base.types import HardwareDevice, MemoryInfo, MemoryType
from .._base.validate import check_options, check_type

if TYPE_CHECKING:
    from .factory import EpFactory
    from .stream import SyncStream

__all__ = ["EpDevice", "StreamMaker", "bind_device", "device_owner"]


class StreamMaker(Protocol):
    """What makes the streams of a registered EP device: the environment it is registered
    in (`aioep.Environment` is one)."""

    def create_sync_stream(
        self, ep_device: EpDevice, options: Mapping[str, Any] | None = None
    ) -> SyncStream:
        """A new stream on ``ep_device``."""
        ...


_SEMVER = re.compile(r"^\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$")


class EpDevice:
    """One execution provider on one hardware device, with its memory infos.

    Factories build these in ``get_supported_devices``; the environment binds
    them when the library is registered, after which
    [`create_sync_stream`][aioep.EpDevice.create_sync_stream] works.
    """

    __slots__ = (
        "__weakref__",
        "_env",
        "_memory_infos",
        "ep_metadata",
        "ep_options",
        "factory",
        "hardware",
    )

    def __init__(
        self,
        factory: EpFactory,
        hardware: HardwareDevice,
        *,
        memory_infos: Mapping[MemoryType, MemoryInfo],
        ep_metadata: Mapping[str, str] | None = None,
        ep_options: Mapping[str, str] | None = None,
    ) -> None:
        check_type("EpDevice", "hardware", hardware, HardwareDevice, "an aioep.HardwareDevice")
        check_type("EpDevice", "memory_infos", memory_infos, Mapping, "a mapping")
        for info in memory_infos.values():
            check_type("EpDevice", "a memory info", info, MemoryInfo, "an aioep.MemoryInfo")
        metadata = check_options("EpDevice", "ep_metadata", ep_metadata)
        check_options("EpDevice", "ep_options", ep_options)
        if "version" in metadata:
            raise InvalidArgument(
                f"EpDevice of {factory.name!r}: The provided EP metadata should not explicitly "
                "specify the EP version (it comes from the factory)."
            )
        if not _SEMVER.match(factory.version):
            raise InvalidArgument(
                f"EpDevice of {factory.name!r}: factory version {factory.version!r} is not SemVer"
            )
        metadata["version"] = factory.version
        for mem_type, info in memory_infos.items():
            if not isinstance(mem_type, MemoryType):
                raise InvalidArgument("Memory type must be DEFAULT or HOST_ACCESSIBLE.")
            if info.device.memory_type is not mem_type:
                raise InvalidArgument(
                    f"EpDevice of {factory.name!r}: memory info {info.name!r} is "
                    f"{info.device.memory_type.name} memory but was offered as {mem_type.name}"
                )
        self.factory = factory
        self.hardware = hardware
        self._memory_infos = dict(memory_infos)
        self.ep_metadata: Mapping[str, str] = MappingProxyType(metadata)
        self.ep_options: Mapping[str, str] = MappingProxyType(dict(ep_options or {}))
        self._env: StreamMaker | None = None

    @property
    def ep_name(self) -> str:
        """The execution provider's name (from the factory)."""
        return self.factory.name

    @property
    def ep_vendor(self) -> str:
        """The execution provider's vendor (from the factory)."""
        return self.factory.vendor

    @property
    def device_type(self) -> Any:
        """Shorthand for ``hardware.type``."""
        return self.hardware.type

    def memory_info(self, memory_type: MemoryType = MemoryType.DEFAULT) -> MemoryInfo | None:
        """The memory info of that type, or None where the device has none."""
        if not isinstance(memory_type, MemoryType):
            check_type(
                "EpDevice.memory_info", "memory_type", memory_type, MemoryType, "a MemoryType"
            )
        return self._memory_infos.get(memory_type)

    @property
    def memory_infos(self) -> tuple[MemoryInfo, ...]:
        """All memory infos, DEFAULT first."""
        return tuple(self._memory_infos[t] for t in MemoryType if t in self._memory_infos)

    def create_sync_stream(self, options: Mapping[str, Any] | None = None) -> SyncStream:
        """Shorthand for ``env.create_sync_stream(self, options)``."""
        if self._env is None:
            raise InvalidArgument(
                f"{self!r} is not registered in an open Environment; register its library first"
            )
        return self._env.create_sync_stream(self, options)

    def __repr__(self) -> str:
        return (
            f"<EpDevice {self.ep_name!r} {self.hardware.type.name} "
            f"vendor={self.hardware.vendor!r} id={self.hardware.device_id}>"
        )


def bind_device(device: EpDevice, owner: StreamMaker | None) -> None:
    """Register ``device`` with ``owner`` (the environment that registered its library), or
    unbind it (None) when the library goes."""
    device._env = owner


def device_owner(device: EpDevice) -> StreamMaker | None:
    """What ``device`` is registered with (its environment), or None."""
    return device._env
