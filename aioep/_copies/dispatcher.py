"""The copy dispatcher: ``copy_tensors`` end to end (validate, plan, run inline, on a
stream, in a backend's own queue or on the copy workers, return the future) and the copies
in flight.

Every completion costs one hop: the thread that finishes a copy (a stream's worker, a
backend's dispatcher, a copy worker) completes the copy's notification, which wakes the
awaiting loop. Copies whose transfer can run them on the host (``can_copy_inline``) run on
the calling thread instead while the environment's `InlineBudget` allows it.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Hashable, Sequence
from time import perf_counter
from typing import Any, Protocol

import numpy as np

from .._base.budget import InlineBudget
from .._base.errors import InvalidArgument, translate_backend_error
from .._base.types import HOST_EP_NAME, HOST_MEMORY_DEVICE, MemoryDevice
from .._memory.foreign import import_copy_args
from .._plugin.copy_check import copy_pair, copy_pairs
from .._plugin.importer import MemoryImporter
from .._plugin.notification import Notification, notification_of, wait_blocking
from .._plugin.ownership import Scope, owned_by
from .._plugin.routes import RouteCache
from .._plugin.stream import SyncStream, check_open, note_enqueued
from .._plugin.stream_impl import NotificationImpl
from .._plugin.tensor import Tensor, wrap_array
from .._plugin.thread_stream import HostNotification, ThreadStream
from .._plugin.transfer import CopyPair, CopyPlan, DataTransfer, TensorLike, plan_copies
from .future import _PENDING, COMPLETED, Completed, CopyFuture, done_future
from .workers import CopyWorkers, lower_thread_priority

__all__ = ["CopyDispatcher", "CopyLibraries"]

_FAST_PATH_MAX_PAIRS = 4
_HOST_ROUTE: Hashable = "host->host"
"""The inline budget's kind for host-to-host copies (the key of every other copy is its
route, a pair of memory devices; a string hashes without a call into Python)."""


class CopyLibraries(Protocol):
    """What the dispatcher needs of the libraries it copies between (the environment's
    library registry provides it)."""

    @property
    def transfers(self) -> list[tuple[str, DataTransfer]]:
        """(library name, data transfer) in registration order; changed in place only, so
        the dispatcher holds the list and reads it on every call."""
        ...

    def stream_library(self, stream: SyncStream) -> str | None:
        """The name of the library whose device ``stream`` runs on, or None."""
        ...

    def importers(self) -> list[MemoryImporter]:
        """The registered libraries' memory importers (for foreign tensors)."""
        ...


