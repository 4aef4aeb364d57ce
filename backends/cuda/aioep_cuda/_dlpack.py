"""DLPack export of tensors in CUDA device memory, built with ctypes (no compiled code).

Registered with ``aioep.abc.register_dlpack_exporter`` under NVIDIA's vendor id, so
``torch.from_dlpack(t)`` / ``cupy.from_dlpack(t)`` take a CUDA tensor zero-copy.
The capsule is a legacy ``"dltensor"`` one (DLPack 0.8 ABI), which every
consumer accepts.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from aioep import Tensor

__all__ = ["DLManagedTensor", "DLTensor", "dlpack_dtype", "export_dlpack"]

_DL_CUDA = 2
_KINDS = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# Private function objects (indexing makes new ones): other code that sets argtypes on
# ctypes.pythonapi.PyCapsule_* attributes cannot change ours.
_capsule_new = ctypes.pythonapi["PyCapsule_New"]
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor]
_capsule_is_valid = ctypes.pythonapi["PyCapsule_IsValid"]
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_capsule_pointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

# Exported tensors by DLManagedTensor address: what keeps the memory and the structs alive
# until the consumer calls the deleter (or the capsule dies unconsumed).
_live: dict[int, tuple[Any, ...]] = {}
_live_lock = threading.Lock()


def _delete(managed: Any) -> None:
    addr = ctypes.cast(managed, ctypes.c_void_p).value or 0
    with _live_lock:
        _live.pop(addr, None)


_deleter = _Deleter(_delete)


def _capsule_destructor(capsule: int | None) -> None:
    # Called when the capsule dies; if it was never consumed it still owns the tensor.
    if capsule and _capsule_is_valid(capsule, b"dltensor"):
        addr = _capsule_pointer(capsule, b"dltensor")
        with _live_lock:
            _live.pop(addr or 0, None)


_destructor = _CapsuleDestructor(_capsule_destructor)


def dlpack_dtype(dtype: np.dtype[Any]) -> tuple[int, int, int]:
    """(code, bits, lanes) of a numpy dtype, or BufferError for types DLPack lacks."""
    code = _KINDS.get(dtype.kind)
    if code is None or dtype.byteorder == ">":
        raise BufferError(f"dtype {dtype} has no DLPack equivalent")
    return code, dtype.itemsize * 8, 1


def export_dlpack(tensor: Tensor, stream: Any = None) -> Any:
    """A ``"dltensor"`` capsule for a tensor in CUDA device memory.

    ``stream`` is the consumer's stream (DLPack protocol: None or 1 = legacy
    default stream, 2 = per-thread default, -1 = no synchronisation, else a
    ``cudaStream_t``). When the buffer was allocated on an open aioep stream,
    the consumer's stream is made to wait (on the device) for that stream's work.
    """
    code, bits, lanes = dlpack_dtype(tensor.dtype)
    if tensor.buffer.freed:
        raise BufferError(f"tensor buffer {tensor.buffer!r} was freed")
    _order_consumer(tensor, stream)
    ndim = tensor.ndim
    shape = (ctypes.c_int64 * max(ndim, 1))(*tensor.shape)
    strides = (ctypes.c_int64 * max(ndim, 1))(*(s // tensor.dtype.itemsize for s in tensor.strides))
    managed = DLManagedTensor()
    managed.dl_tensor.data = tensor.data_ptr or None
    managed.dl_tensor.device = DLDevice(_DL_CUDA, tensor.device.device_id)
    managed.dl_tensor.ndim = ndim
    managed.dl_tensor.dtype = DLDataType(code, bits, lanes)
    managed.dl_tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _deleter
    addr = ctypes.addressof(managed)
    with _live_lock:
        _live[addr] = (managed, shape, strides, tensor)
    return _capsule_new(addr, b"dltensor", _destructor)


def _order_consumer(tensor: Tensor, stream: Any) -> None:
    producer = getattr(tensor.buffer.stream, "impl", None)
    if producer is None or stream == -1 or getattr(producer, "closed", True):
        return
    from ._driver import check, ctx_current, driver
    from ._stream import CudaStream

    if not isinstance(producer, CudaStream):
        return
    consumer = 1 if stream is None else int(stream)  # 1: CU_STREAM_LEGACY, 2: per-thread
    if consumer == producer.handle:
        return
    drv = driver()
    notification = producer.create_notification()
    notification.activate()
    with ctx_current(producer.device.ctx):
        check(
            drv.cuStreamWaitEvent(drv.CUstream(consumer), notification.event, 0),
            "cuStreamWaitEvent (DLPack consumer stream)",
        )


def live_exports() -> int:
    """Capsules (or consumer tensors) that still hold an exported tensor (for tests)."""
    with _live_lock:
        return len(_live)
