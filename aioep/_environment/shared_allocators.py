"""The environment's shared allocators: one per memory device, with ORT's rules for
creating, replacing, releasing and registering them."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from .._base.errors import InvalidArgument
from .._base.types import (
    HOST_EP_NAME,
    AllocatorType,
    DeviceType,
    MemoryDevice,
    MemoryInfo,
    MemoryType,
)
from .._plugin.allocator import Allocator, set_origin
from .._plugin.ownership import Origin, Scope
from .._plugin.tensor import Tensor, tensor_layout, tensor_over

if TYPE_CHECKING:
    from .._plugin.device import EpDevice
    from .._plugin.stream import SyncStream
    from .library import Library

__all__ = ["SharedAllocators", "make_allocator"]


@dataclass(eq=False)
class _Shared:
    allocator: Allocator
    owner: str | None  # library name, or None for a user's allocator


def make_allocator(
    lib: Library, info: MemoryInfo, options: Mapping[str, Any] | None, scope: Scope
) -> Allocator:
    """A new allocator from ``lib``'s factory, counted among the library's allocators and
    marked as made by ``lib`` in the environment of ``scope``."""
    allocator = lib.factory.create_allocator(info, options)
    if not isinstance(allocator, Allocator):
        raise InvalidArgument(
            f"factory {lib.factory.name!r}.create_allocator returned {allocator!r}, "
            "not an aioep.Allocator"
        )
    set_origin(allocator, Origin(scope, lib.name))
    lib.allocators.append(allocator)
    return allocator


def _device_of(memory_info: MemoryInfo | MemoryDevice) -> MemoryDevice:
    return memory_info.device if isinstance(memory_info, MemoryInfo) else memory_info


class SharedAllocators:
    """Memory device -> the allocator everyone shares for it, plus the host fallback.

    A library's default allocators never replace an existing entry; a replaced or
    released allocator made by a library is retired (it keeps serving its live
    buffers); a user's registered allocator is never closed here.
    """

    __slots__ = ("_lock", "_shared", "host", "scope")

    def __init__(self, lock: threading.RLock, scope: Scope) -> None:
        self._lock = lock
        self.scope = scope
        self._shared: dict[MemoryDevice, _Shared] = {}
        self.host: Allocator | None = None
        """The host library's allocator: CPU memory with no shared allocator of its own."""

    def as_dict(self) -> dict[MemoryDevice, Allocator]:
        """Memory device -> shared allocator (the host fallback not included)."""
        return {k: v.allocator for k, v in self._shared.items()}

    def add_defaults(self, lib: Library, infos: Sequence[MemoryInfo]) -> None:
        """Make ``lib``'s default allocator for each memory it offers that has none yet."""
        for info in infos:
            if lib.factory.name == HOST_EP_NAME and self.host is None:
                self.host = make_allocator(lib, info, None, self.scope)
            elif info.device not in self._shared:
                self._shared[info.device] = _Shared(
                    make_allocator(lib, info, None, self.scope), lib.name
                )

    def drop_library(self, name: str) -> None:
        """Forget the shared allocators owned by library ``name`` (the library closes them)."""
        for key, entry in list(self._shared.items()):
            if entry.owner == name:
                del self._shared[key]

    def clear(self) -> None:
        """Forget every shared allocator, the host fallback included."""
        self._shared.clear()
        self.host = None

    def get(self, memory_info: MemoryInfo | MemoryDevice) -> Allocator | None:
        """The shared allocator for that memory (the name is ignored), or None."""
        device = _device_of(memory_info)
        if not isinstance(device, MemoryDevice):
            raise InvalidArgument(
                f"get_shared_allocator needs a MemoryInfo or MemoryDevice, got {memory_info!r}"
            )
        entry = self._shared.get(device)
        if entry is not None:
            return entry.allocator
        if device.device_type is DeviceType.CPU:
            return self.host
        return None

    def create(
        self,
        lib: Library,
        ep_device: EpDevice,
        memory_type: MemoryType,
        allocator_type: AllocatorType,
        options: Mapping[str, Any] | None,
    ) -> Allocator:
        """Create an allocator of ``lib`` for a device's memory and make it the shared one."""
        info = ep_device.memory_info(memory_type) if isinstance(memory_type, MemoryType) else None
        if info is None:
            raise InvalidArgument(
                f"Invalid memory type for OrtEpDevice: {ep_device!r} has no {memory_type!r} memory"
            )
        if not isinstance(allocator_type, AllocatorType):
            raise InvalidArgument(
                f"allocator_type must be an AllocatorType, got {allocator_type!r}"
            )
        opts = dict(options or {})
        arena_opts = {k: v for k, v in opts.items() if k.startswith("arena.")}
        factory_opts = {k: v for k, v in opts.items() if not k.startswith("arena.")}
        if allocator_type is AllocatorType.DEVICE:
            if arena_opts:
                raise InvalidArgument(
                    f"arena options {sorted(arena_opts)} need allocator_type=AllocatorType.ARENA"
                )
            allocator = make_allocator(lib, info, factory_opts or None, self.scope)
        else:
            from .._memory.arena import ArenaAllocator, ArenaConfig

            config = ArenaConfig.from_options(arena_opts)
            base = make_allocator(lib, info, factory_opts or None, self.scope)
            # The arena owns its base (it holds the regions and retires the base when it
            # closes), so only the arena's own buffers count as the library's live ones.
            lib.allocators.remove(base)
            allocator = ArenaAllocator(base, config)
            lib.allocators.append(allocator)
        self._replace(info.device, _Shared(allocator, lib.name))
        return allocator

    def _replace(self, device: MemoryDevice, entry: _Shared | None) -> None:
        old = self._shared.pop(device, None)
        if entry is not None:
            self._shared[device] = entry
        if old is not None and old.owner is not None:
            old.allocator.retire()

    def release(self, ep_device: EpDevice, memory_type: MemoryType) -> None:
        """Remove the shared allocator for a device's memory (its live buffers stay valid)."""
        info = ep_device.memory_info(memory_type)
        if info is None:
            raise InvalidArgument(
                f"Invalid memory type for OrtEpDevice: {ep_device!r} has no {memory_type!r} memory"
            )
        if info.device not in self._shared:
            raise InvalidArgument(
                f"No allocator for this device has been registered for sharing: {info.device}"
            )
        self._replace(info.device, None)

    def register(self, allocator: Allocator) -> None:
        """Share a user's own allocator for its memory device."""
        if not isinstance(allocator, Allocator):
            raise InvalidArgument(f"register_allocator needs an aioep.Allocator, got {allocator!r}")
        with self._lock:
            device = allocator.memory_info.device
            if device in self._shared:
                raise InvalidArgument(
                    f"an allocator is already registered for {device} "
                    f"({self._shared[device].allocator!r}); release it first"
                )
            self._shared[device] = _Shared(allocator, None)

    def unregister(self, memory_info: MemoryInfo | MemoryDevice) -> None:
        """Stop sharing the user allocator for that memory (it is not closed)."""
        device = _device_of(memory_info)
        with self._lock:
            entry = self._shared.get(device)
            if entry is None or entry.owner is not None:
                raise InvalidArgument(f"no user allocator is registered for {device}")
            del self._shared[device]

    def empty(
        self,
        shape: Sequence[int] | int,
        dtype: npt.DTypeLike,
        memory_info: MemoryInfo | None,
        stream: SyncStream | None,
    ) -> Tensor:
        """An uninitialised tensor from the shared allocator of ``memory_info`` (default: host)."""
        if memory_info is None:
            allocator = self.host
        elif isinstance(memory_info, MemoryInfo):
            entry = self._shared.get(memory_info.device)
            allocator = entry.allocator if entry is not None else self.get(memory_info)
        else:
            raise InvalidArgument(f"empty: memory_info must be a MemoryInfo, got {memory_info!r}")
        if allocator is None:
            raise InvalidArgument(f"No shared allocator found for {memory_info!r}")
        dims, dt, size, nbytes = tensor_layout("empty", shape, dtype)  # checked once, here
        buffer = allocator.alloc(nbytes, stream=stream)
        return tensor_over(buffer, dims, dt, size, nbytes)