class CopyDispatcher:
    """Runs an environment's ``copy_tensors`` calls and tracks the batches in flight.

    ``libraries`` gives the registered data transfers (the registry's own list, which it
    changes in place: the dispatcher reads it on every call), the library a stream belongs
    to and the memory importers. ``budget`` decides which copies run inline (see
    `InlineBudget`); the default budget if None.
    """

    __slots__ = (
        "_budget",
        "_inflight",
        "_libraries",
        "_lock",
        "_routes",
        "_scope",
        "_transfers",
        "_workers",
    )

    def __init__(
        self,
        libraries: CopyLibraries,
        scope: Scope | None = None,
        budget: InlineBudget | None = None,
    ) -> None:
        self._scope = scope  # the environment's: device tensors of others are refused
        self._transfers = libraries.transfers
        self._libraries = libraries
        self._budget = budget if budget is not None else InlineBudget()
        self._lock = threading.Lock()
        self._inflight: dict[CopyFuture, frozenset[str]] = {}
        self._routes = RouteCache()  # un-streamed copies; each SyncStream has its own
        self._workers: CopyWorkers | None = None

    @property
    def budget(self) -> InlineBudget:
        """The inline budget this dispatcher's copies are measured against."""
        return self._budget

    def copy(
        self,
        src: Sequence[TensorLike],
        dst: Sequence[TensorLike],
        stream: SyncStream | None,
        allow_reshape: bool,
    ) -> CopyFuture:
        """Validate the batch, enqueue or run it, and return its future (see
        `Environment.copy_tensors`)."""
        if allow_reshape is False:
            ts, td = type(src), type(dst)
            if (ts is list or ts is tuple) and (td is list or td is tuple):
                # The fast paths: a few tensors or arrays on a route already taken. Each
                # takes only what the general path below would accept, and leaves anything
                # else (to accept, or to refuse with the full message) to it.
                if stream is None:
                    done = _copy_small_arrays(src, dst, self._transfers, self._budget)
                    if done is not None:
                        return done_future(done)
                    future = self._fast_unstreamed(src, dst)
                else:
                    future = self._fast_streamed(src, dst, stream)
                if future is not None:
                    return future
        elif allow_reshape is not True:
            raise InvalidArgument(
                f"copy_tensors: allow_reshape must be a bool, got {allow_reshape!r}"
            )
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
        if type(stream) is not SyncStream and not isinstance(stream, SyncStream):
            raise InvalidArgument(f"copy_tensors: stream must be a SyncStream, got {stream!r}")
        check_open(stream)
        stream_lib = self._stream_library(stream)
        impl = stream.impl
        # A worker-thread stream packs strided sources itself, in order before the copies.
        # Other streams (CUDA) may read the sources as soon as a copy is enqueued.
        worker = impl if isinstance(impl, ThreadStream) else None
        plan = plan_copies(
            src,
            dst,
            transfers,
            stream_impl=impl,
            stream_library=stream_lib,
            allow_reshape=allow_reshape,
            routes=stream._routes,
            defer_packing=worker is not None,
            scope=self._scope,
        )
        if not plan.groups:
            return done_future(plan.dst)
        for wait in waits:  # foreign producers' work (their CUDA Array Interface stream)
            stream.wait(Notification(wait))
        if plan.packs:
            assert worker is not None  # only such streams defer packing
            worker.enqueue(plan.pack)
        # The worker is woken by the first copy queued: it wakes up while the rest of the
        # batch, its mark and its future are made here.
        for transfer, pairs in plan.groups:
            try:
                if worker is None or not transfer.can_copy_inline(pairs):
                    transfer.copy_tensors(pairs, impl)
                else:
                    self._copy_on_worker(worker, transfer, pairs)
            except Exception as exc:
                error = translate_backend_error(exc, f"enqueueing copies on {stream!r}")
                if error is exc:
                    raise
                raise error from exc
        note_enqueued(stream)
        mark = stream.record()
        future = CopyFuture(plan.src + plan.dst, plan.dst, mark, stream, on_done=self._forget)
        self._track(future, frozenset(plan.libraries | {stream_lib}))
        return future

    def _fast_streamed(
        self, src: Sequence[TensorLike], dst: Sequence[TensorLike], stream: SyncStream
    ) -> CopyFuture | None:
        """The fast path of a copy on a stream (see `copy`), or None to take the general
        path: tensors or C-contiguous arrays on routes this stream already took."""
        if len(src) > _FAST_PATH_MAX_PAIRS or (
            type(stream) is not SyncStream and not isinstance(stream, SyncStream)
        ):
            return None
        routes = stream._routes
        memo = routes.memo(self._transfers)  # emptied when the stream closes
        stream_lib = memo.get(self)  # set by _stream_library
        if stream_lib is None:
            return None
        batch = copy_pair(src[0], dst[0]) if len(src) == 1 == len(dst) else copy_pairs(src, dst)
        if batch is None:
            return None
        pairs, sources, dests, users = batch
        entry = self._fast_route(pairs, users, memo, routes, stream_lib)
        if entry is None:
            return None
        transfer, libraries = entry
        impl = stream.impl
        try:
            if transfer.can_copy_inline(pairs) and isinstance(impl, ThreadStream):
                self._copy_on_worker(impl, transfer, pairs)
            else:
                transfer.copy_tensors(pairs, impl)
        except Exception as exc:
            error = translate_backend_error(exc, f"enqueueing copies on {stream!r}")
            if error is exc:
                raise
            raise error from exc
        note_enqueued(stream)
        future = CopyFuture(
            sources, dests, stream.record(), stream, on_done=self._forget, pinned=users
        )
        self._track(future, libraries)
        return future

    def _fast_unstreamed(
        self, src: Sequence[TensorLike], dst: Sequence[TensorLike]
    ) -> CopyFuture | None:
        """The fast path of a copy without a stream that a backend enqueues itself
        (``enqueue_unstreamed``; see `copy`), or None to take the general path."""
        if len(src) > _FAST_PATH_MAX_PAIRS:
            return None
        batch = copy_pair(src[0], dst[0]) if len(src) == 1 == len(dst) else copy_pairs(src, dst)
        if batch is None:
            return None
        pairs, sources, dests, users = batch
        routes = self._routes
        entry = self._fast_route(pairs, users, routes.memo(self._transfers), routes, None)
        if entry is None:
            return None
        transfer, libraries = entry
        if transfer.can_copy_inline(pairs):
            return None  # the inline budget or the copy workers: the general path's
        try:
            started = transfer.enqueue_unstreamed(pairs)
        except Exception as exc:
            error = translate_backend_error(exc, f"enqueueing copies ({_describe(transfer)})")
            if error is exc:
                raise
            raise error from exc
        if started is None:  # the backend leaves it to the copy workers
            plan = CopyPlan(sources, dests, [(transfer, pairs)])
            plan.libraries = set(libraries)
            return self._on_workers(plan, _run_plan)
        future = CopyFuture(
            sources,
            dests,
            notification_of(started),
            _describe(transfer),
            on_done=self._forget,
            pinned=users,
        )
        self._track(future, libraries)
        return future

    def _fast_route(
        self,
        pairs: list[CopyPair],
        users: list[Tensor],
        memo: dict[Hashable, Any],
        routes: RouteCache,
        stream_lib: str | None,
    ) -> tuple[DataTransfer, frozenset[str]] | None:
        """The one transfer that copies every pair and the libraries a copy through it
        uses, from ``routes`` (what the general path found before); None if a pair has no
        route there yet, the pairs need several transfers, or a tensor the caller passed
        is device memory of another environment."""
        scope = self._scope
        if scope is not None:
            for t in users:
                if t.buffer.allocator is not None and not owned_by(t, scope):
                    return None
        found: tuple[DataTransfer, frozenset[str]] | None = None
        for s, d in pairs:
            key = (s.buffer.memory_info.device, d.buffer.memory_info.device)
            entry = memo.get(key)
            if entry is None:
                route = routes.table(self._transfers).get(key)
                if route is None:
                    return None  # never routed: the general path routes it (or says why not)
                library, transfer = route
                libraries = frozenset((library,) if stream_lib is None else (library, stream_lib))
                entry = memo[key] = (transfer, libraries)
            if found is None:
                found = entry
            elif entry[0] is not found[0]:
                return None
        return found

    def _copy_on_worker(
        self, worker: ThreadStream, transfer: DataTransfer, pairs: list[CopyPair]
    ) -> None:
        """A batch a host memcpy can do, on a worker-thread stream: inline (in the stream's
        order) while the stream is idle and the budget allows, else queued on its worker
        and timed there."""
        kind, nbytes = _route_of(pairs), _nbytes(pairs)
        budget = self._budget
        copy = transfer.copy_tensors
        if budget.allows(kind, nbytes) and worker.run_inline(
            functools.partial(budget.run, kind, nbytes, copy, pairs, None)
        ):
            return
        worker.enqueue(functools.partial(budget.run_off_loop, kind, nbytes, copy, pairs, None))

    def _stream_library(self, stream: SyncStream) -> str:
        # Remembered in the stream's route cache while the transfers stay as they are: a
        # library with open streams cannot be unregistered, and a closed stream takes no
        # copies.
        memo = stream._routes.memo(self._transfers)
        name = memo.get(self)
        if name is not None:
            return name  # type: ignore[no-any-return]
        name = self._libraries.stream_library(stream)
        if name is None:
            raise InvalidArgument(f"{stream!r} does not belong to this environment")
        memo[self] = name
        return name

    def _importers(self) -> list[MemoryImporter]:
        """The registered libraries' memory importers (for foreign tensors)."""
        return self._libraries.importers()

    def can_copy(self, src: MemoryDevice, dst: MemoryDevice) -> bool:
        """Whether a registered data transfer copies from ``src`` to ``dst`` memory."""
        return any(t.can_copy(src, dst) for _, t in self._transfers)

    def _copy_unstreamed(self, plan: CopyPlan, waits: list[NotificationImpl]) -> CopyFuture:
        if not plan.groups:
            return done_future(plan.dst)
        if waits:
            waits = [w for w in waits if not w.query()]
        if waits:
            # A producer's stream still has work before the data is ready: wait for it on a
            # copy worker, never on the loop.
            return self._on_workers(plan, functools.partial(_run_plan_after, waits))
        budget = self._budget
        if not plan.packs and all(
            t.can_copy_inline(p) and budget.allows(_route_of(p), _nbytes(p)) for t, p in plan.groups
        ):
            # Small host-side batches: a few memcpys cost less than any hand-off to a thread.
            failure = _run_groups(plan, budget, inline=True)
            what = "copy_tensors" if failure is None else _describe(failure[0])
            error = None if failure is None else failure[1]
            done = COMPLETED if error is None else Notification(Completed(error))
            return CopyFuture.completed(plan.dst, done, what)
        if len(plan.groups) == 1 and not plan.packs:
            # The backend may enqueue the batch on a queue of its own (a stream): its thread
            # wakes the awaiter, no copy worker in between, no thread blocked meanwhile.
            # Copies a host memcpy can do stay with the copy workers, which time them for
            # the budget.
            transfer, pairs = plan.groups[0]
            started = None
            if not transfer.can_copy_inline(pairs):
                try:
                    started = transfer.enqueue_unstreamed(pairs)
                except Exception as exc:
                    what = f"enqueueing copies ({_describe(transfer)})"
                    error = translate_backend_error(exc, what)
                    if error is exc:
                        raise
                    raise error from exc
            if started is not None:
                future = CopyFuture(
                    plan.src + plan.dst,
                    plan.dst,
                    Notification(started),
                    _describe(transfer),
                    on_done=self._forget,
                )
                self._track(future, frozenset(plan.libraries))
                return future
        return self._on_workers(plan, _run_plan)

    def _on_workers(
        self, plan: CopyPlan, run: Callable[[CopyPlan, InlineBudget, HostNotification], None]
    ) -> CopyFuture:
        """Run ``plan`` on a copy worker, which completes the future's notification."""
        signal = HostNotification()
        what = " / ".join(_describe(t) for t, _ in plan.groups)
        mark = notification_of(signal)
        future = CopyFuture(plan.src + plan.dst, plan.dst, mark, what, on_done=self._forget)
        self._track(future, frozenset(plan.libraries))
        self._get_workers().submit(functools.partial(run, plan, self._budget, signal))
        return future

    def _track(self, future: CopyFuture, libraries: frozenset[str]) -> None:
        """Count ``future`` in flight until it completes (its ``on_done`` is `_forget`)."""
        if future._status is _PENDING:
            self._inflight[future] = libraries
            # It may have completed meanwhile, its _forget finding nothing to forget yet.
            if future._status is not _PENDING:
                self._inflight.pop(future, None)

    def _forget(self, future: CopyFuture) -> None:
        self._inflight.pop(future, None)

    def _get_workers(self) -> CopyWorkers:
        with self._lock:
            if self._workers is None:
                self._workers = CopyWorkers(
                    max(4, os.cpu_count() or 1), "aioep-copy", lower_thread_priority
                )
            return self._workers

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
        """Wait for the copy workers' copies and stop them (a later copy starts anew)."""
        with self._lock:
            workers, self._workers = self._workers, None
        if workers is not None:
            workers.shutdown()


