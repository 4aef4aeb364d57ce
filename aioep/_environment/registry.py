"""The library registry: an environment's plugin libraries (factories and what each
offers), loading them from entry points or paths, in-use checks and teardown order."""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._base.errors import (
    EpError,
    ErrorCode,
    InUseError,
    InvalidArgument,
    NoSuchFile,
    NotImplementedByEp,
    translate_backend_error,
)
from .._base.types import (
    HOST_EP_NAME,
    DeviceType,
    HardwareDevice,
    MemoryDevice,
    MemoryInfo,
    MemoryType,
)
from .._plugin.allocator import Allocator
from .._plugin.device import EpDevice, bind_device
from .._plugin.factory import EpFactory
from .._plugin.stream import SyncStream
from .._plugin.stream_impl import StreamImpl
from .._plugin.thread_stream import HostNotification
from .._plugin.transfer import DataTransfer
from .._session.initializers import ExternalDataLoader
from .host import host_hardware_device
from .report import LiveBuffers
from .stream_pool import PooledStream, Reservation, StreamRing

if TYPE_CHECKING:
    from .environment import Environment
    from .shared_allocators import SharedAllocators

__all__ = ["BACKEND_GROUP", "Library", "LibraryRegistry"]

BACKEND_GROUP = "aioep.backends"
PATH_BACKEND = "ort"  # the backend that loads ONNX Runtime plugin EP libraries given by path

_HARDWARE_ORDER = {DeviceType.NPU: 0, DeviceType.GPU: 1, DeviceType.FPGA: 2, DeviceType.CPU: 3}


@dataclass(eq=False)
class Library:
    """One registered plugin library: its factory and everything made from it."""

    name: str
    factory: EpFactory
    ep_devices: list[EpDevice] = field(default_factory=list)
    allocators: list[Allocator] = field(default_factory=list)  # every allocator made from it
    transfer: DataTransfer | None = None
    loader: ExternalDataLoader | None = None
    streams: set[SyncStream] = field(default_factory=set)
    pools: dict[EpDevice, StreamRing] = field(default_factory=dict)  # env.pooled_stream's
    sessions: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)  # open sessions
    retired: list[Allocator] = field(default_factory=list)  # retired, still serving live buffers


