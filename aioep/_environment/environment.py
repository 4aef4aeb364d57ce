"""The environment: plugin libraries, their devices, shared allocators, data transfers,
streams and copies (ORT's ``OrtEnv``).

`Environment` is a facade over three parts with one job each: the library
registry (``registry``), the shared allocators (``shared_allocators``) and the copy
dispatcher (``aioep._copies.dispatcher``). It owns the lifecycle and the context's
current environment.
"""

from __future__ import annotations

import contextvars
import enum
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy.typing as npt
from anyio.abc import AsyncResource

from .._base.budget import DEFAULT_INLINE_BUDGET_US, InlineBudget
from .._base.errors import ClosedError, EpError
from .._base.types import (
    HOST_EP_NAME,
    AllocatorType,
    DeviceType,
    HardwareDevice,
    MemoryDevice,
    MemoryInfo,
    MemoryType,
)
from .._base.validate import check_options, check_type
from .._copies.dispatcher import CopyDispatcher
from .._copies.future import CopyFuture
from .._plugin.allocator import Allocator, allocator_origin
from .._plugin.device import EpDevice
from .._plugin.ownership import Scope
from .._plugin.stream import SyncStream
from .._plugin.tensor import Tensor
from .._plugin.transfer import TensorLike
from .._session.create import create_session
from .._session.initializers import ExternalDataLoader, load_initializers
from .._session.session import Session
from .host import HostFactory
from .registry import BACKEND_GROUP, LibraryRegistry
from .report import CloseReport
from .services import EnvironmentServices
from .settings import Settings
from .shared_allocators import SharedAllocators
from .stream_pool import DEFAULT_STREAM_POOL_SIZE

if TYPE_CHECKING:
    from onnx import ModelProto

__all__ = ["BACKEND_GROUP", "Environment", "copy_tensors", "current_environment"]

_current: contextvars.ContextVar[Environment | None] = contextvars.ContextVar(
    "aioep_current_environment", default=None
)
# The environments open in this process, for code that runs outside the context that
# entered one (request handlers of a server whose lifespan opened it).
_open: weakref.WeakSet[Environment] = weakref.WeakSet()
_open_lock = threading.Lock()


class _State(enum.Enum):
    UNOPENED = "unopened"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


def current_environment() -> Environment:
    """The environment this code runs in.

    The one entered by the nearest enclosing ``async with Environment()`` in this
    context; where there is none (a request task of a server whose lifespan holds
    the environment: such tasks do not inherit the context), the one environment
    open in the process.

    Raises:
        EpError: no environment is open, or several are and none was entered in this
            context (the message says which).
    """
    env = _current.get()
    if env is not None and env._state is _State.OPEN:
        return env
    with _open_lock:
        candidates = [e for e in _open if e._state is _State.OPEN]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise EpError(
            "no aioep Environment is open; wrap the code in "
            "'async with aioep.Environment() as env:' (or open one in the app's lifespan)"
        )
    raise EpError(
        f"{len(candidates)} aioep Environments are open and none was entered in this context, "
        "so which one to use is ambiguous; call env.copy_tensors(...) on the one you mean"
    )


def _environment_for(src: Sequence[Any], dst: Sequence[Any]) -> Environment:
    """The environment of a module-level ``copy_tensors``: the owner of the first tensor
    in device memory an environment allocated; else `current_environment`."""
    for seq in (src, dst):
        if type(seq) not in (list, tuple):
            continue
        for t in seq:
            if type(t) is not Tensor:
                continue
            allocator = t.buffer.allocator
            origin = None if allocator is None else allocator_origin(allocator)
            if origin is None or t.buffer.memory_info.device.is_host_accessible:
                continue
            env = origin.scope.env
            if isinstance(env, Environment):
                if env._state is not _State.OPEN:
                    raise ClosedError(
                        f"copy_tensors: {t!r} is device memory of {origin}, which is closed"
                    )
                return env
    return current_environment()