def _copy_small_arrays(
    src: Sequence[TensorLike],
    dst: Sequence[TensorLike],
    transfers: Sequence[tuple[str, DataTransfer]],
    budget: InlineBudget,
) -> list[Tensor] | None:
    """Copy a small batch of plain numpy arrays inline and return the destination tensors,
    or None (having written nothing) for anything else, which takes the general path.

    A 4 KiB ``await copy_tensors`` is dominated by per-call overhead; this path skips
    building source tensors and the routing machinery, and checks each array once. It only
    accepts what the general path would accept and route to the host transfer inline
    (within the inline budget), so every error still comes from the general path with its
    full message.
    """
    n = len(src)
    if n != len(dst) or not transfers or transfers[0][0] != HOST_EP_NAME:
        return None
    if n == 1:  # the common case, in a straight line
        s, d = src[0], dst[0]
        if type(s) is not np.ndarray or type(d) is not np.ndarray:
            return None
        dtype = s.dtype
        if (d.dtype is not dtype and d.dtype != dtype) or d.shape != s.shape or dtype.hasobject:
            return None
        sflags, dflags = s.flags, d.flags
        if not (sflags.c_contiguous and dflags.c_contiguous and dflags.writeable):
            return None
        nbytes = s.nbytes
        if not budget.allows(_HOST_ROUTE, nbytes) or _may_share_memory(d, s):
            return None
        start = perf_counter()
        d[...] = s  # same shape and dtype, contiguous: an exact copy (no np.copyto dispatch)
        budget.ran_inline(_HOST_ROUTE, nbytes, perf_counter() - start)
        return [wrap_array(d, False)]
    if n == 0 or n > _FAST_PATH_MAX_PAIRS:
        return None
    nbytes = 0
    for k in range(n):
        s, d = src[k], dst[k]
        if type(s) is not np.ndarray or type(d) is not np.ndarray:
            return None
        dtype = s.dtype
        if (d.dtype is not dtype and d.dtype != dtype) or d.shape != s.shape or dtype.hasobject:
            return None
        sflags, dflags = s.flags, d.flags
        if not (sflags.c_contiguous and dflags.c_contiguous and dflags.writeable):
            return None
        nbytes += s.nbytes
    if not budget.allows(_HOST_ROUTE, nbytes):
        return None
    if n == 1:
        if np.may_share_memory(dst[0], src[0]):
            return None
    else:
        arrays = [*src, *dst]
        for i in range(n, 2 * n):  # a destination may overlap nothing else
            for j in range(2 * n):
                if j != i and np.may_share_memory(arrays[i], arrays[j]):
                    return None
    start = perf_counter()
    for k in range(n):
        # Same shape and dtype, contiguous: an exact copy (cheaper than np.copyto's dispatch).
        dst[k][...] = src[k]  # type: ignore[index]
    budget.ran_inline(_HOST_ROUTE, nbytes, perf_counter() - start)
    return [wrap_array(d, False) for d in dst]  # type: ignore[arg-type]


