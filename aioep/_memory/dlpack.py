"""DLPack with ctypes (no compiled code): the ABI structures, reading a producer's capsule
(legacy ``"dltensor"`` and DLPack >= 1.0 ``"dltensor_versioned"``) and building a
``"dltensor"`` capsule for export.

The layouts follow ``dlpack.h`` (DLPack 1.1). A consumer that takes a capsule renames it
(``"used_dltensor"`` / ``"used_dltensor_versioned"``), which tells the producer's capsule
destructor that the consumer now owns the managed tensor, and calls its deleter once done,
also when it then refuses what the tensor describes.

Export uses numpy's capsule machinery (see `dlpack_capsule`): a capsule destructor
or deleter written as a ctypes callback would run Python inside the interpreter's
deallocation, where an exception may be in flight (``np.from_dlpack`` refusing a device
tensor drops the capsule with its ``BufferError`` set), and ctypes cannot set that
exception aside as the C destructors of numpy, PyTorch and pyarrow do.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._base.codes import DLDeviceType
from .._plugin.buffer import Buffer
from .._plugin.exports import ExportedMemory, live_exports, note_handed_out
from .._plugin.tensor import Tensor

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
    "exported_buffer",
    "is_legacy_import",
    "live_dlpack_exports",
    "numpy_dtype",
    "numpy_dtype_bits",
    "read_capsule",
]


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

_capsule_name = ctypes.pythonapi["PyCapsule_GetName"]
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]
_NUMPY_LEGACY_BASE = b"numpy_dltensor"  # numpy's name for a consumed legacy capsule it keeps


def is_legacy_import(array: np.ndarray[Any, Any]) -> bool:
    """True when ``np.from_dlpack`` made ``array`` from a legacy (pre-1.0) capsule: numpy
    keeps the consumed capsule as the array's base under its own name."""
    base = array.base
    return type(base).__name__ == "PyCapsule" and _capsule_name(base) == _NUMPY_LEGACY_BASE


_KINDS = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}
_CODES = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}


def dlpack_dtype(dtype: np.dtype[Any]) -> tuple[int, int, int]:
    """(code, bits, lanes) of a numpy dtype, or BufferError for types DLPack lacks (long
    double among them: it is not IEEE binary128)."""
    code = _KINDS.get(dtype.kind)
    bits = dtype.itemsize * 8
    if code is None or dtype.byteorder == ">" or bits not in _NUMPY_BITS.get(dtype.kind, (8,)):
        raise BufferError(f"dtype {dtype} has no DLPack equivalent")
    return code, bits, 1


# The (kind, bits) numpy has an IEEE/two's complement type for. float128 and complex256
# only where the platform's long double is IEEE binary128 (aarch64 Linux): numpy's 16-byte
# float is that long double, on x86 the x87 80-bit extended format padded to 16 bytes, and
# reading one as the other would garble every value.
_finfo = np.finfo(np.longdouble)
_BINARY128 = np.dtype(np.longdouble).itemsize == 16 and (_finfo.nmant, _finfo.maxexp) == (
    112,
    16384,
)
_NUMPY_BITS = {
    "i": (8, 16, 32, 64),
    "u": (8, 16, 32, 64),
    "f": (16, 32, 64, 128) if _BINARY128 else (16, 32, 64),
    "c": (64, 128, 256) if _BINARY128 else (64, 128),
}


def numpy_dtype_bits() -> dict[str, tuple[int, ...]]:
    """The sizes in bits, by numpy kind (``"i"``, ``"u"``, ``"f"``, ``"c"``), that a DLPack
    dtype can have here (float128 only where long double is IEEE binary128)."""
    return dict(_NUMPY_BITS)


def numpy_dtype(code: int, bits: int, lanes: int) -> np.dtype[Any]:
    """The numpy dtype of a DLPack (code, bits, lanes), or BufferError where numpy has none
    (bfloat16, float8, float128, vector lanes, opaque handles)."""
    kind = _CODES.get(code)
    if kind == "b" and bits == 8 and lanes == 1:
        return np.dtype("?")
    if kind is None or lanes != 1 or bits not in _NUMPY_BITS.get(kind, ()):
        what = f"DLPack dtype (code={code}, bits={bits}, lanes={lanes}) has no numpy dtype"
        if kind in ("f", "c") and bits in (128, 256):
            what += " (numpy's long double is not IEEE binary128 on this platform)"
        raise BufferError(what)
    return np.dtype(f"{kind}{bits // 8}")


