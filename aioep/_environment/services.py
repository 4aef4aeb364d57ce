"""What an environment hands to the sessions it creates: `EnvironmentServices`, the
environment's side of the `SessionHost` interface that ``aioep._session.host`` declares."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._base.budget import InlineBudget
from .._base.errors import ClosedError

if TYPE_CHECKING:
    import numpy.typing as npt

    from .._base.types import DeviceType, MemoryDevice, MemoryInfo
    from .._copies.dispatcher import CopyDispatcher
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
    from .registry import LibraryRegistry
    from .shared_allocators import SharedAllocators

__all__ = ["EnvironmentServices"]


class EnvironmentServices:
    """An environment's devices, streams, memory and copies as its sessions and
    `load_initializers` use them (satisfies ``aioep._session.host.SessionHost``)."""

    __slots__ = ("_allocators", "_copies", "_env", "_registry", "_scope", "is_open")

    def __init__(
        self,
        env: EpEnvironment,
        registry: LibraryRegistry,
        allocators: SharedAllocators,
        copies: CopyDispatcher,
        scope: Scope,
    ) -> None:
        self._env = env
        self._registry = registry
        self._allocators = allocators
        self._copies = copies
        self._scope = scope
        self.is_open = False
        """Set by the environment while it is open."""

    @property
    def environment(self) -> EpEnvironment:
        """The environment itself (bound to each EP of a session)."""
        return self._env

    @property
    def scope(self) -> Scope:
        """The environment's ownership scope."""
        return self._scope

    @property
    def inline_budget(self) -> InlineBudget:
        """The environment's inline budget (its copies' and its sessions')."""
        return self._copies.budget

    def check_open(self) -> None:
        """Raise `ClosedError` unless the environment is open."""
        if not self.is_open:
            raise ClosedError(f"{self._env!r} is not open")

    def check_device(self, ep_device: EpDevice) -> None:
        """Raise `InvalidArgument` unless ``ep_device`` is registered in this environment."""
        self._registry.library_of(ep_device)

    def ep_devices(
        self, device_type: DeviceType | None = None, ep_name: str | None = None
    ) -> list[EpDevice]:
        """EP devices in registration order, optionally filtered by type and EP name."""
        return self._registry.ep_devices(device_type, ep_name)

    def create_sync_stream(
        self, ep_device: EpDevice, options: Mapping[str, Any] | None = None
    ) -> SyncStream:
        """A new stream on ``ep_device`` (see `Environment.create_sync_stream`)."""
        return self._env.create_sync_stream(ep_device, options)

    def get_shared_allocator(self, memory_info: MemoryInfo) -> Allocator | None:
        """The shared allocator for that memory, or None."""
        self.check_open()
        return self._allocators.get(memory_info)

    def empty(
        self,
        shape: Sequence[int] | int,
        dtype: npt.DTypeLike,
        memory_info: MemoryInfo | None = None,
        *,
        stream: SyncStream | None = None,
    ) -> Tensor:
        """An uninitialised tensor from the shared allocator of ``memory_info``."""
        if not self.is_open:
            self.check_open()
        return self._allocators.empty(shape, dtype, memory_info, stream)

    def copy_tensors(
        self, src: Sequence[TensorLike], dst: Sequence[TensorLike], stream: SyncStream | None
    ) -> CopyFuture:
        """Copy each ``src[i]`` into ``dst[i]`` (see `Environment.copy_tensors`)."""
        if not self.is_open:
            self.check_open()
        return self._copies.copy(src, dst, stream, False)

    def can_copy(self, src: MemoryDevice, dst: MemoryDevice) -> bool:
        """Whether a registered data transfer copies from ``src`` to ``dst`` memory."""
        return self._copies.can_copy(src, dst)

    def importers(self) -> list[MemoryImporter]:
        """The registered libraries' memory importers."""
        return self._registry.importers()

    def external_data_loader(self, memory_info: MemoryInfo) -> ExternalDataLoader | None:
        """The first registered loader that can fill tensors in ``memory_info``, or None."""
        return self._registry.external_data_loader(memory_info)

    def track_session(self, session: object, ep_devices: Sequence[EpDevice], *, open: bool) -> None:
        """Count an open session against the libraries of its devices."""
        self._registry.track_session(session, ep_devices, open=open)
