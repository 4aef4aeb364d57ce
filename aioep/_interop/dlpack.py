"""DLPack with ctypes (no compiled code): the ABI structures, reading a producer's capsule
(legacy ``"dltensor"`` and DLPack >= 1.0 ``"dltensor_versioned"``) and building a
``"dltensor"`` capsule for export.

The layouts follow ``dlpack.h`` (DLPack 1.1). A consumer that takes a capsule renames it
(``"used_dltensor"`` / ``"used_dltensor_versioned"``), which tells the producer's capsule
destructor that the consumer now owns the managed tensor, and calls its deleter once done.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "DLDataType",
    "DLDevice",
    "DLDeviceType",
    "DLManagedTensor",
    "DLManagedTensorVersioned",
    "DLPackView",
    "DLTensor",
    "dlpack_capsule",
    "dlpack_dtype",
    "live_dlpack_exports",
    "numpy_dtype",
    "read_capsule",
]


class DLDeviceType(enum.IntEnum):
    """DLPack device type codes (``DLDeviceType`` in ``dlpack.h``), as ``__dlpack_device__``
    reports them."""

    CPU = 1
    CUDA = 2
    CUDA_HOST = 3
    OPENCL = 4
    VULKAN = 7
    METAL = 8
    VPI = 9
    ROCM = 10
    ROCM_HOST = 11
    EXT_DEV = 12
    """Reserved for extension devices; what aioep's own non-CUDA device tensors report."""
    CUDA_MANAGED = 13
    ONE_API = 14
    WEBGPU = 15
    HEXAGON = 16
    MAIA = 17


class DLDevice(ctypes.Structure):
    """``DLDevice``: device type and id."""

    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    """``DLDataType``: type code, bits and lanes."""

    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    """``DLTensor``: data pointer, device, shape, strides (in elements) and byte offset."""

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
    """``DLManagedTensor`` (the legacy, unversioned ABI): a tensor and its deleter."""


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]


class DLPackVersion(ctypes.Structure):
    """``DLPackVersion``: the ABI version of a versioned managed tensor."""

    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    """``DLManagedTensorVersioned`` (DLPack >= 1.0): adds the version and flags."""


_DeleterVersioned = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DeleterVersioned),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", DLTensor),
]

FLAG_READ_ONLY = 1 << 0
FLAG_IS_COPIED = 1 << 1
MAX_VERSION = (1, 1)
"""The newest DLPack ABI version aioep reads (what it passes as ``max_version``)."""

_LEGACY, _VERSIONED = b"dltensor", b"dltensor_versioned"
# PyCapsule_SetName keeps the pointer: names must outlive every capsule.
_USED_LEGACY = ctypes.create_string_buffer(b"used_dltensor")
_USED_VERSIONED = ctypes.create_string_buffer(b"used_dltensor_versioned")

# Private function objects (indexing makes new ones): code elsewhere that sets argtypes on
# ctypes.pythonapi.PyCapsule_* cannot change ours.
_is_valid = ctypes.pythonapi["PyCapsule_IsValid"]
_is_valid.restype = ctypes.c_int
_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_get_pointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_set_name = ctypes.pythonapi["PyCapsule_SetName"]
_set_name.restype = ctypes.c_int
_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]

_KINDS = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}
_CODES = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}


def dlpack_dtype(dtype: np.dtype[Any]) -> tuple[int, int, int]:
    """(code, bits, lanes) of a numpy dtype, or BufferError for types DLPack lacks."""
    code = _KINDS.get(dtype.kind)
    if code is None or dtype.byteorder == ">":
        raise BufferError(f"dtype {dtype} has no DLPack equivalent")
    return code, dtype.itemsize * 8, 1


def numpy_dtype(code: int, bits: int, lanes: int) -> np.dtype[Any]:
    """The numpy dtype of a DLPack (code, bits, lanes), or BufferError where numpy has none
    (bfloat16, float8, vector lanes, opaque handles)."""
    kind = _CODES.get(code)
    if kind is None or lanes != 1 or bits % 8 or (kind == "b" and bits != 8):
        raise BufferError(
            f"DLPack dtype (code={code}, bits={bits}, lanes={lanes}) has no numpy dtype"
        )
    try:
        return np.dtype(f"{kind}{bits // 8}" if kind != "b" else "?")
    except TypeError as exc:
        raise BufferError(
            f"DLPack dtype (code={code}, bits={bits}, lanes={lanes}) has no numpy dtype"
        ) from exc


class DLPackView:
    """What a consumed capsule describes: address of the first element (``byte_offset``
    included), device, shape, element strides (None: C-contiguous), dtype, read-only flag.

    The view owns the producer's managed tensor: `release` calls its deleter (once);
    until then the producer keeps the memory alive.
    """

    __slots__ = (
        "__weakref__",
        "_deleter",
        "data",
        "device_id",
        "device_type",
        "dtype",
        "readonly",
        "shape",
        "strides",
        "versioned",
    )

    def __init__(
        self,
        data: int,
        device: tuple[int, int],
        shape: tuple[int, ...],
        strides: tuple[int, ...] | None,
        dtype: np.dtype[Any],
        readonly: bool,
        versioned: bool,
        deleter: Callable[[], None] | None,
    ) -> None:
        self.data = data
        self.device_type, self.device_id = device
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.readonly = readonly
        self.versioned = versioned
        self._deleter = deleter

    @property
    def nbytes(self) -> int:
        """Bytes the (contiguous) data spans."""
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def c_contiguous(self) -> bool:
        """True when the elements are laid out in C order without gaps."""
        if self.strides is None:
            return True
        step = 1
        for d, s in zip(reversed(self.shape), reversed(self.strides)):
            if d != 1 and s != step:
                return False
            step *= d
        return True

    def release(self) -> None:
        """Hand the managed tensor back to its producer (call its deleter); idempotent."""
        deleter, self._deleter = self._deleter, None
        if deleter is not None:
            deleter()