_may_share_memory = np.may_share_memory


def _route_of(pairs: Sequence[CopyPair]) -> Hashable:
    """The inline budget's kind for a batch: its (first) pair's route."""
    s, d = pairs[0]
    sdev, ddev = s.buffer.memory_info.device, d.buffer.memory_info.device
    if sdev is HOST_MEMORY_DEVICE and ddev is HOST_MEMORY_DEVICE:
        return _HOST_ROUTE
    return (sdev, ddev)


def _nbytes(pairs: Sequence[CopyPair]) -> int:
    return sum(s.nbytes for s, _ in pairs)


def _describe(transfer: DataTransfer) -> str:
    return f"{type(transfer).__name__}.copy_tensors"


def _run_groups(
    plan: CopyPlan, budget: InlineBudget, *, inline: bool
) -> tuple[DataTransfer, BaseException] | None:
    """Run an un-streamed plan; on failure, the transfer that failed and its exception.

    Copies a host memcpy can do are timed for the budget (as inline or off-loop runs).
    The exception is handed on as the backend raised it: the future translates it,
    once, into the `DeviceError` it raises (chained to it).
    """
    plan.pack()
    for transfer, pairs in plan.groups:
        try:
            if transfer.can_copy_inline(pairs):
                run = budget.run if inline else budget.run_off_loop
                run(_route_of(pairs), _nbytes(pairs), transfer.copy_tensors, pairs, None)
            else:
                transfer.copy_tensors(pairs, None)
        except BaseException as exc:
            return transfer, exc
    return None


def _run_plan(plan: CopyPlan, budget: InlineBudget, signal: HostNotification) -> None:
    failure = _run_groups(plan, budget, inline=False)
    # The work item holds `plan` until after this returns, and the signal may wake the
    # awaiter first: drop the batch's tensors now (the future holds what it needs).
    plan.src.clear()
    plan.dst.clear()
    plan.groups.clear()
    plan.packs.clear()
    signal.set(None if failure is None else failure[1])


def _run_plan_after(
    waits: list[NotificationImpl],
    plan: CopyPlan,
    budget: InlineBudget,
    signal: HostNotification,
) -> None:
    for wait in waits:
        wait.wait_on_host(None)
        error = wait.error()
        if error is not None:
            signal.set(error)
            return
    _run_plan(plan, budget, signal)