class LibraryRegistry:
    """An environment's libraries in registration order, their hardware, data transfers
    and external-data loaders.

    ``transfers`` and ``libraries`` are changed in place only: the copy dispatcher
    holds them and reads them on every call.
    """

    def __init__(
        self,
        owner: Environment,
        shared: SharedAllocators,
        load_errors: dict[str, str],
        lock: threading.RLock,
    ) -> None:
        self._owner = owner  # bound to each EP device, for ep_device.create_sync_stream()
        self._shared = shared
        self._lock = lock
        self.load_errors = load_errors
        self.libraries: dict[str, Library] = {}
        self.hardware: list[HardwareDevice] = [host_hardware_device()]
        self.transfers: list[tuple[str, DataTransfer]] = []
        self.loaders: list[tuple[str, ExternalDataLoader]] = []

    # -- registration ----------------------------------------------------------------------
    def load_backends(
        self, wanted: Sequence[str] | None, backend_options: Mapping[str, Mapping[str, Any]]
    ) -> None:
        """Register the installed backends (only ``wanted`` ones when given); record and
        warn about those that cannot start or are not installed."""
        names = None if wanted is None else set(wanted)
        found: set[str] = set()
        for ep in sorted(_backend_entry_points(), key=lambda e: e.name):
            if names is not None and ep.name not in names:
                continue
            found.add(ep.name)
            try:
                target = ep.load()
                self.register(ep.name, target, backend_options.get(ep.name))
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
        for name in sorted((names or set()) - found):
            self.load_errors[name] = (
                f"no backend named {name!r} is installed (entry-point group {BACKEND_GROUP!r})"
            )
            warnings.warn(
                f"aioep backend {name!r} is not installed (entry-point group {BACKEND_GROUP!r})",
                RuntimeWarning,
                stacklevel=3,
            )

    def register(self, name: str, target: Any, options: Mapping[str, Any] | None) -> list[EpDevice]:
        """Register a library (see `Environment.register_library`); all or nothing."""
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"register_library: name must be a non-empty str, got {name!r}")
        with self._lock:
            if name in self.libraries:
                raise InvalidArgument(f"library is already registered under {name!r}")
            factory = _resolve_factory(name, target, options)
            lib = Library(name, factory)
            hardware_before = list(self.hardware)
            had_load_error = name in self.load_errors
            try:
                self._add(lib)
            except BaseException as exc:
                self._remove(lib)
                self.hardware[:] = hardware_before
                if not had_load_error:
                    self.load_errors.pop(name, None)
                if isinstance(exc, EpError):
                    raise
                raise EpError(
                    f"Failed to register EP library under {name!r} with error: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            return list(lib.ep_devices)

    def _add(self, lib: Library) -> None:
        factory = lib.factory
        hardware = sorted(self.hardware, key=lambda h: _HARDWARE_ORDER[h.type])
        devices = factory.get_supported_devices(hardware)
        for dev in devices:
            if not isinstance(dev, EpDevice) or dev.factory is not factory:
                raise InvalidArgument(
                    f"factory {factory.name!r}.get_supported_devices returned {dev!r}, which is not "
                    "an EpDevice of that factory"
                )
        if not devices and factory.unavailable_reason:
            self.load_errors[lib.name] = factory.unavailable_reason
        self.libraries[lib.name] = lib
        for dev in devices:
            bind_device(dev, self._owner)
            lib.ep_devices.append(dev)
            if dev.hardware not in self.hardware:
                self.hardware.append(dev.hardware)
            self._shared.add_defaults(lib, dev.memory_infos)
        try:
            transfer = factory.create_data_transfer()
        except Exception as exc:
            raise EpError(
                f"Error creating data transfer for {lib.name!r}: {type(exc).__name__}: {exc}",
                code=ErrorCode.EP_FAIL,
            ) from exc
        if transfer is not None and not isinstance(transfer, DataTransfer):
            raise InvalidArgument(
                f"factory {factory.name!r}.create_data_transfer returned {transfer!r}, not an "
                "aioep.abc.DataTransfer or None"
            )
        if transfer is not None:
            lib.transfer = transfer
            self.transfers.append((lib.name, transfer))
        loader = factory.create_external_data_loader()
        if loader is not None and not isinstance(loader, ExternalDataLoader):
            raise InvalidArgument(
                f"factory {factory.name!r}.create_external_data_loader returned {loader!r}, not "
                "an aioep.abc.ExternalDataLoader or None"
            )
        if loader is not None:
            lib.loader = loader
            self.loaders.append((lib.name, loader))

    def unregister(self, name: str, copies_in_flight: Callable[[str], int]) -> None:
        """Remove a library (see `Environment.unregister_library`).

        ``copies_in_flight(name)`` counts the library's copy batches still in flight.
        """
        with self._lock:
            lib = self.libraries.get(name)
            if lib is None:
                raise InvalidArgument(f"Execution provider library: {name!r} was not registered.")
            if name == HOST_EP_NAME:
                raise InvalidArgument("the built-in host library cannot be unregistered")
            in_use = self._in_use(lib, copies_in_flight(name))
            if in_use:
                raise InUseError(
                    f"cannot unregister library {name!r}: still in use by {', '.join(in_use)}; "
                    "close its sessions and streams, await its copies and drop its tensors first"
                )
            self._remove(lib)

    @staticmethod
    def _in_use(lib: Library, copies: int) -> list[str]:
        reasons = []
        # Spare pooled streams (lent to no one, idle) are the pool's to close: not in use.
        streams = [s for s in lib.streams if not s.closed and not isinstance(s, PooledStream)]
        if streams:
            reasons.append(f"{len(streams)} open stream(s) ({', '.join(map(repr, streams))})")
        pooled = [
            s for ring in lib.pools.values() for s in ring.streams if not (s.closed or s.spare)
        ]
        if pooled:
            reasons.append(
                f"{len(pooled)} pooled stream(s) lent or with work in flight "
                f"({', '.join(map(repr, pooled))})"
            )
        making = sum(len(ring.making) for ring in lib.pools.values())
        if making:
            reasons.append(f"{making} pooled stream(s) being made")
        live = [(a, a.live_buffers) for a in lib.allocators if a.live_buffers]
        if live:
            where = ", ".join(f"{n} from {a.memory_info.name!r}" for a, n in live)
            reasons.append(f"{sum(n for _, n in live)} live buffer(s) ({where})")
        sessions = list(lib.sessions)
        if sessions:
            reasons.append(f"{len(sessions)} open session(s) ({', '.join(map(repr, sessions))})")
        if copies:
            reasons.append(f"{copies} copy batch(es) in flight")
        return reasons

    def _remove(self, lib: Library) -> None:
        # ORT's order: data transfers, then devices and their shared allocators, then the factory.
        self.libraries.pop(lib.name, None)
        self._close_pools(lib, report=False)
        self._close_transfer_and_loader(lib)
        for dev in lib.ep_devices:
            bind_device(dev, None)
        self._shared.drop_library(lib.name)
        self._close_allocators(lib, report=False)
        self._close_factory(lib)

    # -- teardown --------------------------------------------------------------------------
    async def close_sessions(self) -> list[str]:
        """Close the sessions still open; returns their reprs (for the close report)."""
        found = []
        for session in self.open_sessions():
            found.append(repr(session))
            await session.aclose()
        return found

    async def synchronize_streams(self) -> None:
        """Wait for the work enqueued on every open stream (failures are ignored here)."""
        for stream in self.open_streams():
            try:
                await stream.synchronize()
            except Exception:
                pass

    def close_streams(self) -> list[str]:
        """Close the pooled streams, then the streams still open; returns the reprs of
        those still lent or open (for the close report)."""
        found = []
        for lib in self.libraries.values():
            found += self._close_pools(lib, report=True)
        for stream in self.open_streams():
            found.append(repr(stream))
            stream.close()
        return found

    def close_all(self) -> list[LiveBuffers]:
        """Close every library's data transfer and loader, then allocators, then factories.

        Returns the buffers still alive, per allocator (for the close report); those
        allocators close after their last buffer is freed.
        """
        libraries = list(reversed(self.libraries.values()))
        for lib in libraries:
            self._close_transfer_and_loader(lib)
        live: list[LiveBuffers] = []
        for lib in libraries:
            live += self._close_allocators(lib, report=True)
        self._shared.clear()
        for lib in libraries:
            self._close_factory(lib)
        self.libraries.clear()
        return live

    def _close_pools(self, lib: Library, *, report: bool) -> list[str]:
        # A stream still being made joins its ring when made: wait for it (never the case
        # when unregistering: a stream being made keeps the library in use).
        for ring in list(lib.pools.values()):
            for reservation in list(ring.making):
                reservation.made.wait_on_host(None)
        with self._lock:
            pooled = [s for ring in lib.pools.values() for s in ring.streams]
            lib.pools.clear()
        lent = []
        for stream in pooled:
            if report and stream.lent:
                lent.append(f"{stream!r} (still lent by env.pooled_stream())")
            _quietly(stream.retire, f"pooled stream {stream!r}")
        return lent

    def _close_transfer_and_loader(self, lib: Library) -> None:
        if lib.transfer is not None:
            self.transfers[:] = [t for t in self.transfers if t[1] is not lib.transfer]
            _quietly(lib.transfer.close, f"data transfer of {lib.name!r}")
            lib.transfer = None
        if lib.loader is not None:
            self.loaders[:] = [t for t in self.loaders if t[1] is not lib.loader]
            _quietly(lib.loader.close, f"external data loader of {lib.name!r}")
            lib.loader = None

    @staticmethod
    def _close_allocators(lib: Library, *, report: bool) -> list[LiveBuffers]:
        if report and any(a.live_buffers for a in lib.allocators):
            # Buffers held only by reference cycles are garbage, not alive: collect them
            # before reporting, so the report names only what the program still holds.
            gc.collect()
        live = []
        for allocator in lib.allocators:
            if report and allocator.live_buffers:
                live.append(
                    LiveBuffers(
                        library=lib.name,
                        memory=allocator.memory_info.name,
                        count=allocator.live_buffers,
                        nbytes=allocator.bytes_in_use,
                        allocator=repr(allocator),
                    )
                )
            _quietly(allocator.retire, f"allocator {allocator.memory_info.name!r}")
        lib.retired = [a for a in lib.allocators if not a.closed]
        lib.allocators.clear()
        return live

    @staticmethod
    def _close_factory(lib: Library) -> None:
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

    # -- lookups ---------------------------------------------------------------------------
    def ep_devices(self, device_type: DeviceType | None, ep_name: str | None) -> list[EpDevice]:
        """EP devices in registration order, optionally filtered by type and EP name."""
        return [
            d
            for lib in self.libraries.values()
            for d in lib.ep_devices
            if (device_type is None or d.hardware.type is device_type)
            and (ep_name is None or d.ep_name == ep_name)
        ]

    def library_of(self, ep_device: EpDevice) -> Library:
        """The library that offers ``ep_device``."""
        for lib in self.libraries.values():
            if any(d is ep_device for d in lib.ep_devices):
                return lib
        raise InvalidArgument(f"{ep_device!r} is not registered in this environment")

    def external_data_loader(self, memory_info: MemoryInfo) -> ExternalDataLoader | None:
        """The first registered loader that can fill tensors in ``memory_info``, or None."""
        for _, loader in self.loaders:
            if loader.can_load(memory_info):
                return loader
        return None

    def open_streams(self) -> list[SyncStream]:
        """Every stream still open, library by library."""
        return [s for lib in self.libraries.values() for s in list(lib.streams)]

    def open_sessions(self) -> set[Any]:
        """Every session still open on a device of a library."""
        return {s for lib in self.libraries.values() for s in lib.sessions}

    # -- streams and sessions --------------------------------------------------------------
    def create_stream(self, ep_device: EpDevice, options: Mapping[str, Any] | None) -> SyncStream:
        """A new stream on ``ep_device`` (see `Environment.create_sync_stream`)."""
        with self._lock:
            lib, factory, memory = self._stream_maker(ep_device)
            impl = _make_stream_impl(factory, memory, options)
            stream = SyncStream(impl, ep_device, on_close=lib.streams.discard)
            lib.streams.add(stream)
            return stream

    def _stream_maker(self, ep_device: EpDevice) -> tuple[Library, EpFactory, MemoryDevice]:
        # Under self._lock: the library, its factory and the memory a stream would run on.
        lib = self.library_of(ep_device)
        info = ep_device.memory_info(MemoryType.DEFAULT)
        if info is None:
            raise InvalidArgument(f"{ep_device!r} has no DEFAULT memory to run a stream on")
        if not lib.factory.is_stream_aware():
            raise NotImplementedByEp(
                f"The execution provider {lib.factory.name!r} does not support streams."
            )
        return lib, lib.factory, info.device

    # -- the stream pool (env.pooled_stream) -------------------------------------------------
    def lend_stream(
        self, ep_device: EpDevice, size: int
    ) -> PooledStream | Reservation | HostNotification:
        """A stream of ``ep_device``'s pool (at most ``size`` streams), counted as lent; or a
        `Reservation` the caller fills with `make_pooled_stream` (off the event
        loop); or, while the streams are all being made, a notification to await before
        asking again."""
        with self._lock:
            lib, _, _ = self._stream_maker(ep_device)
            ring = lib.pools.get(ep_device)
            if ring is None:
                ring = lib.pools[ep_device] = StreamRing()
            got = ring.pick(size)
            if isinstance(got, PooledStream):
                got.borrowed()
            return got

    def make_pooled_stream(self, ep_device: EpDevice, reservation: Reservation) -> None:
        """Make the stream ``reservation`` holds a place for and add it to the pool.

        Blocking (a driver may wait in its stream creation): call it off the event loop. The
        environment's lock is not held meanwhile; the reservation keeps the library in use.
        """
        stream: PooledStream | None = None
        try:
            with self._lock:
                lib, factory, memory = self._stream_maker(ep_device)
            impl = _make_stream_impl(factory, memory, None)
            with self._lock:
                stream = PooledStream(impl, ep_device, on_close=lib.streams.discard)
                lib.streams.add(stream)
        finally:
            with self._lock:
                reservation.fill(stream)

    def give_back(self, stream: PooledStream) -> None:
        """A borrower is done with ``stream`` (its work may still be in flight)."""
        with self._lock:
            stream.returned()

    def track_session(self, session: Any, ep_devices: Sequence[EpDevice], *, open: bool) -> None:
        """Count an open session against the libraries of its devices (unregister refuses)."""
        for dev in ep_devices:
            for lib in self.libraries.values():
                if any(d is dev for d in lib.ep_devices):
                    if open:
                        lib.sessions.add(session)
                    else:
                        lib.sessions.discard(session)


def _make_stream_impl(
    factory: EpFactory, memory: MemoryDevice, options: Mapping[str, Any] | None
) -> StreamImpl:
    """The factory's new stream for ``memory``, checked; backend errors translated."""
    try:
        impl = factory.create_sync_stream(memory, options)
    except Exception as exc:
        raise translate_backend_error(exc, f"{factory.name!r} create_sync_stream") from exc
    if impl is None:
        raise EpError(
            f"Failed to get a stream implementation from the EP factory {factory.name!r}."
        )
    if not isinstance(impl, StreamImpl):
        raise InvalidArgument(
            f"factory {factory.name!r}.create_sync_stream returned {impl!r}, not an "
            "aioep.abc.StreamImpl"
        )
    return impl


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
    if path.is_dir():
        raise NoSuchFile(
            f"register_library({name!r}): {str(path)!r} is a directory, not a plugin library file"
        )
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