def read_capsule(capsule: object) -> DLPackView:
    """Consume a DLPack capsule (legacy or versioned) and return what it describes.

    The capsule is renamed ``used_...`` at once, so the view owns the managed tensor
    and must be released (`DLPackView.release`) when the memory is no longer used.

    Raises:
        BufferError: not an unconsumed DLPack capsule, a newer major ABI version, or a
            dtype numpy lacks (the managed tensor is released before raising).
    """
    if _is_valid(capsule, _VERSIONED):
        addr = _get_pointer(capsule, _VERSIONED)
        managed_v = DLManagedTensorVersioned.from_address(addr)
        if managed_v.version.major > MAX_VERSION[0]:
            # Not ours to read; leave it unconsumed (the producer's destructor frees it).
            raise BufferError(
                f"DLPack capsule of ABI version {managed_v.version.major}."
                f"{managed_v.version.minor}; aioep reads up to {MAX_VERSION[0]}.x"
            )
        _set_name(capsule, _USED_VERSIONED)
        deleter_v = managed_v.deleter
        ptr_v = ctypes.pointer(managed_v)
        release = None if not deleter_v else _call_once(deleter_v, ptr_v)
        return _view(managed_v.dl_tensor, bool(managed_v.flags & FLAG_READ_ONLY), True, release)
    if _is_valid(capsule, _LEGACY):
        addr = _get_pointer(capsule, _LEGACY)
        managed = DLManagedTensor.from_address(addr)
        _set_name(capsule, _USED_LEGACY)
        deleter = managed.deleter
        ptr = ctypes.pointer(managed)
        release = None if not deleter else _call_once(deleter, ptr)
        return _view(managed.dl_tensor, False, False, release)
    raise BufferError(
        f"__dlpack__ returned {type(capsule).__name__}, not an unconsumed DLPack capsule "
        "('dltensor' or 'dltensor_versioned')"
    )


def _call_once(fn: Any, arg: Any) -> Callable[[], None]:
    def call() -> None:
        fn(arg)

    return call


def _view(
    dl: DLTensor, readonly: bool, versioned: bool, release: Callable[[], None] | None
) -> DLPackView:
    try:
        ndim = int(dl.ndim)
        dtype = numpy_dtype(dl.dtype.code, dl.dtype.bits, dl.dtype.lanes)
        shape = tuple(int(dl.shape[i]) for i in range(ndim)) if ndim else ()
        strides = tuple(int(dl.strides[i]) for i in range(ndim)) if dl.strides and ndim else None
    except BaseException:
        if release is not None:
            release()
        raise
    data = int(dl.data or 0) + int(dl.byte_offset)
    device = (int(dl.device.device_type), int(dl.device.device_id))
    return DLPackView(data, device, shape, strides, dtype, readonly, versioned, release)


# -- export ---------------------------------------------------------------------------------
_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_new = ctypes.pythonapi["PyCapsule_New"]
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor]
_raw_is_valid = ctypes.pythonapi["PyCapsule_IsValid"]
_raw_is_valid.restype = ctypes.c_int
_raw_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_raw_pointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_raw_pointer.restype = ctypes.c_void_p
_raw_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

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
    if capsule and _raw_is_valid(capsule, _LEGACY):
        addr = _raw_pointer(capsule, _LEGACY)
        with _live_lock:
            _live.pop(addr or 0, None)


_destructor = _CapsuleDestructor(_capsule_destructor)


def dlpack_capsule(
    data: int,
    shape: Sequence[int],
    dtype: np.dtype[Any],
    device: tuple[int, int],
    keep: object,
) -> Any:
    """A ``"dltensor"`` capsule (DLPack 0.8 ABI, which every consumer reads) for the
    C-contiguous array of ``shape`` and ``dtype`` at ``data`` on DLPack ``device``.

    ``keep`` (the tensor) stays referenced until the consumer calls the deleter, or the
    capsule dies unconsumed.

    Raises:
        BufferError: ``dtype`` has no DLPack equivalent.
    """
    code, bits, lanes = dlpack_dtype(dtype)
    ndim = len(shape)
    c_shape = (ctypes.c_int64 * max(ndim, 1))(*shape)
    steps: list[int] = []
    step = 1
    for d in reversed(shape):
        steps.append(step)
        step *= max(d, 1)
    c_strides = (ctypes.c_int64 * max(ndim, 1))(*reversed(steps))
    managed = DLManagedTensor()
    managed.dl_tensor.data = data or None
    managed.dl_tensor.device = DLDevice(*device)
    managed.dl_tensor.ndim = ndim
    managed.dl_tensor.dtype = DLDataType(code, bits, lanes)
    managed.dl_tensor.shape = ctypes.cast(c_shape, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.strides = ctypes.cast(c_strides, ctypes.POINTER(ctypes.c_int64))
    managed.dl_tensor.byte_offset = 0
    managed.manager_ctx = None
    managed.deleter = _deleter
    addr = ctypes.addressof(managed)
    with _live_lock:
        _live[addr] = (managed, c_shape, c_strides, keep)
    return _capsule_new(addr, _LEGACY, _destructor)


def live_dlpack_exports() -> int:
    """Capsules (or consumers) that still hold a tensor exported by
    [`dlpack_capsule`][aioep.abc.dlpack_capsule]."""
    with _live_lock:
        return len(_live)