class DLPackView:
    """What a consumed capsule describes: address of the first element (``byte_offset``
    included), device, shape, element strides (None: C-contiguous), dtype, read-only flag.

    The view owns the producer's managed tensor: `release` calls its deleter (once);
    until then the producer keeps the memory alive. ``managed`` is the managed tensor's
    address (what `exported_buffer` recognises aioep's own exports by).
    """

    __slots__ = (
        "__weakref__",
        "_deleter",
        "data",
        "device_id",
        "device_type",
        "dtype",
        "managed",
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
        managed: int = 0,
    ) -> None:
        self.data = data
        self.managed = managed
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
        BufferError: not an unconsumed DLPack capsule, a newer major ABI version, a dtype
            numpy lacks, or a tensor that describes no valid memory (ndim out of range,
            a negative dimension, no data for a non-empty tensor); once the capsule is
            consumed, the managed tensor is released (its deleter called) before raising.
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
        readonly = bool(managed_v.flags & FLAG_READ_ONLY)
        return _view(managed_v.dl_tensor, readonly, True, release, addr)
    if _is_valid(capsule, _LEGACY):
        addr = _get_pointer(capsule, _LEGACY)
        managed = DLManagedTensor.from_address(addr)
        _set_name(capsule, _USED_LEGACY)
        deleter = managed.deleter
        ptr = ctypes.pointer(managed)
        release = None if not deleter else _call_once(deleter, ptr)
        # The legacy ABI has no read-only flag: its producers hand out memory they let be
        # written (numpy and aioep refuse to export read-only memory as a legacy capsule),
        # and PyTorch and CuPy consumers write into it.
        return _view(managed.dl_tensor, False, False, release, addr)
    raise BufferError(
        f"__dlpack__ returned {type(capsule).__name__}, not an unconsumed DLPack capsule "
        "('dltensor' or 'dltensor_versioned')"
    )


def _call_once(fn: Any, arg: Any) -> Callable[[], None]:
    def call() -> None:
        fn(arg)

    return call


_MAX_NDIM = 64  # numpy's limit; a larger ndim is a corrupt capsule, never read past


def _view(
    dl: DLTensor,
    readonly: bool,
    versioned: bool,
    release: Callable[[], None] | None,
    managed: int,
) -> DLPackView:
    try:
        ndim = int(dl.ndim)
        if not 0 <= ndim <= _MAX_NDIM:
            raise BufferError(f"DLPack tensor has ndim {ndim}; expected 0 to {_MAX_NDIM}")
        dtype = numpy_dtype(dl.dtype.code, dl.dtype.bits, dl.dtype.lanes)
        if ndim and not dl.shape:
            raise BufferError(f"DLPack tensor of ndim {ndim} has no shape (a null pointer)")
        shape = tuple(int(dl.shape[i]) for i in range(ndim))
        if any(d < 0 for d in shape):
            raise BufferError(f"DLPack tensor has shape {shape}; dimensions must be >= 0")
        strides = tuple(int(dl.strides[i]) for i in range(ndim)) if dl.strides and ndim else None
        data = int(dl.data or 0) + int(dl.byte_offset)
        size = 1
        for d in shape:
            size *= d
        if not dl.data and size:
            raise BufferError(
                f"DLPack tensor of shape {shape} has a null data pointer; only an empty tensor may"
            )
    except BaseException:
        if release is not None:
            release()
        raise
    device = (int(dl.device.device_type), int(dl.device.device_id))
    return DLPackView(data, device, shape, strides, dtype, readonly, versioned, release, managed)


# -- export ---------------------------------------------------------------------------------
# The exports made here, by DLManagedTensor address, while their consumer (or the unconsumed
# capsule) holds them: how an import recognises a capsule aioep made (read_capsule).
_by_managed: weakref.WeakValueDictionary[int, ExportedMemory] = weakref.WeakValueDictionary()


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
    capsule dies unconsumed; a tensor's buffer is held meanwhile (its ``free()`` waits for
    the release). numpy makes the capsule for an array over the memory that it never reads,
    and the device is written into it: numpy's capsule destructor and deleter are C, so no
    Python runs inside them (a ctypes callback there would clobber an exception in flight).

    Raises:
        BufferError: ``dtype`` has no DLPack equivalent, the tensor's buffer was freed, or
            it is read-only (the legacy ABI cannot say so).
    """
    dlpack_dtype(dtype)  # BufferError before any side effect
    buffer = keep.buffer if isinstance(keep, Tensor) else None
    readonly = buffer is not None and buffer.readonly
    export = ExportedMemory(data, shape, dtype, readonly, keep, buffer)
    capsule = export.array().__dlpack__()
    managed = DLManagedTensor.from_address(_get_pointer(capsule, _LEGACY))
    managed.dl_tensor.data = data or None
    managed.dl_tensor.device = DLDevice(*device)
    managed.dl_tensor.byte_offset = 0
    _by_managed[ctypes.addressof(managed)] = export
    if buffer is not None:
        note_handed_out(buffer, (int(device[0]), int(device[1])))
    return capsule


def exported_buffer(view: DLPackView) -> Buffer | None:
    """The aioep buffer whose export ``view`` was read from (a capsule `dlpack_capsule`
    made, whoever passed it on), or None."""
    export = _by_managed.get(view.managed)
    if export is None or export.buffer is None:
        return None
    return export.buffer


def live_dlpack_exports() -> int:
    """DLPack exports of aioep tensors (capsules, or consumers' arrays) not yet released."""
    return live_exports()
