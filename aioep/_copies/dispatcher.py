"""The copy dispatcher: ``copy_tensors`` end to end (validate, plan, run inline, on a
stream or on the copy executor, return the future) and the copies in flight."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from .._base.errors import InvalidArgument, translate_backend_error
from .._devices.host import HOST_EP_NAME, lower_thread_priority
from .._interop.foreign import import_copy_args, importers_of
from .._interop.importer import MemoryImporter
from .._memory.transfer import CopyPlan, DataTransfer, TensorLike, plan_copies
from .._streams.notification import Notification, wait_blocking
from .._streams.routes import RouteCache
from .._streams.stream import SyncStream
from .._streams.stream_impl import HostNotification, NotificationImpl, StreamImpl, ThreadStream
from .._tensors.ownership import Scope
from .._tensors.tensor import Tensor
from .future import CopyFuture

if TYPE_CHECKING:
    from .._environment.registry import Library

__all__ = ["CopyDispatcher"]

_FAST_PATH_MAX_PAIRS = 4


class CopyDispatcher:
    """Runs an environment's ``copy_tensors`` calls and tracks the batches in flight.

    ``transfers`` and ``libraries`` are the registry's own (library name, transfer)
    list and name -> library map, which it changes in place: the dispatcher reads
    them on every call.
    """

    __slots__ = (
        "_executor",
        "_inflight",
        "_libraries",
        "_lock",
        "_routes",
        "_scope",
        "_transfers",
    )

    def __init__(
        self,
        transfers: list[tuple[str, DataTransfer]],
        libraries: Mapping[str, Library],
        scope: Scope | None = None,
    ) -> None:
        self._scope = scope  # the environment's: device tensors of others are refused
        self._transfers = transfers
        self._libraries = libraries
        self._lock = threading.Lock()
        self._inflight: dict[CopyFuture, frozenset[str]] = {}
        self._routes = RouteCache()  # un-streamed copies; each SyncStream has its own
        self._executor: ThreadPoolExecutor | None = None

    def copy(
        self,
        src: Sequence[TensorLike],
        dst: Sequence[TensorLike],
        stream: SyncStream | None,
        allow_reshape: bool,
    ) -> CopyFuture:
        """Validate the batch, enqueue or run it, and return its future (see
        `Environment.copy_tensors`)."""
        if allow_reshape is not False and allow_reshape is not True:
            raise InvalidArgument(
                f"copy_tensors: allow_reshape must be a bool, got {allow_reshape!r}"
            )
        if stream is None and not allow_reshape:
            done = _copy_small_arrays(src, dst, self._transfers)
            if done is not None:
                return CopyFuture.completed(done, Notification(_Completed(None)))
        # Foreign tensors (DLPack, CUDA Array Interface) become tensors here.
        src, dst, waits = import_copy_args(src, dst, self._importers, stream)
        # The registry changes its list in place, maybe from another thread: route over a
        # snapshot (which RouteCache.table compares with its own at no extra cost).
        transfers = tuple(self._transfers)
        if stream is None:
            # Strided sources are packed where the copy runs, off the loop.
            plan = plan_copies(
                src,
                dst,
                transfers,
                allow_reshape=allow_reshape,
                routes=self._routes,
                defer_packing=True,
                scope=self._scope,
            )
            return self._copy_unstreamed(plan, waits)
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
            transfers,
            stream_impl=impl,
            stream_library=stream_lib,
            allow_reshape=allow_reshape,
            routes=stream._routes,
            defer_packing=in_order_worker,
            scope=self._scope,
        )
        if not plan.groups:
            return CopyFuture.completed(plan.dst, Notification(_Completed(None)))
        for wait in waits:  # foreign producers' work (their CUDA Array Interface stream)
            stream.wait(Notification(wait))
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
        mark = stream.record()
        _note_use(plan, mark)
        future = CopyFuture(plan.src + plan.dst, plan.dst, mark, stream)
        if not future.done():
            self._track(future, frozenset(plan.libraries | {stream_lib}))
        return future

    def _stream_library(self, stream: SyncStream) -> str:
        for lib in self._libraries.values():
            if stream in lib.streams:
                return lib.name
        raise InvalidArgument(f"{stream!r} does not belong to this environment")

    def _importers(self) -> list[MemoryImporter]:
        """The registered libraries' memory importers (for foreign tensors)."""
        return importers_of(lib.factory for lib in list(self._libraries.values()))

    def _copy_unstreamed(self, plan: CopyPlan, waits: list[NotificationImpl]) -> CopyFuture:
        if not plan.groups:
            return CopyFuture.completed(plan.dst, Notification(_Completed(None)))
        if waits:
            waits = [w for w in waits if not w.query()]
        if waits:
            # A producer's stream still has work before the data is ready: wait for it on a
            # copy thread, never on the loop.
            signal = HostNotification()
            what = " / ".join(_describe(t) for t, _ in plan.groups)
            mark = Notification(signal)
            _note_use(plan, mark)
            future = CopyFuture(plan.src + plan.dst, plan.dst, mark, what)
            self._get_executor().submit(_run_plan_after, waits, plan, signal)
            self._track(future, frozenset(plan.libraries))
            return future
        if plan.inline:
            # Small host-side batches: a few memcpys cost less than any hand-off to a thread.
            failure = _run_groups(plan)
            what = "copy_tensors" if failure is None else _describe(failure[0])
            error = None if failure is None else failure[1]
            return CopyFuture.completed(plan.dst, Notification(_Completed(error)), what)
        if len(plan.groups) == 1 and not plan.packs:
            # The backend may enqueue the batch on a stream of its own (no worker-thread hop,
            # no thread blocked until the device is done).
            transfer, pairs = plan.groups[0]
            try:
                started = transfer.enqueue_unstreamed(pairs)
            except Exception as exc:
                error = translate_backend_error(exc, f"enqueueing copies ({_describe(transfer)})")
                if error is exc:
                    raise
                raise error from exc
            if started is not None:
                future = CopyFuture(
                    plan.src + plan.dst, plan.dst, Notification(started), _describe(transfer)
                )
                if not future.done():
                    self._track(future, frozenset(plan.libraries))
                return future
        signal = HostNotification()
        what = " / ".join(_describe(t) for t, _ in plan.groups)
        mark = Notification(signal)
        _note_use(plan, mark)
        future = CopyFuture(plan.src + plan.dst, plan.dst, mark, what)
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

    async def drain(self) -> None:
        """Wait for the batches in flight (their failures are their awaiters' business)."""
        for future in list(self._inflight):
            try:
                await future
            except Exception:
                pass

    def drain_blocking(self) -> None:
        """Blocking form of `drain`, for synchronous callers."""
        for future in list(self._inflight):
            try:
                wait_blocking(future.notification)  # blocking on purpose: no loop warning
                future.done()
            except Exception:
                pass

    def count_in_flight(self, library: str) -> int:
        """How many batches in flight use a transfer or stream of ``library``."""
        return sum(
            1 for f, libs in list(self._inflight.items()) if library in libs and not f.done()
        )

    def shutdown(self) -> None:
        """Wait for the executor's copies and stop its threads (a later copy starts anew)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


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
    once, into the `DeviceError` it raises (chained to it).
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


def _note_use(plan: CopyPlan, done: Notification) -> None:
    """Mark the batch's buffers as used until ``done``: a DLPack export of one of them
    orders its consumer after the copy (``Buffer.pending_work``)."""
    for t in plan.src:
        t.buffer._last_use = done
    for t in plan.dst:
        t.buffer._last_use = done


def _run_plan_after(
    waits: list[NotificationImpl], plan: CopyPlan, signal: HostNotification
) -> None:
    for wait in waits:
        wait.wait_on_host(None)
        error = wait.error()
        if error is not None:
            signal.set(error)
            return
    _run_plan(plan, signal)


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
