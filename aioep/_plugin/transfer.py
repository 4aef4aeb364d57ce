"""Data transfers (ORT's ``OrtDataTransferImpl``) and the validation and routing of a
``copy_tensors`` batch before anything is enqueued."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from .._base.errors import InvalidArgument, NotImplementedByEp
from .._base.protocols import SupportsCudaArrayInterface, SupportsDLPack
from .._base.types import MemoryDevice
from .ownership import Scope, check_owner
from .routes import Route, RouteCache, RouteKey
from .stream_impl import NotificationImpl, StreamImpl
from .tensor import Tensor, as_tensor

__all__ = ["CopyPlan", "DataTransfer", "plan_copies"]

# What copy_tensors takes: other libraries' tensors type-check through the two protocols.
TensorLike = Tensor | npt.NDArray[Any] | SupportsDLPack | SupportsCudaArrayInterface
CopyPair = tuple[Tensor, Tensor]


class DataTransfer(abc.ABC):
    """Copies tensors between memory devices; offered by a factory's ``create_data_transfer``.

    ``can_copy`` and ``can_use_stream`` must give the same answer for the same
    arguments while the transfer is registered: the core caches the routing.
    """

    @abc.abstractmethod
    def can_copy(self, src: MemoryDevice, dst: MemoryDevice) -> bool:
        """True if this transfer copies from ``src`` memory to ``dst`` memory."""

    def can_use_stream(self, stream: StreamImpl) -> bool:
        """True if [`copy_tensors`][aioep.abc.DataTransfer.copy_tensors] can enqueue on ``stream``
        (a backend stream object)."""
        return False

    @abc.abstractmethod
    def copy_tensors(self, pairs: Sequence[CopyPair], stream: StreamImpl | None) -> None:
        """Copy ``nbytes`` of each (source, destination) pair.

        With ``stream=None`` copy synchronously (the core calls this off the
        event loop, or on it for a batch `can_copy_inline` accepts while the
        environment's inline budget allows). With a stream, enqueue the copies in order
        on it and return at once. The pairs are already validated: equal sizes, no
        overlaps, ``can_copy`` true.
        """

    def can_copy_inline(self, pairs: Sequence[CopyPair]) -> bool:
        """True if ``copy_tensors(pairs, None)`` is host work that never waits: a memcpy
        between memories the host addresses (no device call, no lock held across device
        work, no sleep). Default False.

        For such a batch the core times the copy and may run it on the calling thread
        (the event loop) instead of handing it to a thread, while it costs less than the
        environment's inline budget (``Environment(inline_budget_us=...)``); on an
        `aioep.abc.ThreadStream` it runs ``copy_tensors(pairs, None)`` in the
        stream's order itself (inline while the stream is idle, else on its worker).
        Called on the caller's thread for every batch: keep it cheap.
        """
        return False

    def enqueue_unstreamed(self, pairs: Sequence[CopyPair]) -> NotificationImpl | None:
        """Optionally start an un-streamed batch without blocking and without a worker thread.

        Return a notification, already activated, that completes when the copies are
        done (the backend enqueued them on a stream of its own, say), or None (the
        default) to have the core run ``copy_tensors(pairs, None)`` on a copy worker.
        Either way the thread that finishes the copies wakes the awaiting task: one
        hop. Called on the caller's thread, often the event loop: it must not wait.
        Not called for a batch `can_copy_inline` accepts (the core's copy workers
        run those, and time them for the inline budget).
        """
        return None

    def close(self) -> None:
        """Release resources; called when the library is unregistered."""


@dataclass
class CopyPlan:
    """A validated batch: the tensors and the (transfer, pairs) groups to run, in order."""

    src: list[Tensor]
    dst: list[Tensor]
    groups: list[tuple[DataTransfer, list[CopyPair]]] = field(default_factory=list)
    nbytes: int = 0
    libraries: set[str] = field(default_factory=set)
    """Names of the libraries whose transfers run the groups."""
    packs: list[tuple[npt.NDArray[Any], npt.NDArray[Any]]] = field(default_factory=list)
    """(contiguous staging, strided source) pairs to fill before the groups run."""

    def pack(self) -> None:
        """Fill the staging copies of strided sources (where the groups run)."""
        for staging, source in self.packs:
            np.copyto(staging, source)


PACK_INLINE_BYTES = 64 << 10
"""Strided sources up to this size are packed on the calling thread even when packing
could be deferred: a thread hop costs more than the copy."""


def _address_space(device: MemoryDevice) -> object:
    # Host RAM and pinned memory share the host's address space; device memory is per device.
    return "host" if device.is_host_accessible else device


def _check_overlaps(src: Sequence[Tensor], dst: Sequence[Tensor]) -> None:
    if len(src) == 1:  # the common single pair: one interval test
        s, d = src[0], dst[0]
        if (
            s.nbytes
            and d.nbytes
            and _address_space(s.device) == _address_space(d.device)
            and s.data_ptr < d.data_ptr + d.nbytes
            and d.data_ptr < s.data_ptr + s.nbytes
        ):
            raise InvalidArgument("copy_tensors: destination 0 overlaps source 0 in memory")
        return
    spans: list[tuple[object, int, int, bool, int]] = []
    for i, t in enumerate(src):
        if t.nbytes:
            spans.append((_address_space(t.device), t.data_ptr, t.data_ptr + t.nbytes, False, i))
    for i, t in enumerate(dst):
        if t.nbytes:
            spans.append((_address_space(t.device), t.data_ptr, t.data_ptr + t.nbytes, True, i))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    # Sweep: a destination may overlap nothing; sources may overlap each other.
    space: object = None
    last_dst: tuple[int, int] | None = None
    last_src: tuple[int, int] | None = None
    for sp, start, end, is_dst, idx in spans:
        if sp != space:
            space, last_dst, last_src = sp, None, None
        if last_dst is not None and start < last_dst[0]:
            other = "destination"
            raise InvalidArgument(
                f"copy_tensors: {'destination' if is_dst else 'source'} {idx} overlaps "
                f"{other} {last_dst[1]} in memory; destinations must not overlap anything"
            )
        if is_dst and last_src is not None and start < last_src[0]:
            raise InvalidArgument(
                f"copy_tensors: destination {idx} overlaps source {last_src[1]} in memory"
            )
        if is_dst:
            if last_dst is None or end > last_dst[0]:
                last_dst = (end, idx)
        elif last_src is None or end > last_src[0]:
            last_src = (end, idx)


def plan_copies(
    src: Sequence[TensorLike],
    dst: Sequence[TensorLike],
    transfers: Sequence[tuple[str, DataTransfer]],
    *,
    stream_impl: StreamImpl | None = None,
    stream_library: str | None = None,
    allow_reshape: bool = False,
    routes: RouteCache | None = None,
    defer_packing: bool = False,
    scope: Scope | None = None,
) -> CopyPlan:
    """Validate a batch and route each pair to a transfer; raise before anything is enqueued.

    ``transfers`` is the environment's (library name, transfer) list in
    registration order; with a stream, transfers of the stream's own library
    are tried first and a transfer must be able to use the stream. ``routes``
    caches the routing across calls; it must belong to this stream (or to
    un-streamed copies) and this environment. With ``defer_packing``, a large
    non-contiguous source array gets an empty contiguous staging array, filled by
    `CopyPlan.pack` where the copy runs (off the loop), instead of being
    packed here. With ``scope`` (the environment's), device tensors of another
    environment are refused (see `aioep._plugin.ownership.check_owner`).
    """
    _check_sequence("src", src)
    _check_sequence("dst", dst)
    if len(src) != len(dst):
        raise InvalidArgument(
            f"copy_tensors: {len(src)} source(s) but {len(dst)} destination(s); "
            "the lists must have the same length"
        )
    packs: list[tuple[npt.NDArray[Any], npt.NDArray[Any]]] = []
    srcs = [
        _source_arg(s, i, packs) if defer_packing else _tensor_arg(s, "source", i, False)
        for i, s in enumerate(src)
    ]
    dsts = [_tensor_arg(d, "destination", i, True) for i, d in enumerate(dst)]
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        _check_pair(i, s, d, allow_reshape)
        if scope is not None:
            if s.buffer.allocator is not None:
                check_owner(s, scope, f"copy_tensors source {i}")
            if d.buffer.allocator is not None:
                check_owner(d, scope, f"copy_tensors destination {i}")
    _check_overlaps(srcs, dsts)

    table = {} if routes is None else routes.table(transfers)
    plan = CopyPlan(srcs, dsts, packs=packs)
    grouped: dict[int, list[CopyPair]] = {}
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        key = (s.buffer.memory_info.device, d.buffer.memory_info.device)
        route = table.get(key)
        if route is None:
            table[key] = route = _route(key, transfers, stream_impl, stream_library, i)
        library, transfer = route
        pairs = grouped.get(id(transfer))
        if pairs is None:
            grouped[id(transfer)] = pairs = []
            plan.groups.append((transfer, pairs))
            plan.libraries.add(library)
        pairs.append((s, d))
        plan.nbytes += s.nbytes
    return plan


def _check_sequence(what: str, seq: object) -> None:
    if type(seq) not in (list, tuple) and (
        isinstance(seq, (Tensor, str, bytes)) or not isinstance(seq, Sequence)
    ):
        raise InvalidArgument(
            f"copy_tensors: {what} must be a list of tensors, got {type(seq).__name__}"
        )


def _check_pair(i: int, s: Tensor, d: Tensor, allow_reshape: bool) -> None:
    if s.dtype is not d.dtype and s.dtype != d.dtype:
        raise InvalidArgument(
            f"copy_tensors pair {i}: source dtype {s.dtype} differs from destination dtype {d.dtype}"
        )
    if s.nbytes != d.nbytes:
        raise InvalidArgument(
            f"copy_tensors pair {i}: Tensor size mismatch: source {s.shape} has {s.nbytes} "
            f"bytes, destination {d.shape} has {d.nbytes}"
        )
    if s.shape != d.shape and not allow_reshape:
        raise InvalidArgument(
            f"copy_tensors pair {i}: source shape {s.shape} differs from destination shape "
            f"{d.shape}; pass allow_reshape=True for a byte copy between shapes"
        )
    if d.buffer.readonly:
        raise InvalidArgument(f"copy_tensors pair {i}: destination {d!r} is read-only")
    if s.buffer.freed:
        raise InvalidArgument(f"copy_tensors pair {i}: source buffer {s.buffer!r} was freed")
    if d.buffer.freed:
        raise InvalidArgument(f"copy_tensors pair {i}: destination buffer {d.buffer!r} was freed")


def _tensor_arg(value: TensorLike, kind: str, index: int, writable: bool) -> Tensor:
    if type(value) is Tensor:
        return value
    if type(value) is np.ndarray and value.flags.c_contiguous:
        return Tensor.from_numpy(value)
    return as_tensor(value, role=f"copy_tensors {kind} {index}", writable=writable)


def _source_arg(
    value: TensorLike, index: int, packs: list[tuple[npt.NDArray[Any], npt.NDArray[Any]]]
) -> Tensor:
    if (
        type(value) is np.ndarray
        and not value.flags.c_contiguous
        and value.nbytes > PACK_INLINE_BYTES
        and not value.dtype.hasobject
    ):
        staging = np.empty(value.shape, value.dtype)
        tensor = Tensor.from_numpy(staging)
        packs.append((staging, value))
        return tensor
    return _tensor_arg(value, "source", index, False)


def _route(
    key: RouteKey,
    transfers: Sequence[tuple[str, DataTransfer]],
    stream_impl: StreamImpl | None,
    stream_library: str | None,
    index: int,
) -> Route:
    if stream_impl is not None and stream_library is not None:
        # The stream's own library first, then the rest in registration order.
        transfers = [t for t in transfers if t[0] == stream_library] + [
            t for t in transfers if t[0] != stream_library
        ]
    capable = [t for t in transfers if t[1].can_copy(*key)]
    if stream_impl is not None:
        usable = [t for t in capable if t[1].can_use_stream(stream_impl)]
        if capable and not usable:
            raise NotImplementedByEp(
                f"copy_tensors pair {index}: no data transfer that copies {key[0]} -> {key[1]} "
                f"can enqueue on a {type(stream_impl).__name__}; use a stream of that device"
            )
        capable = usable
    if not capable:
        raise NotImplementedByEp(
            f"copy_tensors pair {index}: no registered data transfer copies from {key[0]} to "
            f"{key[1]}"
        )
    return capable[0]
