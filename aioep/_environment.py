"""The environment: plugin libraries, their devices, shared allocators, data transfers,
streams and copies (ORT's ``OrtEnv``)."""

from __future__ import annotations

import contextvars
import enum
import gc
import importlib
import importlib.metadata
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt
from anyio.abc import AsyncResource

from ._allocator import Allocator
from ._device import EpDevice
from ._errors import (
    ClosedError,
    EpError,
    ErrorCode,
    InUseError,
    InvalidArgument,
    NoSuchFile,
    NotImplementedByEp,
    translate_backend_error,
)
from ._external_data import ExternalDataLoader
from ._factory import EpFactory
from ._future import CopyFuture
from ._host import HOST_EP_NAME, HostFactory, host_hardware_device, lower_thread_priority
from ._notification import Notification
from ._stream import SyncStream
from ._stream_impl import HostNotification, NotificationImpl, StreamImpl, ThreadStream
from ._tensor import Tensor, _normalize_shape
from ._transfer import CopyPlan, DataTransfer, RouteCache, TensorLike, plan_copies
from ._types import AllocatorType, DeviceType, HardwareDevice, MemoryDevice, MemoryInfo, MemoryType

__all__ = ["BACKEND_GROUP", "Environment", "copy_tensors", "current_environment"]

BACKEND_GROUP = "aioep.backends"
PATH_BACKEND = "ort"  # the backend that loads ONNX Runtime plugin EP libraries given by path

_current: contextvars.ContextVar[Environment | None] = contextvars.ContextVar(
    "aioep_current_environment", default=None
)
_HARDWARE_ORDER = {DeviceType.NPU: 0, DeviceType.GPU: 1, DeviceType.FPGA: 2, DeviceType.CPU: 3}


class _State(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(eq=False)
class _Library:
    name: str
    factory: EpFactory
    ep_devices: list[EpDevice] = field(default_factory=list)
    allocators: list[Allocator] = field(default_factory=list)  # every allocator made from it
    transfer: DataTransfer | None = None
    loader: ExternalDataLoader | None = None
    streams: set[SyncStream] = field(default_factory=set)
    sessions: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)  # open sessions
    retired: list[Allocator] = field(default_factory=list)  # retired, still serving live buffers


@dataclass(eq=False)
class _Shared:
    allocator: Allocator
    owner: str | None  # library name, or None for a user's allocator


def current_environment() -> Environment:
    """The environment entered by the nearest enclosing ``async with Environment()``.

    Raises:
        EpError: no environment is open in this context.
    """
    env = _current.get()
    if env is None or env._state is not _State.OPEN:
        raise EpError(
            "no aioep Environment is open in this context; wrap the code in "
            "'async with aioep.Environment() as env:'"
        )
    return env


def copy_tensors(
    src: Sequence[TensorLike],
    dst: Sequence[TensorLike],
    stream: SyncStream | None = None,
    *,
    allow_reshape: bool = False,
) -> CopyFuture:
    """Copy each ``src[i]`` into ``dst[i]`` in the current environment; see
    :meth:`Environment.copy_tensors`."""
    return current_environment().copy_tensors(src, dst, stream, allow_reshape=allow_reshape)