def _leave(env: Environment) -> None:
    """Undo ``env``'s ``_current.set``, if it made one and it is still to be undone."""
    token, env._token = env._token, None
    if token is not None:
        try:
            _current.reset(token)
        except ValueError:  # closed from another context: leave that context alone
            if _current.get() is env:
                _current.set(None)


def copy_tensors(
    src: Sequence[TensorLike],
    dst: Sequence[TensorLike],
    stream: SyncStream | None = None,
    *,
    allow_reshape: bool = False,
) -> CopyFuture:
    """Copy each ``src[i]`` into ``dst[i]`` in the environment that owns the tensors; see
    [`Environment.copy_tensors`][aioep.Environment.copy_tensors].

    The environment is the one whose allocator made the first device tensor of the
    batch (or, with ``stream``, the stream's); where every tensor is host memory or
    imported, [`current_environment`][aioep.current_environment].
    """
    if stream is not None and isinstance(stream, SyncStream):
        dev_env = stream.ep_device.environment
        if isinstance(dev_env, Environment) and dev_env._state is _State.OPEN:
            return dev_env._copies.copy(src, dst, stream, allow_reshape)
    # _environment_for checked that it is open: straight to its dispatcher.
    return _environment_for(src, dst)._copies.copy(src, dst, stream, allow_reshape)


