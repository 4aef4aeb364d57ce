"""What a session needs of the environment that creates it: `SessionHost`, declared here
and handed in by the environment (which sits above sessions), so that no session module
imports the environment."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy.typing as npt

    from .._base.budget import InlineBudget
    from .._base.types import DeviceType, MemoryDevice, MemoryInfo
    from .._copies.future import CopyFuture
    from .._plugin.allocator import Allocator
    from .._plugin.device import EpDevice
    from .._plugin.ep import EpEnvironment
    from .._plugin.importer import MemoryImporter
    from .._plugin.loader import ExternalDataLoader
    from .._plugin.ownership import Scope
    from .._plugin.stream import SyncStream
    from .._plugin.tensor import Tensor
    from .._plugin.transfer import TensorLike

__all__ = ["SessionHost"]


class SessionHost(Protocol):
    """The environment's services a session (and `load_initializers`) uses: its devices,
    streams, memory and copies, the owner check of tensors, the memory importers of foreign
    values, and the count of open sessions per library (unregistering refuses while one is
    open)."""

    @property
    def environment(self) -> EpEnvironment:
        """The environment itself, as the EPs of the session see it (`Ep.environment`)."""
        ...

    @property
    def scope(self) -> Scope:
        """The environment's ownership scope: device tensors of other environments are refused."""
        ...

    @property
    def inline_budget(self) -> InlineBudget:
        """Decides which CPU-only runs go inline on the event loop (`InlineBudget`)."""
        ...

    def check_open(self) -> None:
        """Raise `ClosedError` unless the environment is open."""
        ...

    def check_device(self, ep_device: EpDevice) -> None:
        """Raise `InvalidArgument` unless ``ep_device`` is registered in this environment."""
        ...

    def ep_devices(
        self, device_type: DeviceType | None = None, ep_name: str | None = None
    ) -> list[EpDevice]:
        """EP devices in registration order, optionally filtered by type and EP name."""
        ...

    def create_sync_stream(
        self, ep_device: EpDevice, options: Mapping[str, Any] | None = None
    ) -> SyncStream:
        """A new stream on ``ep_device``."""
        ...

    def get_shared_allocator(self, memory_info: MemoryInfo) -> Allocator | None:
        """The shared allocator for that memory, or None."""
        ...

    def empty(
        self,
        shape: Sequence[int] | int,
        dtype: npt.DTypeLike,
        memory_info: MemoryInfo | None = None,
        *,
        stream: SyncStream | None = None,
    ) -> Tensor:
        """An uninitialised tensor from the shared allocator of ``memory_info``."""
        ...

    def copy_tensors(
        self, src: Sequence[TensorLike], dst: Sequence[TensorLike], stream: SyncStream | None
    ) -> CopyFuture:
        """Copy each ``src[i]`` into ``dst[i]`` (see `Environment.copy_tensors`)."""
        ...

    def can_copy(self, src: MemoryDevice, dst: MemoryDevice) -> bool:
        """Whether a registered data transfer copies from ``src`` to ``dst`` memory."""
        ...

    def importers(self) -> list[MemoryImporter]:
        """The registered libraries' memory importers (for foreign values)."""
        ...

    def external_data_loader(self, memory_info: MemoryInfo) -> ExternalDataLoader | None:
        """The first registered loader that can fill tensors in ``memory_info``, or None."""
        ...

    def track_session(self, session: object, ep_devices: Sequence[EpDevice], *, open: bool) -> None:
        """Count an open session against the libraries of its devices (``open=False``: it
        closed)."""
        ...
