"""The plugin base class: an execution-provider factory (ORT's ``OrtEpFactory``)."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._base.errors import NotImplementedByEp
from .._base.types import HardwareDevice, MemoryDevice, MemoryInfo
from .allocator import Allocator
from .stream_impl import StreamImpl
from .transfer import DataTransfer

if TYPE_CHECKING:
    from .device import EpDevice
    from .ep import Ep
    from .importer import MemoryImporter
    from .loader import ExternalDataLoader

__all__ = ["EpFactory", "FactoryOptions"]

FactoryOptions = Mapping[str, "str | int | float"]
"""Options as a factory's methods receive them: name -> str, int or float."""


class EpFactory(abc.ABC):
    """Offers devices, allocators, a data transfer, streams and EPs for one backend.

    Subclasses set ``name`` (the EP name), ``vendor``, ``vendor_id`` and
    ``version`` (SemVer), take their options as one optional mapping in
    ``__init__`` (raising [`InvalidArgument`][aioep.InvalidArgument] for an unknown or bad option),
    and implement [`get_supported_devices`][aioep.abc.EpFactory.get_supported_devices] and
    [`create_allocator`][aioep.abc.EpFactory.create_allocator]. A factory that starts but finds no
    device returns no devices and may set ``unavailable_reason`` to say why; the environment records
    it in ``load_errors``.
    """

    name: str = ""
    vendor: str = ""
    vendor_id: int = 0
    version: str = "0.1.0"
    unavailable_reason: str | None = None

    @abc.abstractmethod
    def get_supported_devices(self, hardware: Sequence[HardwareDevice]) -> list[EpDevice]:
        """EP devices for the hardware this factory supports (it may add its own hardware)."""

    @abc.abstractmethod
    def create_allocator(
        self, memory_info: MemoryInfo, options: FactoryOptions | None
    ) -> Allocator:
        """A device allocator for one of this factory's memory infos."""

    def create_data_transfer(self) -> DataTransfer | None:
        """The data transfer for this factory's memory, or None."""
        return None

    def is_stream_aware(self) -> bool:
        """True if [`create_sync_stream`][aioep.abc.EpFactory.create_sync_stream] is implemented."""
        return False

    def create_sync_stream(
        self, memory_device: MemoryDevice, options: Mapping[str, Any] | None
    ) -> StreamImpl:
        """A backend stream on the device that owns ``memory_device``."""
        raise NotImplementedByEp(f"The execution provider {self.name!r} does not support streams.")

    def create_external_data_loader(self) -> ExternalDataLoader | None:
        """A loader that puts external initializer data straight into device memory, or None."""
        return None

    def create_memory_importer(self) -> MemoryImporter | None:
        """What adopts other libraries' memory (DLPack, CUDA Array Interface) on this
        factory's devices, or None (see [`aioep.abc.MemoryImporter`][aioep.abc.MemoryImporter])."""
        return None

    def create_ep(self, ep_devices: Sequence[EpDevice], options: Mapping[str, Any] | None) -> Ep:
        """An execution provider (``aioep.Ep``) for these devices, one per session."""
        raise NotImplementedByEp(f"The execution provider {self.name!r} cannot create an EP.")

    def close(self) -> None:
        """Release everything; called last when the library is unregistered."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