class Environment(AsyncResource):
    """Holds plugin libraries and everything they offer; the root object of aioep.

    ``async with Environment() as env`` registers the built-in host device and
    every installed backend (entry-point group ``aioep.backends``), makes the
    environment current for this context, and on exit waits for copies in
    flight, then closes streams (pooled ones first), data transfers and loaders,
    allocators and factories, in that order.

    Args:
        autoload: register installed backends on entry.
        backends: only these backend names (default: all installed).
        backend_options: per-backend factory options, e.g. ``{"sim": {"latency_us": 50}}``.
        stream_pool_size: the most streams per EP device that `pooled_stream` lends
            (1 to 1024; default 4).
        inline_budget_us: the most event-loop time, in microseconds, one piece of host
            work may take to run inline instead of hopping to a thread (a small copy, a
            CPU-only session run); measured per kind of work, see `inline_budget`. 0 runs nothing
            inline; default 20 (``aioep.abc.DEFAULT_INLINE_BUDGET_US``).
    """

    def __init__(
        self,
        *,
        autoload: bool = True,
        backends: Sequence[str] | None = None,
        backend_options: Mapping[str, Mapping[str, Any]] | None = None,
        stream_pool_size: int = DEFAULT_STREAM_POOL_SIZE,
        inline_budget_us: float = DEFAULT_INLINE_BUDGET_US,
    ) -> None:
        self._settings = Settings.checked(
            autoload, backends, backend_options, stream_pool_size, inline_budget_us
        )
        self._state = _State.UNOPENED
        self._close_report: CloseReport | None = None
        self._lock = threading.RLock()
        self._token: contextvars.Token[Environment | None] | None = None
        self.load_errors: dict[str, str] = {}
        """Backend name -> why it could not start or offers no device."""
        self._scope = Scope(self)
        self._allocators = SharedAllocators(self._lock, self._scope)
        self._registry = LibraryRegistry(self, self._allocators, self.load_errors, self._lock)
        self._copies = CopyDispatcher(self._registry, self._scope, self._settings.budget)
        # What sessions and load_initializers use of this environment (their SessionHost).
        self._services = EnvironmentServices(
            self, self._registry, self._allocators, self._copies, self._scope
        )
        # The registry's state, for tests.
        self._libraries = self._registry.libraries
        self._transfers = self._registry.transfers
        self._open_streams = self._registry.streams.open_streams

    @property
    def inline_budget(self) -> InlineBudget:
        """Decides which small host work (host memcpys, CPU-only session runs) runs inline on
        the event loop, while its measured cost stays within ``inline_budget_us``."""
        return self._copies.budget

    @property
    def state(self) -> str:
        """``"unopened"``, ``"open"``, ``"closing"`` or ``"closed"``."""
        return self._state.value

    def _check_open(self) -> None:
        if self._state is not _State.OPEN:
            raise ClosedError(f"{self!r} is not open")

    def _check_unopened(self) -> None:
        if self._state is not _State.UNOPENED:
            raise ClosedError(f"{self!r} was already opened; create a new Environment")

    def open(self) -> Environment:
        """Register the host device and installed backends and make this environment current.

        The synchronous form of ``async with``; pair it with [`close`][aioep.Environment.close].
        """
        self._start()
        self._token = _current.set(self)
        return self

    def _start(self) -> None:
        self._check_unopened()
        self._state = _State.OPEN
        self._services.is_open = True
        with _open_lock:
            _open.add(self)
        try:
            settings = self._settings
            self.register_library(HOST_EP_NAME, HostFactory(settings.backend_options.get("host")))
            if settings.autoload or settings.backends:
                self._registry.load_backends(settings.backends, settings.backend_options)
        except BaseException:
            self._release_everything()
            _leave(self)
            raise

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

        Shielded from cancellation. What was still alive (open streams and sessions,
        which it closes, and live buffers, which stay valid until dropped) is no error and
        no warning: it is recorded in [`close_report`][aioep.Environment.close_report].
        """
        if not self._begin_closing():
            return
        with anyio.CancelScope(shield=True):
            sessions = await self._registry.close_sessions()
            await self._copies.drain()
            await self._registry.streams.synchronize_streams()
            # Closing streams, transfers, allocators and factories may join threads or sync
            # a device: do it off the event loop. The context variable is reset here, on it.
            await anyio.to_thread.run_sync(self._release_everything, sessions)
            _leave(self)

    def close(self) -> None:
        """Blocking form of [`aclose`][aioep.Environment.aclose], for synchronous scripts."""
        if self._begin_closing():
            self._copies.drain_blocking()
            self._release_everything()
            _leave(self)

    def _begin_closing(self) -> bool:
        if self._state in (_State.CLOSED, _State.CLOSING, _State.UNOPENED):
            self._state = _State.CLOSED if self._state is _State.UNOPENED else self._state
            return False
        self._state = _State.CLOSING
        self._services.is_open = False
        return True

    def _release_everything(self, sessions: Sequence[str] = ()) -> None:
        # Copies are awaited by now: streams, then the copy executor, then the libraries.
        self._state = _State.CLOSING
        self._services.is_open = False
        self._scope.closed = True
        with _open_lock:
            _open.discard(self)
        # (the blocking close() leaves sessions open: they close asynchronously)
        sessions = (*sessions, *map(repr, self._registry.open_sessions()))
        streams = self._registry.streams.close_streams()
        self._copies.shutdown()
        buffers = self._registry.close_all()
        self._close_report = CloseReport(tuple(streams), sessions, tuple(buffers))
        self._state = _State.CLOSED

    @property
    def close_report(self) -> CloseReport | None:
        """What was still alive when this environment closed; None until it has closed.

        Open streams and sessions (the environment closed them) and, per allocator, the
        buffers still alive (they stay valid until dropped). None of it is a warning:
        leaving a tensor named by a local past ``async with`` is ordinary code. The
        pytest plugin's leak check reads this report.
        """
        return self._close_report

    @property
    def libraries(self) -> tuple[str, ...]:
        """Registered library names, in registration order."""
        return tuple(self._registry.libraries)

    def register_library(
        self, name: str, target: Any, options: Mapping[str, Any] | None = None
    ) -> list[EpDevice]:
        """Register a plugin library and return the EP devices it offers.

        ``target`` is an [`EpFactory`][aioep.abc.EpFactory] instance or class (a class is
        constructed with ``options``), a ``"module:attr"`` string naming either,
        or the path of an ONNX Runtime plugin EP shared library (handled by the
        ``ort`` backend). Adds the library's EP devices, one default shared
        allocator per memory info (never replacing an existing one), its data
        transfer and its external-data loader. A bad target raises at once and
        leaves the environment unchanged.
        """
        self._check_open()
        return self._registry.register(name, target, options)

    def unregister_library(self, name: str) -> None:
        """Remove a library: its pooled streams, its data transfer and loader, its devices
        and shared allocators, then close its factory.

        Pooled streams (`pooled_stream`) that no one holds and that are idle are the
        environment's own: they close here and never count as in use.

        Raises:
            InvalidArgument: no library is registered under ``name``.
            InUseError: its streams (a pooled one lent or busy), buffers or copies are still
                alive (nothing is removed).
        """
        self._check_open()
        check_type("unregister_library", "name", name, str, "a library name (str)")
        self._registry.unregister(name, self._copies.count_in_flight)

    @property
    def hardware_devices(self) -> list[HardwareDevice]:
        """Hardware known to the environment: the host CPU and every registered device's."""
        return list(self._registry.hardware)

    def ep_devices(
        self, device_type: DeviceType | None = None, ep_name: str | None = None
    ) -> list[EpDevice]:
        """EP devices in registration order, optionally filtered by type and EP name."""
        if device_type is not None:
            check_type("ep_devices", "device_type", device_type, DeviceType, "a DeviceType or None")
        if ep_name is not None:
            check_type("ep_devices", "ep_name", ep_name, str, "a str or None")
        return self._registry.ep_devices(device_type, ep_name)

    @property
    def shared_allocators(self) -> dict[MemoryDevice, Allocator]:
        """Memory device -> shared allocator (the host fallback not included)."""
        return self._allocators.as_dict()

    def get_shared_allocator(self, memory_info: MemoryInfo | MemoryDevice) -> Allocator | None:
        """The shared allocator for that memory (the name is ignored), or None.

        CPU memory with no allocator of its own falls back to the host allocator.
        """
        self._check_open()
        return self._allocators.get(memory_info)

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
        opts = check_options("create_shared_allocator", "options", options)
        with self._lock:
            lib = self._registry.library_of(ep_device)
            return self._allocators.create(lib, ep_device, memory_type, allocator_type, opts)

    def release_shared_allocator(
        self, ep_device: EpDevice, memory_type: MemoryType = MemoryType.DEFAULT
    ) -> None:
        """Remove the shared allocator for a device's memory (its live buffers stay valid)."""
        self._check_open()
        with self._lock:
            self._registry.library_of(ep_device)
            self._allocators.release(ep_device, memory_type)

    def register_allocator(self, allocator: Allocator) -> None:
        """Share a user's own allocator for its memory device.

        Raises:
            InvalidArgument: an allocator is already shared for that memory device.
        """
        self._check_open()
        self._allocators.register(allocator)

    def unregister_allocator(self, memory_info: MemoryInfo | MemoryDevice) -> None:
        """Stop sharing the user allocator for that memory (it is not closed: it is yours)."""
        self._check_open()
        self._allocators.unregister(memory_info)

    def empty(
        self,
        shape: Sequence[int] | int,
        dtype: npt.DTypeLike,
        memory_info: MemoryInfo | None = None,
        *,
        stream: SyncStream | None = None,
    ) -> Tensor:
        """An uninitialised tensor from the shared allocator of ``memory_info`` (default: host)."""
        if self._state is not _State.OPEN:
            self._check_open()
        return self._allocators.empty(shape, dtype, memory_info, stream)

    def create_sync_stream(
        self, ep_device: EpDevice, options: Mapping[str, Any] | None = None
    ) -> SyncStream:
        """A new stream on ``ep_device`` (an async context manager; awaitable).

        Raises:
            NotImplementedByEp: the device's factory does not support streams.
        """
        self._check_open()
        opts = check_options("create_sync_stream", "options", options)
        return self._registry.streams.create_stream(ep_device, opts or None)

    @property
    def stream_pool_size(self) -> int:
        """The most streams per EP device that `pooled_stream` lends."""
        return self._settings.stream_pool_size

    def pooled_stream(self, ep_device: EpDevice) -> AbstractAsyncContextManager[SyncStream]:
        """Borrow one of a bounded set of streams on ``ep_device``, shared with other borrowers.

        ``async with env.pooled_stream(dev) as stream:`` lends a stream of the device's
        pool: up to ``stream_pool_size`` streams, made on first use (in a worker thread: a
        driver may wait in its stream creation) and lent round-robin (one no one holds
        first), so a server's threads and device streams stay bounded however many
        requests it serves at once. Leaving the block gives the stream back without
        waiting for the work on it; await your own futures.

        Inside the block use it as any stream (``copy_tensors(..., stream)``,
        ``session.run(..., stream=stream)``, ``record()``, ``wait(notification)``). Its
        work runs in order with other borrowers' work, but a device error reaches only the
        work that failed (its future, and the next mark this borrower records), never
        another borrower's; a sticky error (a lost device) still reaches everyone.
        ``await stream`` waits for all work on the stream, other borrowers' too: await
        your futures instead. ``aclose()`` is refused (`InUseError`): the
        environment closes pooled streams when the library is unregistered or the
        environment closes, after their work.

        Raises:
            InvalidArgument: ``ep_device`` is not an EP device of this environment.
            NotImplementedByEp: (on entering) the device's factory has no streams.
        """
        self._check_open()
        check_type("pooled_stream", "ep_device", ep_device, EpDevice, "an aioep.EpDevice")
        self._registry.library_of(ep_device)
        return self._registry.streams.lease(
            ep_device, self._settings.stream_pool_size, self._check_open
        )

    def copy_tensors(
        self,
        src: Sequence[TensorLike],
        dst: Sequence[TensorLike],
        stream: SyncStream | None = None,
        *,
        allow_reshape: bool = False,
    ) -> CopyFuture:
        """Copy each ``src[i]`` into ``dst[i]`` and return a [`CopyFuture`][aioep.CopyFuture].

        Everything is validated before anything is enqueued: equal counts, equal
        dtype, size and shape per pair (``allow_reshape=True`` permits a byte copy
        between shapes), writable destinations that overlap nothing, and a data
        transfer for each device pair. With ``stream`` the copies are enqueued on
        it in order; without one they run off the event loop (tiny batches inline).

        Sources and destinations may also be other libraries' tensors (anything with
        ``__dlpack__`` or ``__cuda_array_interface__``): taken zero-copy on the device
        that owns their memory, kept alive until the copy is done, with the producer's
        stream ordered before the copy.
        """
        self._check_open()
        return self._copies.copy(src, dst, stream, allow_reshape)

    def can_copy(self, src: MemoryInfo | MemoryDevice, dst: MemoryInfo | MemoryDevice) -> bool:
        """Whether a registered data transfer copies from ``src`` to ``dst`` memory (what
        `copy_tensors` needs for a pair of tensors in those memories)."""
        devices = [m.device if isinstance(m, MemoryInfo) else m for m in (src, dst)]
        for name, value in zip(("src", "dst"), devices):
            check_type("can_copy", name, value, MemoryDevice, "a MemoryInfo or MemoryDevice")
        return self._copies.can_copy(devices[0], devices[1])

    def external_data_loader(self, memory_info: MemoryInfo) -> ExternalDataLoader | None:
        """The first registered loader that can fill tensors in ``memory_info``, or None."""
        check_type("external_data_loader", "memory_info", memory_info, MemoryInfo, "a MemoryInfo")
        return self._registry.external_data_loader(memory_info)

    async def load_initializers(
        self,
        model: str | os.PathLike[str],
        ep_device: EpDevice,
        names: Sequence[str] | None = None,
        **options: Any,
    ) -> dict[str, Tensor]:
        """Load a model's initializers onto ``ep_device`` (external data straight to the device).

        See [`load_initializers`][aioep._session.initializers.load_initializers] (the External
        data reference) for ``options``.
        """
        self._check_open()
        return await load_initializers(self._services, model, ep_device, names, **options)

    async def create_session(
        self,
        model: str | os.PathLike[str] | bytes | ModelProto,
        ep_devices: Sequence[EpDevice] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> Session:
        """Partition ``model`` (a path, the model's ``bytes`` or an ``onnx.ModelProto``) across
        the EPs of ``ep_devices`` and return an awaitable session."""
        self._check_open()
        return await create_session(self._services, model, ep_devices, options)

    def __repr__(self) -> str:
        return f"<Environment {self._state.value} libraries={list(self._registry.libraries)}>"
