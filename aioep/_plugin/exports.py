"""What aioep hands to other libraries, and how it finds its own memory when it comes back.

A DLPack export holds its buffer (`Buffer.hold`): while a consumer (numpy, PyTorch,
a capsule nobody consumed) still has it, `Buffer.free` only marks the buffer freed
and the memory goes back to its allocator when the last export is released, as a PyTorch
storage outlives ``del tensor`` while a DLPack consumer holds it and JAX's
``Array.delete()`` waits for external references.

The export itself is a numpy array over the exported memory (`ExportedMemory` is
its base), and the capsule is the one numpy makes for it: numpy's capsule destructor and
deleter are C functions that save the error indicator and take the GIL, so the DLPack
protocol runs no Python of aioep's inside a destructor. Python runs only when numpy drops
the array and the `ExportedMemory` is deallocated (its ``__del__``), which CPython
runs with any error in flight set aside.

Device memory that aioep handed out (a DLPack export, a ``__cuda_array_interface__``) is
noted with its DLPack device (`note_handed_out`), so that an import of that memory,
whichever library wraps it by then, is recognised as that buffer (`handed_out`) and
meets the ownership rule of its environment instead of being taken as foreign memory.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .buffer import Buffer

__all__ = [
    "ExportedMemory",
    "free_deferred",
    "handed_out",
    "hold",
    "live_exports",
    "note_handed_out",
    "request_free",
    "unhold",
]

# Held buffers: buffer -> [holds, free requested]. A module dict rather than a slot keeps
# Buffer's construction as it is; free() reads it only when it is not empty. The lock is
# reentrant because a hold can be released by a deallocation that garbage collection
# runs on this thread (none of the sections below allocates a tracked object, so none
# triggers one, but a release must never deadlock).
_holds: dict[Buffer, list[Any]] = {}
_holds_lock = threading.RLock()


def hold(buffer: Buffer) -> bool:
    """Keep ``buffer``'s memory from going back to its allocator until `unhold`;
    False (and no hold) when the buffer is already freed."""
    with _holds_lock:
        if buffer.freed:
            return False
        entry = _holds.get(buffer)
        if entry is None:
            _holds[buffer] = [1, False]
        else:
            entry[0] += 1
    return True


def unhold(buffer: Buffer) -> None:
    """Release one hold; the last one frees the buffer if `Buffer.free` was called
    meanwhile."""
    with _holds_lock:
        entry = _holds.get(buffer)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] > 0:
            return
        del _holds[buffer]
        free_now = entry[1]
    if free_now:
        buffer._release()  # the free that free() deferred (pins were checked then)


def request_free(buffer: Buffer) -> bool:
    """Called by `Buffer.free`: True when holds defer the free (recorded here, done
    by the last `unhold`), False when the buffer may be freed now."""
    if not _holds:
        return False
    with _holds_lock:
        entry = _holds.get(buffer)
        if entry is None:
            return False
        entry[1] = True
    return True


def free_deferred(buffer: Buffer) -> bool:
    """True while a free of ``buffer`` waits for its DLPack exports to be released."""
    if not _holds:
        return False
    entry = _holds.get(buffer)
    return entry is not None and bool(entry[1])


_live: weakref.WeakSet[ExportedMemory] = weakref.WeakSet()


class ExportedMemory:
    """The base object of the numpy array that a DLPack export is made from: numpy's array
    interface over the exported memory, with ``keep`` (the tensor) referenced and a hold on
    ``buffer`` (None: nothing to hold) until numpy lets the array go.

    ``data`` may be a device address: numpy never reads it (the array is only exported,
    never handed out), and the exporter writes the real device into the capsule.

    Raises:
        BufferError: ``buffer`` is already freed.
    """

    __slots__ = ("__array_interface__", "__weakref__", "buffer", "keep")

    def __init__(
        self,
        data: int,
        shape: Sequence[int],
        dtype: np.dtype[Any],
        readonly: bool,
        keep: object,
        buffer: Buffer | None,
    ) -> None:
        self.buffer: Buffer | None = None
        if buffer is not None:
            if not hold(buffer):
                raise BufferError(f"tensor buffer {buffer!r} was freed")
            self.buffer = buffer
        self.keep = keep
        self.__array_interface__ = {
            "version": 3,
            "shape": tuple(shape),
            "typestr": dtype.str,
            "descr": dtype.descr,
            # numpy < 2.3 refuses a null address even for no data; a zero-size export is
            # never read, so any aligned address stands in.
            "data": (data or max(dtype.alignment, 1), readonly),
            "strides": None,
        }
        _live.add(self)

    def array(self) -> np.ndarray[Any, Any]:
        """The numpy array over the exported memory, whose base is this object."""
        return np.asarray(self)

    def __del__(self) -> None:
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            try:
                unhold(buffer)
            except Exception:  # pragma: no cover - nothing can be raised from a finaliser
                pass


def live_exports() -> int:
    """DLPack exports (capsules, or consumers' arrays) that still hold aioep memory."""
    return len(_live)


# Device memory handed out: DLPack device -> {id(buffer): weak reference}.
_handed: dict[tuple[int, int], dict[int, weakref.ref[Buffer]]] = {}
_handed_lock = threading.Lock()


def note_handed_out(buffer: Buffer, device: tuple[int, int]) -> None:
    """Remember that ``buffer``'s memory was handed out as DLPack ``device`` (type, id)."""
    if not buffer.nbytes:
        return
    key = id(buffer)
    per = _handed.get(device)
    if per is not None:
        ref = per.get(key)
        if ref is not None and ref() is buffer:
            return
    ref = weakref.ref(buffer, lambda r: _forget(device, key, r))
    with _handed_lock:
        _handed.setdefault(device, {})[key] = ref


def _forget(device: tuple[int, int], key: int, ref: weakref.ref[Buffer]) -> None:
    with _handed_lock:
        per = _handed.get(device)
        if per is not None and per.get(key) is ref:
            del per[key]
            if not per:
                del _handed[device]


def handed_out(device_type: int, device_id: int, ptr: int, nbytes: int) -> Buffer | None:
    """The buffer that aioep handed out whose memory holds ``nbytes`` at ``ptr`` on the
    DLPack device ``(device_type, device_id)`` (``device_id`` -1: any device of that
    type), or None. A buffer whose memory went back to its allocator is skipped; a freed
    one that an export still holds is returned (its memory is still that buffer's)."""
    if not _handed or nbytes <= 0:
        return None  # no data: no memory to own
    with _handed_lock:
        refs = [
            ref
            for (dtype, did), per in _handed.items()
            if dtype == device_type and device_id in (did, -1)
            for ref in per.values()
        ]
    end = ptr + nbytes
    for ref in refs:
        buffer = ref()
        if buffer is None or not buffer.ptr <= ptr or end > buffer.ptr + buffer.nbytes:
            continue
        if not buffer.freed or free_deferred(buffer):
            return buffer
    return None