class Environment(AsyncResource):
    """Holds plugin libraries and everything they offer; the root object of aioep.

    ``async with Environment() as env`` registers the built-in host device and
    every installed backend (entry-point group ``aioep.backends``), makes the
    environment current for this context, and on exit waits for copies in
    flight, then closes streams, data transfers and loaders, allocators and
    factories, in that order.

    Args:
        autoload: register installed backends on entry.
        backends: only these backend names (default: all installed).
        backend_options: per-backend factory options, e.g. ``{"sim": {"latency_us": 50}}``.
    """

    def __init__(
        self,
        *,
        autoload: bool = True,
        backends: Sequence[str] | None = None,
        backend_options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        if isinstance(backends, str):
            raise InvalidArgument(
                f"Environment(backends=...) takes a list of names, got {backends!r}"
            )
        self._autoload = autoload
        self._backends = None if backends is None else list(backends)
        self._backend_options = {k: dict(v) for k, v in (backend_options or {}).items()}
        self._state = _State.UNOPENED
        self._lock = threading.RLock()
        self._libraries: dict[str, _Library] = {}
        self._hardware: list[HardwareDevice] = [host_hardware_device()]
        self._shared: dict[MemoryDevice, _Shared] = {}
        self._host_allocator: Allocator | None = None
        self._transfers: list[tuple[str, DataTransfer]] = []
        self._loaders: list[tuple[str, ExternalDataLoader]] = []
        self._inflight: dict[CopyFuture, frozenset[str]] = {}
        self._routes = RouteCache()  # un-streamed copies; each SyncStream has its own
        self._executor: ThreadPoolExecutor | None = None
        self._token: contextvars.Token[Environment | None] | None = None
        self.load_errors: dict[str, str] = {}
        """Backend name -> why it could not start or offers no device."""

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """``"unopened"``, ``"open"``, ``"closing"`` or ``"closed"``."""
        return self._state.value

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise ClosedError(f"{self!r} is not open")

    def open(self) -> Environment:
        """Register the host device and installed backends and make this environment current.

        The synchronous form of ``async with``; pair it with :meth:`close`.
        """
        self._start()
        self._token = _current.set(self)
        return self

    def _check_unopened(self) -> None:
        if self._state is not _State.UNOPENED:
            raise ClosedError(f"{self!r} was already opened; create a new Environment")

    def _start(self) -> None:
        self._check_unopened()
        self._state = _State.OPEN
        try:
            self.register_library(HOST_EP_NAME, HostFactory(self._backend_options.get("host")))
            if self._autoload or self._backends:
                self._load_backends()
        except BaseException:
            self._teardown()
            raise

    def _load_backends(self) -> None:
        wanted = None if self._backends is None else set(self._backends)
        found: set[str] = set()
        for ep in sorted(_backend_entry_points(), key=lambda e: e.name):
            if wanted is not None and ep.name not in wanted:
                continue
            found.add(ep.name)
            try:
                target = ep.load()
                self.register_library(ep.name, target, self._backend_options.get(ep.name))
            except Exception as exc:
                # Report the backend's own failure, not the registration wrapper around it.
                root = exc.__cause__ if isinstance(exc, EpError) and exc.__cause__ else exc
                message = f"{type(root).__name__}: {root}"
                self.load_errors[ep.name] = message
                warnings.warn(
                    f"aioep backend {ep.name!r} could not start and was skipped: {message}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        for name in sorted((wanted or set()) - found):
            self.load_errors[name] = (
                f"no backend named {name!r} is installed (entry-point group {BACKEND_GROUP!r})"
            )
            warnings.warn(
                f"aioep backend {name!r} is not installed (entry-point group {BACKEND_GROUP!r})",
                RuntimeWarning,
                stacklevel=3,
            )

    async def __aenter__(self) -> Environment:
        self._check_unopened()
        # Importing backends and starting devices (driver init, contexts, ORT library
        # registration) can take a while: do it off the loop. Shielded, so a cancellation
        # cannot leave an open environment that no ``async with`` body will close; it is
        # delivered at the body's first checkpoint, and __aexit__ closes the environment.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._start)
        self._token = _current.set(self)
        return self

    async def aclose(self) -> None:
        """Wait for copies in flight, then release everything in dependency order; idempotent.

        Shielded from cancellation. Resources that are still alive (open streams,
        live buffers) are reported with a :class:`ResourceWarning`.
        """
        if self._state in (_State.CLOSED, _State.CLOSING, _State.UNOPENED):
            self._state = _State.CLOSED if self._state is _State.UNOPENED else self._state
            return
        self._state = _State.CLOSING
        with anyio.CancelScope(shield=True):
            for session in {s for lib in self._libraries.values() for s in lib.sessions}:
                warnings.warn(
                    f"{session!r} was still open when the environment closed; closing it",
                    ResourceWarning,
                    stacklevel=2,
                )
                await session.aclose()
            for fut in list(self._inflight):
                try:
                    await fut
                except Exception:
                    pass
            for stream in self._open_streams():
                try:
                    await stream.synchronize()
                except Exception:
                    pass
            # Closing streams, transfers, allocators and factories may join threads or sync
            # a device: do it off the event loop. The context variable is reset here, on it.
            await anyio.to_thread.run_sync(self._release_everything)
            self._reset_current()

    def close(self) -> None:
        """Blocking form of :meth:`aclose`, for synchronous scripts."""
        if self._state in (_State.CLOSED, _State.CLOSING, _State.UNOPENED):
            self._state = _State.CLOSED if self._state is _State.UNOPENED else self._state
            return
        self._state = _State.CLOSING
        for fut in list(self._inflight):
            try:
                fut.wait()
            except Exception:
                pass
        self._teardown()

    def _open_streams(self) -> list[SyncStream]:
        return [s for lib in self._libraries.values() for s in list(lib.streams)]

    def _teardown(self) -> None:
        self._release_everything()
        self._reset_current()

    def _release_everything(self) -> None:
        self._state = _State.CLOSING
        libraries = list(reversed(self._libraries.values()))
        for stream in self._open_streams():
            warnings.warn(
                f"{stream!r} was still open when the environment closed; closing it",
                ResourceWarning,
                stacklevel=2,
            )
            stream.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for lib in libraries:
            self._close_transfer_and_loader(lib)
        for lib in libraries:
            self._close_allocators(lib, report=True)
        self._shared.clear()
        self._host_allocator = None
        for lib in libraries:
            self._close_factory(lib)
        self._libraries.clear()
        self._state = _State.CLOSED

    def _reset_current(self) -> None:
        if self._token is not None:
            try:
                _current.reset(self._token)
            except ValueError:  # closed from another context: leave that context alone
                if _current.get() is self:
                    _current.set(None)
            self._token = None

    # -- libraries -------------------------------------------------------------------------
    @property
    def libraries(self) -> tuple[str, ...]:
        """Registered library names, in registration order."""
        return tuple(self._libraries)

    def register_library(
        self, name: str, target: Any, options: Mapping[str, Any] | None = None
    ) -> list[EpDevice]:
        """Register a plugin library and return the EP devices it offers.

        ``target`` is an :class:`EpFactory` instance or class (a class is
        constructed with ``options``), a ``"module:attr"`` string naming either,
        or the path of an ONNX Runtime plugin EP shared library (handled by the
        ``ort`` backend). Adds the library's EP devices, one default shared
        allocator per memory info (never replacing an existing one), its data
        transfer and its external-data loader. A bad target raises at once and
        leaves the environment unchanged.
        """
        self._check_open()
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"register_library: name must be a non-empty str, got {name!r}")
        with self._lock:
            if name in self._libraries:
                raise InvalidArgument(f"library is already registered under {name!r}")
            factory = _resolve_factory(name, target, options)
            lib = _Library(name, factory)
            hardware_before = list(self._hardware)
            had_load_error = name in self.load_errors
            try:
                self._add_library(lib)
            except BaseException as exc:
                self._remove_library(lib)
                self._hardware[:] = hardware_before
                if not had_load_error:
                    self.load_errors.pop(name, None)
                if isinstance(exc, EpError):
                    raise
                raise EpError(
                    f"Failed to register EP library under {name!r} with error: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            return list(lib.ep_devices)

    def _add_library(self, lib: _Library) -> None:
        factory = lib.factory
        hardware = sorted(self._hardware, key=lambda h: _HARDWARE_ORDER[h.type])
        devices = factory.get_supported_devices(hardware)
        for dev in devices:
            if not isinstance(dev, EpDevice) or dev.factory is not factory:
                raise InvalidArgument(
                    f"factory {factory.name!r}.get_supported_devices returned {dev!r}, which is not "
                    "an EpDevice of that factory"
                )
        if not devices and factory.unavailable_reason:
            self.load_errors[lib.name] = factory.unavailable_reason
        self._libraries[lib.name] = lib
        for dev in devices:
            dev._env = self
            lib.ep_devices.append(dev)
            if dev.hardware not in self._hardware:
                self._hardware.append(dev.hardware)
            for info in dev.memory_infos:
                if lib.factory.name == HOST_EP_NAME and self._host_allocator is None:
                    self._host_allocator = self._make_allocator(lib, info, None)
                elif info.device not in self._shared:
                    self._shared[info.device] = _Shared(
                        self._make_allocator(lib, info, None), lib.name
                    )
        try:
            transfer = factory.create_data_transfer()
        except Exception as exc:
            raise EpError(
                f"Error creating data transfer for {lib.name!r}: {type(exc).__name__}: {exc}",
                code=ErrorCode.EP_FAIL,
            ) from exc
        if transfer is not None:
            lib.transfer = transfer
            self._transfers.append((lib.name, transfer))
        loader = factory.create_external_data_loader()
        if loader is not None:
            lib.loader = loader
            self._loaders.append((lib.name, loader))

    def _make_allocator(
        self, lib: _Library, info: MemoryInfo, options: Mapping[str, Any] | None
    ) -> Allocator:
        allocator = lib.factory.create_allocator(info, options)
        if not isinstance(allocator, Allocator):
            raise InvalidArgument(
                f"factory {lib.factory.name!r}.create_allocator returned {allocator!r}, "
                "not an aioep.Allocator"
            )
        lib.allocators.append(allocator)
        return allocator

    def unregister_library(self, name: str) -> None:
        """Remove a library: its data transfer and loader, its devices and shared allocators,
        then close its factory.

        Raises:
            InvalidArgument: no library is registered under ``name``.
            InUseError: its streams, buffers or copies are still alive (nothing is removed).
        """
        self._check_open()
        with self._lock:
            lib = self._libraries.get(name)
            if lib is None:
                raise InvalidArgument(f"Execution provider library: {name!r} was not registered.")
            if name == HOST_EP_NAME:
                raise InvalidArgument("the built-in host library cannot be unregistered")
            in_use = self._in_use(lib)
            if in_use:
                raise InUseError(
                    f"cannot unregister library {name!r}: still in use by {', '.join(in_use)}; "
                    "close its sessions and streams, await its copies and drop its tensors first"
                )
            self._remove_library(lib)

    def _in_use(self, lib: _Library) -> list[str]:
        reasons = []
        streams = [s for s in lib.streams if not s.closed]
        if streams:
            reasons.append(f"{len(streams)} open stream(s) ({', '.join(map(repr, streams))})")
        live = [(a, a.live_buffers) for a in lib.allocators if a.live_buffers]
        if live:
            where = ", ".join(f"{n} from {a.memory_info.name!r}" for a, n in live)
            reasons.append(f"{sum(n for _, n in live)} live buffer(s) ({where})")
        sessions = list(lib.sessions)
        if sessions:
            reasons.append(f"{len(sessions)} open session(s) ({', '.join(map(repr, sessions))})")
        copies = sum(
            1 for f, libs in list(self._inflight.items()) if lib.name in libs and not f.done()
        )
        if copies:
            reasons.append(f"{copies} copy batch(es) in flight")
        return reasons

    def _remove_library(self, lib: _Library) -> None:
        # ORT's order: data transfers, then devices and their shared allocators, then the factory.
        self._libraries.pop(lib.name, None)
        self._close_transfer_and_loader(lib)
        for dev in lib.ep_devices:
            dev._env = None
        for key, entry in list(self._shared.items()):
            if entry.owner == lib.name:
                del self._shared[key]
        self._close_allocators(lib, report=False)
        self._close_factory(lib)

    def _close_transfer_and_loader(self, lib: _Library) -> None:
        if lib.transfer is not None:
            self._transfers = [t for t in self._transfers if t[1] is not lib.transfer]
            _quietly(lib.transfer.close, f"data transfer of {lib.name!r}")
            lib.transfer = None
        if lib.loader is not None:
            self._loaders = [t for t in self._loaders if t[1] is not lib.loader]
            _quietly(lib.loader.close, f"external data loader of {lib.name!r}")
            lib.loader = None

    def _close_allocators(self, lib: _Library, *, report: bool) -> None:
        if report and any(a.live_buffers for a in lib.allocators):
            # Buffers held only by reference cycles are garbage, not alive: collect them
            # before reporting, so the warning names only what the program still holds.
            gc.collect()
        for allocator in lib.allocators:
            if allocator.live_buffers and report:
                warnings.warn(
                    f"{allocator!r} of library {lib.name!r} still had {allocator.live_buffers} "
                    "live buffer(s) when the environment closed; they stay valid until dropped",
                    ResourceWarning,
                    stacklevel=3,
                )
            _quietly(allocator.retire, f"allocator {allocator.memory_info.name!r}")
        lib.retired = [a for a in lib.allocators if not a.closed]
        lib.allocators.clear()

    def _close_factory(self, lib: _Library) -> None:
        # A retired allocator closes when its last buffer is freed; its factory must outlive it.
        pending = [a for a in lib.retired if not a.closed]
        lib.retired = []
        if not pending:
            _quietly(lib.factory.close, f"factory of {lib.name!r}")
            return
        remaining = [len(pending)]
        count_lock = threading.Lock()

        def one_closed() -> None:
            with count_lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                _quietly(lib.factory.close, f"factory of {lib.name!r}")

        for allocator in pending:
            allocator.add_close_callback(one_closed)

    # -- devices ---------------------------------------------------------------------------
    @property
    def hardware_devices(self) -> list[HardwareDevice]:
        """Hardware known to the environment: the host CPU and every registered device's."""
        return list(self._hardware)

    def ep_devices(
        self, device_type: DeviceType | None = None, ep_name: str | None = None
    ) -> list[EpDevice]:
        """EP devices in registration order, optionally filtered by type and EP name."""
        return [
            d
            for lib in self._libraries.values()
            for d in lib.ep_devices
            if (device_type is None or d.hardware.type is device_type)
            and (ep_name is None or d.ep_name == ep_name)
        ]

    def _library_of(self, ep_device: EpDevice) -> _Library:
        for lib in self._libraries.values():
            if any(d is ep_device for d in lib.ep_devices):
                return lib
        raise InvalidArgument(f"{ep_device!r} is not registered in this environment")

    # -- allocators ------------------------------------------------------------------------
    @property
    def shared_allocators(self) -> dict[MemoryDevice, Allocator]:
        """Memory device -> shared allocator (the host fallback not included)."""
        return {k: v.allocator for k, v in self._shared.items()}

    def get_shared_allocator(self, memory_info: MemoryInfo | MemoryDevice) -> Allocator | None:
        """The shared allocator for that memory (the name is ignored), or None.

        CPU memory with no allocator of its own falls back to the host allocator.
        """
        self._check_open()
        device = memory_info.device if isinstance(memory_info, MemoryInfo) else memory_info
        if not isinstance(device, MemoryDevice):
            raise InvalidArgument(
                f"get_shared_allocator needs a MemoryInfo or MemoryDevice, got {memory_info!r}"
            )
        entry = self._shared.get(device)
        if entry is not None:
            return entry.allocator
        if device.device_type is DeviceType.CPU:
            return self._host_allocator
        return None

    def create_shared_allocator(
        self,
        ep_device: EpDevice,
        memory_type: MemoryType = MemoryType.DEFAULT,
        allocator_type: AllocatorType = AllocatorType.ARENA,
        options: Mapping[str, Any] | None = None,
    ) -> Allocator:
        """Create an allocator for a device's memory and make it the shared one.

        ``allocator_type=ARENA`` builds a stream-aware BFC arena over the factory's
        device allocator, configured by the ``arena.*`` keys of ``options`` (ORT's
        names); other keys go to the factory. The replaced allocator keeps serving
        its live buffers and closes after the last one is freed.
        """
        self._check_open()
        with self._lock:
            lib = self._library_of(ep_device)
            info = (
                ep_device.memory_info(memory_type) if isinstance(memory_type, MemoryType) else None
            )
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
                allocator = self._make_allocator(lib, info, factory_opts or None)
            else:
                from ._arena import ArenaAllocator, ArenaConfig

                config = ArenaConfig.from_options(arena_opts)
                base = self._make_allocator(lib, info, factory_opts or None)
                # The arena owns its base (it holds the regions and retires the base when it
                # closes), so only the arena's own buffers count as the library's live ones.
                lib.allocators.remove(base)
                allocator = ArenaAllocator(base, config)
                lib.allocators.append(allocator)
            self._replace_shared(info.device, _Shared(allocator, lib.name))
            return allocator

    def _replace_shared(self, device: MemoryDevice, entry: _Shared | None) -> None:
        old = self._shared.pop(device, None)
        if entry is not None:
            self._shared[device] = entry
        if old is not None and old.owner is not None:
            old.allocator.retire()

    def release_shared_allocator(
        self, ep_device: EpDevice, memory_type: MemoryType = MemoryType.DEFAULT
    ) -> None:
        """Remove the shared allocator for a device's memory (its live buffers stay valid)."""
        self._check_open()
        with self._lock:
            self._library_of(ep_device)
            info = ep_device.memory_info(memory_type)
            if info is None:
                raise InvalidArgument(
                    f"Invalid memory type for OrtEpDevice: {ep_device!r} has no {memory_type!r} memory"
                )
            if info.device not in self._shared:
                raise InvalidArgument(
                    f"No allocator for this device has been registered for sharing: {info.device}"
                )
            self._replace_shared(info.device, None)

    def register_allocator(self, allocator: Allocator) -> None:
        """Share a user's own allocator for its memory device.

        Raises:
            InvalidArgument: an allocator is already shared for that memory device.
        """
        self._check_open()
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

    def unregister_allocator(self, memory_info: MemoryInfo | MemoryDevice) -> None:
        """Stop sharing the user allocator for that memory (it is not closed: it is yours)."""
        self._check_open()
        device = memory_info.device if isinstance(memory_info, MemoryInfo) else memory_info
        with self._lock:
            entry = self._shared.get(device)
            if entry is None or entry.owner is not None:
                raise InvalidArgument(f"no user allocator is registered for {device}")
            del self._shared[device]

    def empty(
        self,
        shape: Sequence[int] | int,
        dtype: npt.DTypeLike,
        memory_info: MemoryInfo | None = None,
        *,
        stream: SyncStream | None = None,
    ) -> Tensor:
        """An uninitialised tensor from the shared allocator of ``memory_info`` (default: host)."""
        self._check_open()
        if memory_info is None:
            allocator = self._host_allocator
        else:
            if not isinstance(memory_info, MemoryInfo):
                raise InvalidArgument(
                    f"empty: memory_info must be a MemoryInfo, got {memory_info!r}"
                )
            allocator = self.get_shared_allocator(memory_info)
        if allocator is None:
            raise InvalidArgument(f"No shared allocator found for {memory_info!r}")
        dims = _normalize_shape(shape)
        try:
            itemsize = np.dtype(dtype).itemsize
        except TypeError as exc:
            raise InvalidArgument(f"empty: {dtype!r} is not a numpy dtype") from exc
        nbytes = itemsize
        for d in dims:
            nbytes *= d
        buffer = allocator.alloc(nbytes, stream=stream)
        return Tensor(buffer, dims, dtype)

    # -- streams ---------------------------------------------------------------------------
    def create_sync_stream(
        self, ep_device: EpDevice, options: Mapping[str, Any] | None = None
    ) -> SyncStream:
        """A new stream on ``ep_device`` (an async context manager; awaitable).

        Raises:
            NotImplementedByEp: the device's factory does not support streams.
        """
        self._check_open()
        with self._lock:
            lib = self._library_of(ep_device)
            factory = lib.factory
            info = ep_device.memory_info(MemoryType.DEFAULT)
            if info is None:
                raise InvalidArgument(f"{ep_device!r} has no DEFAULT memory to run a stream on")
            if not factory.is_stream_aware():
                raise NotImplementedByEp(
                    f"The execution provider {factory.name!r} does not support streams."
                )
            try:
                impl = factory.create_sync_stream(info.device, options)
            except Exception as exc:
                raise translate_backend_error(exc, f"{factory.name!r} create_sync_stream") from exc
            if impl is None:
                raise EpError(
                    f"Failed to get a stream implementation from the EP factory {factory.name!r}."
                )
            stream = SyncStream(impl, ep_device, on_close=lib.streams.discard)
            lib.streams.add(stream)
            return stream

    def _track_session(self, session: Any, ep_devices: Sequence[EpDevice], *, open: bool) -> None:
        """Count an open session against the libraries of its devices (unregister refuses)."""
        for dev in ep_devices:
            for lib in self._libraries.values():
                if any(d is dev for d in lib.ep_devices):
                    if open:
                        lib.sessions.add(session)
                    else:
                        lib.sessions.discard(session)

    def _stream_library(self, stream: SyncStream) -> _Library:
        for lib in self._libraries.values():
            if stream in lib.streams:
                return lib
        raise InvalidArgument(f"{stream!r} does not belong to this environment")

    # -- copies ----------------------------------------------------------------------------
    def copy_tensors(
        self,
        src: Sequence[TensorLike],
        dst: Sequence[TensorLike],
        stream: SyncStream | None = None,
        *,
        allow_reshape: bool = False,
    ) -> CopyFuture:
        """Copy each ``src[i]`` into ``dst[i]`` and return a :class:`CopyFuture`.

        Everything is validated before anything is enqueued: equal counts, equal
        dtype, size and shape per pair (``allow_reshape=True`` permits a byte copy
        between shapes), writable destinations that overlap nothing, and a data
        transfer for each device pair. With ``stream`` the copies are enqueued on
        it in order; without one they run off the event loop (tiny batches inline).
        """
        self._check_open()
        if stream is None and not allow_reshape:
            done = _copy_small_arrays(src, dst, self._transfers)
            if done is not None:
                return CopyFuture.completed(done, Notification(_Completed(None)))
        if stream is None:
            # Strided sources are packed where the copy runs, off the loop.
            plan = plan_copies(
                src,
                dst,
                self._transfers,
                allow_reshape=allow_reshape,
                routes=self._routes,
                defer_packing=True,
            )
            return self._copy_unstreamed(plan)
        if not isinstance(stream, SyncStream):
            raise InvalidArgument(f"copy_tensors: stream must be a SyncStream, got {stream!r}")
        stream._check_open()
        stream_lib = self._stream_library(stream)
        impl = stream.impl
        # A worker-thread stream packs strided sources itself, in order before the copies.
        # Other streams (CUDA) may read the sources as soon as a copy is enqueued.
        in_order_worker = isinstance(impl, ThreadStream)
        plan = plan_copies(
            src,
            dst,
            self._transfers,
            stream_impl=impl,
            stream_library=stream_lib.name,
            allow_reshape=allow_reshape,
            routes=stream._routes,
            defer_packing=in_order_worker,
        )
        if not plan.groups:
            return CopyFuture.completed(plan.dst, Notification(_Completed(None)))
        if plan.packs:
            assert isinstance(impl, ThreadStream)  # only such streams defer packing
            impl.enqueue(plan.pack)
        for transfer, pairs in plan.groups:
            try:
                transfer.copy_tensors(pairs, impl)
            except Exception as exc:
                error = translate_backend_error(exc, f"enqueueing copies on {stream!r}")
                if error is exc:
                    raise
                raise error from exc
        stream._enqueued()
        future = CopyFuture(plan.src + plan.dst, plan.dst, stream.record(), stream)
        if not future.done():
            self._track(future, frozenset(plan.libraries | {stream_lib.name}))
        return future

    def _copy_unstreamed(self, plan: CopyPlan) -> CopyFuture:
        if not plan.groups:
            return CopyFuture.completed(plan.dst, Notification(_Completed(None)))
        if plan.inline:
            # Small host-side batches: a few memcpys cost less than any hand-off to a thread.
            failure = _run_groups(plan)
            what = "copy_tensors" if failure is None else _describe(failure[0])
            error = None if failure is None else failure[1]
            return CopyFuture.completed(plan.dst, Notification(_Completed(error)), what)
        signal = HostNotification()
        what = " / ".join(_describe(t) for t, _ in plan.groups)
        future = CopyFuture(plan.src + plan.dst, plan.dst, Notification(signal), what)
        self._get_executor().submit(_run_plan, plan, signal)
        if not future.done():
            self._track(future, frozenset(plan.libraries))
        return future

    def _track(self, future: CopyFuture, libraries: frozenset[str]) -> None:
        self._inflight[future] = libraries
        future.add_done_callback(self._forget)

    def _forget(self, future: CopyFuture) -> None:
        self._inflight.pop(future, None)

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=max(4, os.cpu_count() or 1),
                    thread_name_prefix="aioep-copy",
                    initializer=lower_thread_priority,
                )
            return self._executor

    # -- external data ---------------------------------------------------------------------
    def external_data_loader(self, memory_info: MemoryInfo) -> ExternalDataLoader | None:
        """The first registered loader that can fill tensors in ``memory_info``, or None."""
        for _, loader in self._loaders:
            if loader.can_load(memory_info):
                return loader
        return None

    async def load_initializers(
        self,
        model: str | os.PathLike[str],
        ep_device: EpDevice,
        names: Sequence[str] | None = None,
        **options: Any,
    ) -> dict[str, Tensor]:
        """Load a model's initializers onto ``ep_device`` (external data straight to the device).

        See :func:`aioep._external_data.load_initializers` for ``options``.
        """
        self._check_open()
        from ._external_data import load_initializers

        return await load_initializers(self, model, ep_device, names, **options)

    async def create_session(
        self,
        model: Any,
        ep_devices: Sequence[EpDevice] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> Any:
        """Partition ``model`` across the EPs of ``ep_devices`` and return an awaitable session."""
        self._check_open()
        from ._session import create_session

        return await create_session(self, model, ep_devices, options)

    def __repr__(self) -> str:
        return f"<Environment {self._state.value} libraries={list(self._libraries)}>"


_FAST_PATH_MAX_PAIRS = 4


def _copy_small_arrays(
    src: Sequence[TensorLike],
    dst: Sequence[TensorLike],
    transfers: Sequence[tuple[str, DataTransfer]],
) -> list[Tensor] | None:
    """Copy a small batch of plain numpy arrays inline and return the destination tensors,
    or None (having written nothing) for anything else, which takes the general path.

    A 4 KiB ``await copy_tensors`` is dominated by per-call overhead; this path skips
    building source tensors and the routing machinery. It only accepts what the general
    path would accept and route to the host transfer inline, so every error still comes
    from the general path with its full message.
    """
    if type(src) not in (list, tuple) or type(dst) not in (list, tuple):
        return None
    n = len(src)
    if n == 0 or n != len(dst) or n > _FAST_PATH_MAX_PAIRS or not transfers:
        return None
    host = transfers[0][1]
    if transfers[0][0] != HOST_EP_NAME:
        return None
    budget = host.max_inline_bytes
    arrays = [*src, *dst]
    for i, a in enumerate(arrays):
        if type(a) is not np.ndarray or not a.flags.c_contiguous or a.dtype.hasobject:
            return None
        if i >= n:
            s = arrays[i - n]
            if (
                a.dtype != s.dtype  # type: ignore[union-attr]
                or a.shape != s.shape  # type: ignore[union-attr]
                or not a.flags.writeable
            ):
                return None
            budget -= a.nbytes
    if budget < 0:
        return None
    for i in range(n, 2 * n):  # a destination may overlap nothing else
        for j in range(2 * n):
            if j != i and np.may_share_memory(arrays[i], arrays[j]):
                return None
    for k in range(n):
        np.copyto(arrays[n + k], arrays[k], casting="no")  # type: ignore[arg-type]
    return [Tensor.from_numpy(d) for d in arrays[n:]]  # type: ignore[arg-type]


def _describe(transfer: DataTransfer) -> str:
    return f"{type(transfer).__name__}.copy_tensors"


def _run_groups(plan: CopyPlan) -> tuple[DataTransfer, BaseException] | None:
    """Run an un-streamed plan; on failure, the transfer that failed and its exception.

    The exception is handed on as the backend raised it: the future translates it,
    once, into the :class:`DeviceError` it raises (chained to it).
    """
    plan.pack()
    for transfer, pairs in plan.groups:
        try:
            transfer.copy_tensors(pairs, None)
        except BaseException as exc:
            return transfer, exc
    return None


def _run_plan(plan: CopyPlan, signal: HostNotification) -> None:
    failure = _run_groups(plan)
    # The executor's work item holds `plan` until after this returns, and the signal may wake
    # the awaiter first: drop the batch's tensors now (the future holds what it needs).
    plan.src.clear()
    plan.dst.clear()
    plan.groups.clear()
    plan.packs.clear()
    signal.set(None if failure is None else failure[1])


class _Completed(NotificationImpl):
    """The notification of a copy that finished before its future was made (inline or empty)."""

    __slots__ = ("_error",)

    def __init__(self, error: BaseException | None) -> None:
        self._error = error

    def activate(self) -> None:
        pass

    def wait_on_device(self, stream: StreamImpl) -> None:
        pass  # already complete: nothing to order after

    def query(self) -> bool:
        return True

    def error(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[[], None]) -> bool:
        fn()
        return True

    def wait_on_host(self, timeout: float | None) -> bool:
        return True


def _quietly(fn: Any, what: str) -> None:
    try:
        fn()
    except Exception as exc:
        warnings.warn(
            f"closing {what} failed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3
        )


def _backend_entry_points() -> Iterator[importlib.metadata.EntryPoint]:
    return iter(importlib.metadata.entry_points(group=BACKEND_GROUP))


def _resolve_factory(name: str, target: Any, options: Mapping[str, Any] | None) -> EpFactory:
    if isinstance(target, EpFactory):
        if options:
            raise InvalidArgument(
                f"register_library({name!r}): options only apply when the target is a class or path"
            )
        return target
    if isinstance(target, type) and issubclass(target, EpFactory):
        try:
            factory_cls: Any = target
            made: EpFactory = factory_cls(options) if options is not None else factory_cls()
            return made
        except EpError:
            raise
        except Exception as exc:
            raise EpError(
                f"Failed to register EP library under {name!r} with error: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    if isinstance(target, os.PathLike) or (
        isinstance(target, str)
        and (os.sep in target or Path(target).suffix in (".so", ".dll", ".dylib"))
    ):
        return _factory_for_path(name, Path(os.fspath(target)), options)
    if isinstance(target, str) and ":" in target:
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = exc.name or module_name
            detail = "" if missing == module_name else f" (it needs {missing!r}, which is missing)"
            raise NoSuchFile(
                f"register_library({name!r}): cannot import module {module_name!r} "
                f"of target {target!r}{detail}: {exc}"
            ) from exc
        except Exception as exc:
            raise EpError(
                f"Failed to register EP library under {name!r} with error: importing "
                f"{module_name!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        obj: Any = module
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise InvalidArgument(
                    f"register_library({name!r}): {module_name!r} has no attribute {attr!r}"
                )
            obj = getattr(obj, part)
        return _resolve_factory(name, obj, options)
    raise InvalidArgument(
        f"register_library({name!r}): target must be an EpFactory instance or class, a "
        f"'module:attr' string or a plugin library path, got {target!r}"
    )


def _factory_for_path(name: str, path: Path, options: Mapping[str, Any] | None) -> EpFactory:
    if not path.is_file():
        raise NoSuchFile(f"register_library({name!r}): plugin library {str(path)!r} does not exist")
    eps = [e for e in _backend_entry_points() if e.name == PATH_BACKEND]
    if not eps:
        raise NotImplementedByEp(
            f"register_library({name!r}): loading the plugin library {str(path)!r} needs the "
            "'ort' backend; install it with: pip install aioep-ort"
        )
    factory_cls = eps[0].load()
    opts = {**dict(options or {}), "library_path": str(path), "registration_name": name}
    return _resolve_factory(name, factory_cls, opts)
