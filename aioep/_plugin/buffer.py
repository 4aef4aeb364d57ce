"""Buffers: device memory with an owner, pinned while copies use it (ORT's allocations as
``OrtAllocator`` hands them out; cuda.core's ``Buffer``)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .._base.errors import InUseError, InvalidArgument
from .._base.types import HOST_MEMORY_DEVICE, MemoryDevice, MemoryInfo
from .._base.validate import MAX_DIM, check_int, describe
from .exports import free_deferred, request_free

if TYPE_CHECKING:
    from .allocator import Allocator
    from .tensor import Tensor

__all__ = [
    "HOST_MEMORY_INFO",
    "Buffer",
    "ImportedBuffer",
    "new_buffer",
    "pin_for",
    "unpin",
]

HOST_MEMORY_INFO = MemoryInfo("Cpu", HOST_MEMORY_DEVICE, alignment=64)
"""Host RAM (``"Cpu"``, 64-byte aligned): the DEFAULT memory of the host device and of
tensors wrapped from numpy arrays."""


_MAX_PTR = (1 << 64) - 1
_B = TypeVar("_B", bound="Buffer")
_PIN_LOCK = threading.Lock()  # guards every buffer's pin count (held for an increment)


class Buffer:
    """A block of memory on one device: ``ptr`` (device address), ``nbytes`` and ``memory_info``.

    A buffer from an allocator goes back to it when the last reference is dropped
    (or on [`free`][aioep.Buffer.free]). While a copy is using it, it is pinned and
    [`free`][aioep.Buffer.free] raises [`InUseError`][aioep.InUseError].
    """

    __slots__ = (
        "__weakref__",
        "_last_use",
        "_on_release",
        "_owner",
        "_pin_lock",
        "_pins",
        "_released",
        "allocator",
        "memory_info",
        "nbytes",
        "ptr",
        "readonly",
        "stream",
    )

    def __init__(
        self,
        ptr: int,
        nbytes: int,
        memory_info: MemoryInfo,
        *,
        allocator: Allocator | None = None,
        owner: object = None,
        release: Callable[[], None] | None = None,
        readonly: bool = False,
        stream: Any = None,
    ) -> None:
        if type(ptr) is not int or type(nbytes) is not int:
            ptr = check_int("Buffer", "ptr", ptr, maximum=_MAX_PTR)
            nbytes = check_int("Buffer", "nbytes", nbytes, maximum=MAX_DIM)
        if ptr <= 0 or nbytes < 0 or ptr > _MAX_PTR or nbytes > MAX_DIM:
            if ptr == 0 and nbytes == 0:
                pass  # an empty buffer touches no memory: null is its usual address
            elif ptr == 0:
                raise InvalidArgument(
                    f"Buffer: ptr is null (0) for {nbytes} bytes; a buffer over memory needs its "
                    "address"
                )
            else:
                check_int("Buffer", "ptr", ptr, maximum=_MAX_PTR)
                check_int("Buffer", "nbytes", nbytes, maximum=MAX_DIM)
        if not isinstance(memory_info, MemoryInfo):
            raise InvalidArgument(
                f"Buffer: memory_info must be an aioep.MemoryInfo, got {describe(memory_info)}"
            )
        if release is not None and not callable(release):
            raise InvalidArgument(f"Buffer: release must be callable, got {describe(release)}")
        self.ptr = ptr
        self.nbytes = nbytes
        self.memory_info = memory_info
        self.allocator = allocator
        self.readonly = readonly
        self.stream = stream
        self._owner = owner
        self._last_use: Any = None  # the Notification of the last copy that used it
        self._pins = 0
        self._pin_lock = _PIN_LOCK
        self._on_release = release  # called once, by _release
        self._released = False

    @property
    def device(self) -> MemoryDevice:
        """The memory device this buffer lives on."""
        return self.memory_info.device

    @property
    def origin(self) -> Any:
        """Who made this memory: the environment and library registration whose allocator
        allocated it (``origin.library``, ``origin.scope.label``), or None for memory aioep
        did not allocate (numpy arrays, memory imported from another framework: owned by
        its producer, never freed by aioep). ``copy_tensors``, sessions and IOBinding take
        device memory only from their own environment."""
        allocator = self.allocator
        return None if allocator is None else allocator._origin

    @property
    def freed(self) -> bool:
        """True once the memory went back to its allocator (or [`free`][aioep.Buffer.free] was
        called; also while a DLPack export defers the free)."""
        return self._released or free_deferred(self)

    def free(self) -> None:
        """Give the memory back to its allocator now; idempotent.

        While a DLPack export of the buffer is alive (a consumer's array, an unconsumed
        capsule), the buffer is marked freed at once and its memory goes back when the
        last export is released, never to a new allocation while a consumer can use it.

        Raises:
            InUseError: a copy or load still uses this buffer.
        """
        if self._pins:
            raise InUseError(
                f"buffer {self.ptr:#x} ({self.nbytes} bytes on {self.memory_info.name}) is "
                f"used by {self._pins} operation(s) in flight; await them before freeing"
            )
        if request_free(self):
            return  # a DLPack export holds the memory: its last release frees it
        self._release()

    def _release(self) -> None:
        """Give the memory back now, exactly once however often and from whichever thread
        it is called: the one release path. `free` ends here, and so does the
        buffer's last reference going (``__del__``). Subclasses that hand memory back
        another way override it (the arena's buffers)."""
        lock = self._pin_lock
        lock.acquire()
        try:
            if self._released:
                return
            self._released = True
            release = self._on_release
            self._on_release = None
        finally:
            lock.release()
        self._owner = None
        if release is not None:
            release()

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # The last reference went: release once. Not at interpreter shutdown, when the
        # allocator and the backend behind it may already be torn down (the process's
        # memory goes with it). An exception here is reported as unraisable, as
        # weakref.finalize reported it.
        try:
            released = self._released
        except AttributeError:
            return  # __init__ failed before the buffer held anything
        if released or (self._on_release is None and type(self) in _PLAIN_BUFFERS):
            return  # nothing to give back (a view of a numpy array, say)
        if not _finalizing():
            self._release()

    @property
    def pending_work(self) -> Any:
        """The [`Notification`][aioep.Notification] of the last copy that used this buffer while it
        is not complete, else None: what a DLPack consumer's stream must wait for."""
        work = self._last_use
        if work is None or work.done():
            return None
        return work

    def _pin(self) -> None:
        with self._pin_lock:
            self._pins += 1

    def _unpin(self) -> None:
        with self._pin_lock:
            self._pins -= 1

    def __repr__(self) -> str:
        state = " freed" if self.freed else ""
        return f"<Buffer {self.ptr:#x} nbytes={self.nbytes} on {self.memory_info.name!r}{state}>"


class _ArrayBuffer(Buffer):
    """A `Buffer` over a numpy array's memory (`Tensor.from_numpy`): host RAM, no
    allocator, nothing to give back; what every such buffer shares is the class's."""

    __slots__ = ()
    memory_info = HOST_MEMORY_INFO  # type: ignore[assignment]
    allocator = None
    stream = None
    _pin_lock = _PIN_LOCK


_PLAIN_BUFFERS = (Buffer, _ArrayBuffer)  # types whose buffers have nothing to release when
# they have no release callback


def new_buffer(cls: type[_B], ptr: int, nbytes: int) -> _B:
    """A buffer of class ``cls`` (a `Buffer` subclass whose class attributes give the fields
    that do not change: memory info, allocator, release, pin lock) over ``nbytes`` at
    ``ptr``, with no pins, not released, never used, built without ``__init__``'s checks:
    for an allocator whose values are known good (the arena's hot path). The caller sets
    what its class does not give."""
    buffer = _new_buffer(cls)
    buffer.ptr = ptr
    buffer.nbytes = nbytes
    buffer._pins = 0
    buffer._released = False
    buffer._last_use = None
    return buffer


def pin_for(tensors: Sequence[Tensor], work: object) -> None:
    """Pin each tensor's buffer against `Buffer.free` and note ``work`` (a notification)
    as the last use of its memory (`Buffer.pending_work`), until `unpin`."""
    lock = _PIN_LOCK
    if len(tensors) == 1:
        buffer = tensors[0].buffer
        if buffer._pin_lock is lock:
            buffer._last_use = work
            lock.acquire()
            buffer._pins += 1
            lock.release()
            return
    others: list[Buffer] | None = None
    lock.acquire()
    try:
        for t in tensors:
            buffer = t.buffer
            buffer._last_use = work
            if buffer._pin_lock is lock:
                buffer._pins += 1
            elif others is None:
                others = [buffer]
            else:
                others.append(buffer)
    finally:
        lock.release()
    if others is not None:
        for buffer in others:
            buffer._pin()


def unpin(tensors: Sequence[Tensor]) -> None:
    """Undo `pin_for`."""
    lock = _PIN_LOCK
    if len(tensors) == 1:
        buffer = tensors[0].buffer
        if buffer._pin_lock is lock:
            lock.acquire()
            buffer._pins -= 1
            lock.release()
            return
    others: list[Buffer] | None = None
    lock.acquire()
    try:
        for t in tensors:
            buffer = t.buffer
            if buffer._pin_lock is lock:
                buffer._pins -= 1
            elif others is None:
                others = [buffer]
            else:
                others.append(buffer)
    finally:
        lock.release()
    if others is not None:
        for buffer in others:
            buffer._unpin()


_new_buffer = Buffer.__new__  # (of a subclass too)


class ImportedBuffer(Buffer):
    """Memory another library made and handed over (DLPack, CUDA Array Interface): owned by
    its producer, usable by any environment whose backends own that device, never freed
    by aioep.

    ``producer`` is the object it came from; the buffer keeps it alive, and a release
    callback (the DLPack deleter) runs when the buffer dies. `free` hands the memory
    back to the producer early (never while a copy uses it).
    """

    __slots__ = ("producer",)

    imported = True
    """Marks memory owned by its producer (ownership checks let any environment use it)."""

    def __init__(
        self,
        ptr: int,
        nbytes: int,
        memory_info: MemoryInfo,
        *,
        producer: object,
        keep: object = None,
        release: Callable[[], None] | None = None,
        readonly: bool = False,
    ) -> None:
        super().__init__(
            ptr, nbytes, memory_info, owner=(producer, keep), release=release, readonly=readonly
        )
        self.producer = producer

    def __repr__(self) -> str:
        return (
            f"<ImportedBuffer {self.ptr:#x} nbytes={self.nbytes} on {self.memory_info.name!r} "
            f"from {type(self.producer).__name__}>"
        )
