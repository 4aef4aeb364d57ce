"""Tensors: shape and dtype over a buffer (C-contiguous), numpy and DLPack views of them."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._base.codes import NVIDIA_VENDOR_ID, DLDeviceType
from .._base.errors import InvalidArgument
from .._base.types import DeviceType, MemoryDevice, MemoryInfo
from .._base.validate import MAX_DIM, check_dtype, check_int, describe
from .buffer import (
    _PIN_LOCK,
    HOST_MEMORY_INFO,
    Buffer,
    ImportedBuffer,
    _ArrayBuffer,
    _new_buffer,
)
from .exports import ExportedMemory, note_handed_out

__all__ = [
    "Tensor",
    "as_tensor",
    "register_dlpack_exporter",
]

# What __dlpack_device__ reports: plain ints, as the protocol's tuples hold.
_DL_CPU, _DL_CUDA, _DL_EXT_DEV = (
    int(DLDeviceType.CPU),
    int(DLDeviceType.CUDA),
    int(DLDeviceType.EXT_DEV),
)


class _ArrayInterface:
    """Lets numpy wrap host memory zero-copy while keeping the tensor alive (as the base).

    It also holds the object that owns the memory (where the buffer has one), so an
    explicit ``buffer.free()`` never leaves an existing view pointing at freed memory.
    """

    __slots__ = ("__array_interface__", "owner", "tensor")

    def __init__(self, tensor: Tensor, readonly: bool) -> None:
        self.tensor = tensor
        self.owner = tensor.buffer._owner
        self.__array_interface__ = {
            "version": 3,
            "shape": tensor.shape,
            "typestr": tensor.dtype.str,
            "descr": tensor.dtype.descr,
            "data": (tensor.data_ptr, readonly),
            "strides": None,
        }


class Tensor:
    """An n-dimensional, C-contiguous array of one dtype over a [`Buffer`][aioep.Buffer].

    Tensors in host-accessible memory give a zero-copy [`numpy`][aioep.Tensor.numpy] view and
    DLPack export; tensors in device memory move only by
    [`aioep.copy_tensors`][aioep.copy_tensors].

    ``shape``, ``dtype``, ``nbytes`` (the size of the data in bytes), ``buffer`` and
    ``byte_offset`` (where the data starts in the buffer) are plain attributes.
    """

    __slots__ = ("__weakref__", "_size", "buffer", "byte_offset", "dtype", "nbytes", "shape")

    def __init__(
        self,
        buffer: Buffer,
        shape: Sequence[int] | int,
        dtype: npt.DTypeLike,
        *,
        byte_offset: int = 0,
    ) -> None:
        dims, dt, size, nbytes = tensor_layout("Tensor", shape, dtype)
        if not isinstance(buffer, Buffer):
            raise InvalidArgument(f"Tensor: buffer must be an aioep.Buffer, got {buffer!r}")
        if type(byte_offset) is not int or not 0 <= byte_offset <= MAX_DIM:
            byte_offset = check_int("Tensor", "byte_offset", byte_offset, maximum=MAX_DIM)
        if byte_offset + nbytes > buffer.nbytes:
            raise InvalidArgument(
                f"Tensor of shape {dims} and dtype {dt} needs {nbytes} bytes "
                f"at offset {byte_offset}, but the buffer holds {buffer.nbytes}"
            )
        self.shape = dims
        self.dtype = dt
        self._size = size
        self.nbytes = nbytes
        self.buffer = buffer
        self.byte_offset = byte_offset

    @classmethod
    def from_numpy(cls, array: npt.NDArray[Any]) -> Tensor:
        """Wrap a C-contiguous numpy array without copying; the tensor keeps it alive."""
        if type(array) is not np.ndarray and not isinstance(array, np.ndarray):
            raise InvalidArgument(
                f"Tensor.from_numpy needs a numpy.ndarray, got {type(array).__name__}"
            )
        flags = array.flags
        if not flags.c_contiguous:
            raise InvalidArgument(
                f"Tensor.from_numpy needs a C-contiguous array (shape {array.shape}, strides "
                f"{array.strides}); use numpy.ascontiguousarray first"
            )
        if array.dtype.hasobject:
            raise InvalidArgument(
                f"Tensor.from_numpy: dtype {array.dtype} holds Python objects, which device "
                "memory cannot hold (sessions take string arrays as inputs directly)"
            )
        return checked_host_tensor(array, readonly=not flags.writeable)

    @property
    def size(self) -> int:
        """Number of elements."""
        return self._size

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    @property
    def strides(self) -> tuple[int, ...]:
        """Byte strides (always C-contiguous)."""
        strides: list[int] = []
        step = self.dtype.itemsize
        for d in reversed(self.shape):
            strides.append(step)
            step *= max(d, 1)
        return tuple(reversed(strides))

    @property
    def memory_info(self) -> MemoryInfo:
        """Memory info of the underlying buffer."""
        return self.buffer.memory_info

    @property
    def device(self) -> MemoryDevice:
        """The memory device the data lives on."""
        return self.buffer.memory_info.device

    @property
    def data_ptr(self) -> int:
        """Device address of the first element."""
        return self.buffer.ptr + self.byte_offset

    @property
    def is_host_accessible(self) -> bool:
        """True when the CPU can read the data directly."""
        return self.device.is_host_accessible

    def numpy(self) -> npt.NDArray[Any]:
        """A zero-copy numpy view of host-accessible data (the view keeps the tensor alive).

        Raises:
            InvalidArgument: the data lives in device memory; copy it to the host first.
        """
        if not self.is_host_accessible:
            raise InvalidArgument(
                f"tensor data lives in device memory {self.memory_info.name!r} ({self.device}), "
                "which the host cannot read; copy it to a host tensor with aioep.copy_tensors"
            )
        if self.buffer.freed:
            raise InvalidArgument(f"tensor buffer {self.buffer!r} was freed")
        if self.dtype.hasobject:
            # A string tensor from a session: the array itself (numpy cannot wrap object
            # pointers from an array interface).
            owner = self.buffer._owner
            assert isinstance(owner, np.ndarray)
            view: npt.NDArray[Any] = owner.view()
            view.flags.writeable = False
            return view
        if self.size == 0:
            # No data to share; numpy < 2.3 refuses an array interface whose data
            # pointer is NULL, which a zero-size buffer may have.
            empty = np.empty(self.shape, self.dtype)
            empty.flags.writeable = not self.buffer.readonly
            return empty
        return np.asarray(_ArrayInterface(self, self.buffer.readonly))

    def __array__(
        self, dtype: npt.DTypeLike | None = None, copy: bool | None = None
    ) -> npt.NDArray[Any]:
        arr = self.numpy()
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            if copy is False:
                raise ValueError(
                    f"Tensor.__array__: converting {arr.dtype} to {np.dtype(dtype)} needs a copy, "
                    "but copy=False was given"
                )
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    def __dlpack_device__(self) -> tuple[int, int]:
        dev = self.device
        if dev.is_host_accessible:
            # Host and pinned memory are exported through numpy, which reports kDLCPU.
            return (_DL_CPU, 0)
        if dev.vendor_id == NVIDIA_VENDOR_ID and dev.device_type is DeviceType.GPU:
            return (_DL_CUDA, dev.device_id)
        return (_DL_EXT_DEV, dev.device_id)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, **kwargs: Any) -> Any:
        if self.is_host_accessible:
            work = self.buffer.pending_work
            if work is not None and stream != -1:
                # Host memory has no stream to order: the data must be ready now (a wait
                # on purpose, which DLPack's synchronous protocol asks for: no loop warning).
                work.impl.wait_on_host(None)
                error = work.exception()
                if error is not None:
                    raise error
            if self.dtype.hasobject:
                raise BufferError(f"{self!r} holds Python objects, which DLPack cannot export")
            # numpy builds the capsule (its destructor and deleter are C); the array's base
            # holds the buffer until the consumer lets go, so free() cannot hand the memory
            # out meanwhile.
            buffer = self.buffer
            arr = ExportedMemory(
                self.data_ptr, self.shape, self.dtype, buffer.readonly, self, buffer
            ).array()
            if max_version is None:
                return arr.__dlpack__(stream=stream)
            return arr.__dlpack__(stream=stream, max_version=max_version, **kwargs)
        exporter = _dlpack_exporters.get(self.device.vendor_id)
        if exporter is None:
            raise BufferError(
                f"tensor in {self.memory_info.name!r} ({self.device}) has no DLPack export; "
                "copy it to host memory first"
            )
        # The array API's dl_device and copy: a device tensor is exported where it is, never
        # copied (a consumer asking for either gets BufferError, as the standard says).
        if kwargs.get("copy"):
            raise BufferError(
                f"{self!r}: DLPack export with copy=True is not supported; copy it with "
                "aioep.copy_tensors"
            )
        dl_device = kwargs.get("dl_device")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(
                f"{self!r} is on DLPack device {self.__dlpack_device__()}, not {dl_device}; "
                "copy it there with aioep.copy_tensors"
            )
        return exporter(self, stream)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3 for tensors in NVIDIA device memory (CuPy, PyTorch, Numba).

        ``stream`` is the handle of the open stream of the last copy that used the buffer
        while it runs, else of the open stream the buffer was allocated on (consumers
        order their work after it), else None. Other tensors have no such attribute
        (``hasattr`` is False).
        """
        dev = self.device
        if not (
            dev.vendor_id == NVIDIA_VENDOR_ID
            and dev.device_type is DeviceType.GPU
            and dev.memory_type.value == "default"
        ):
            raise AttributeError(f"{self!r} is not in CUDA device memory")
        stream = self.buffer.stream
        work = self.buffer.pending_work
        if work is not None and work.stream is not None and not work.stream.closed:
            stream = work.stream
        handle = None if stream is None or getattr(stream, "closed", True) else stream.handle
        # A consumer may hand this memory back to aioep wrapped in its own object: an
        # import then finds this buffer, and its environment's ownership rule applies.
        note_handed_out(self.buffer, (_DL_CUDA, dev.device_id))
        return {
            "version": 3,
            "shape": self.shape,
            "typestr": self.dtype.str,
            "descr": self.dtype.descr,
            "data": (self.data_ptr, self.buffer.readonly),
            "strides": None,
            "stream": handle or None,
        }

    def __repr__(self) -> str:
        return f"<Tensor shape={self.shape} dtype={self.dtype} on {self.memory_info.name!r}>"


class _ArrayStruct(ctypes.Structure):
    """numpy's C array interface (``PyArrayInterface``), behind ``ndarray.__array_struct__``."""

    _fields_ = [
        ("two", ctypes.c_int),
        ("nd", ctypes.c_int),
        ("typekind", ctypes.c_char),
        ("itemsize", ctypes.c_int),
        ("flags", ctypes.c_int),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("data", ctypes.c_void_p),
        ("descr", ctypes.c_void_p),
    ]


def _address_by_interface(array: npt.NDArray[Any]) -> int:
    return int(array.__array_interface__["data"][0])


_capsule_pointer: Any = None
try:
    # A prototype of our own (never the shared ctypes.pythonapi attribute, whose argtypes
    # other libraries set too); PYFUNCTYPE keeps the GIL for this C API call.
    _capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi)
    )
except (AttributeError, OSError):  # pragma: no cover - an interpreter without the C API
    _capsule_pointer = None
_DATA_AT = _ArrayStruct.data.offset
_pointer_at = ctypes.c_void_p.from_address


def checked_host_tensor(array: npt.NDArray[Any], *, readonly: bool) -> Tensor:
    """A tensor over ``array``, which the caller checked is a C-contiguous numpy array of
    plain values (what `Tensor.from_numpy` checks): what numpy knows (address, size,
    shape, dtype) is taken as it is, not derived or validated again."""
    return wrap_array(array, readonly)


def wrap_array(array: npt.NDArray[Any], readonly: bool) -> Tensor:
    """`checked_host_tensor` with a positional flag: the copy fast paths' form."""
    nbytes = array.nbytes
    # A writable one's address comes straight through the buffer protocol (data_address).
    ptr = _address_of(_view_bytes(array)) if nbytes and not readonly else data_address(array)
    # The buffer's and the tensor's fields set directly: numpy vouches for every value.
    buffer = _new_buffer(_ArrayBuffer)
    buffer.ptr = ptr
    buffer.nbytes = nbytes
    buffer.readonly = readonly
    buffer._owner = array
    buffer._last_use = None
    buffer._pins = 0
    buffer._on_release = None
    buffer._released = False
    tensor = _new_tensor(Tensor)
    tensor.shape = array.shape
    tensor.dtype = array.dtype
    tensor._size = array.size
    tensor.nbytes = nbytes
    tensor.buffer = buffer
    tensor.byte_offset = 0
    return tensor


def imported_host_tensor(array: npt.NDArray[Any], producer: object, readonly: bool) -> Tensor:
    """A tensor over a C-contiguous host ``array`` of plain values that ``producer`` handed
    over (DLPack), zero-copy: an `ImportedBuffer` that keeps both alive, built without the
    constructors' checks, which the array already satisfies (the hot path of a host tensor
    imported for a copy)."""
    buffer = _new_buffer(ImportedBuffer)
    buffer.ptr = array.__array_interface__["data"][0]
    buffer.nbytes = nbytes = array.nbytes
    buffer.memory_info = HOST_MEMORY_INFO
    buffer.allocator = None
    buffer.readonly = readonly
    buffer.stream = None
    buffer._owner = (producer, array)
    buffer._pins = 0
    buffer._released = False
    buffer._pin_lock = _PIN_LOCK
    buffer._on_release = None
    buffer._last_use = None
    buffer.producer = producer
    tensor = _new_tensor(Tensor)
    tensor.shape = array.shape
    tensor.dtype = array.dtype
    tensor._size = array.size
    tensor.nbytes = nbytes
    tensor.buffer = buffer
    tensor.byte_offset = 0
    return tensor


def object_tensor(array: npt.NDArray[Any]) -> Tensor:
    """A host-only, read-only tensor over an array of Python objects (an ONNX string
    tensor from or for onnxruntime). `Tensor.numpy` gives the array back; no copy ever
    moves its bytes (the buffer is read-only and no allocator makes object tensors)."""
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array).reshape(array.shape)
    tensor = _new_tensor(Tensor)
    tensor.shape = array.shape
    tensor.dtype = array.dtype
    tensor._size = array.size
    tensor.nbytes = array.nbytes
    tensor.buffer = Buffer(
        array.__array_interface__["data"][0],
        array.nbytes,
        HOST_MEMORY_INFO,
        owner=array,
        readonly=True,
    )
    tensor.byte_offset = 0
    return tensor


_new_tensor = Tensor.__new__
_view_bytes: Callable[[Any], Any] = ctypes.c_char.from_buffer  # an ndarray is a buffer
_address_of = ctypes.addressof


def data_address(array: npt.NDArray[Any]) -> int:
    """The address of a numpy array's first element (0 for an array with no data).

    A writable C-contiguous array's comes through the buffer protocol, any other's from
    numpy's C array interface capsule: a third and a half of the cost of building the
    ``__array_interface__`` dictionary (the fallback without the C API).
    """
    flags = array.flags
    if flags.writeable and flags.c_contiguous and array.nbytes:
        return _address_of(_view_bytes(array))
    if _capsule_pointer is None:  # pragma: no cover
        return _address_by_interface(array)
    address: int | None = _pointer_at(
        _capsule_pointer(array.__array_struct__, None) + _DATA_AT
    ).value
    return address or 0


# vendor id -> exporter; filled by backends through register_dlpack_exporter.
_dlpack_exporters: dict[int, Callable[[Tensor, Any], Any]] = {}


def register_dlpack_exporter(vendor_id: int, exporter: Callable[[Tensor, Any], Any]) -> bool:
    """Let ``Tensor.__dlpack__`` export tensors in device memory of ``vendor_id``.

    ``exporter(tensor, stream)`` gets a tensor whose memory is not host accessible
    and whose device has this vendor id, and the consumer's ``stream`` argument
    as the DLPack protocol passes it; it returns a DLPack capsule or raises
    ``BufferError``. The capsule's device must agree with ``Tensor.__dlpack_device__``
    (``kDLCUDA`` for NVIDIA GPU memory, else ``kDLExtDev``). Host-accessible tensors
    are always exported through numpy. A backend registers its exporter when it is
    imported.

    Returns:
        True if ``exporter`` now serves ``vendor_id``; False if another exporter
        was registered for it first (the first one stays).

    Raises:
        InvalidArgument: ``vendor_id`` is not an int >= 0 or ``exporter`` is not callable.
    """
    if not isinstance(vendor_id, int) or isinstance(vendor_id, bool) or vendor_id < 0:
        raise InvalidArgument(f"vendor_id must be an int >= 0, got {vendor_id!r}")
    if not callable(exporter):
        raise InvalidArgument(f"exporter must be callable, got {type(exporter).__name__}")
    # == rather than `is`: a bound method is a new object on every attribute access.
    return bool(_dlpack_exporters.setdefault(vendor_id, exporter) == exporter)


def tensor_layout(
    where: str, shape: Sequence[int] | int, dtype: npt.DTypeLike
) -> tuple[tuple[int, ...], np.dtype[Any], int, int]:
    """``(dims, dtype, elements, nbytes)`` of a tensor, ``shape`` and ``dtype`` each checked
    once (a plain int or a tuple of ints and a dtype seen before take the short path).

    Raises:
        InvalidArgument: naming ``where``: the shape is not an int or a sequence of ints
            >= 0, is too large, or the dtype is not a numpy dtype or holds objects.
    """
    dims: tuple[int, ...] | None = None
    if type(shape) is int:
        if 0 <= shape <= MAX_DIM:
            dims, size = (shape,), shape
    elif type(shape) is tuple and len(shape) <= _MAX_NDIM:
        size = 1
        for d in shape:
            if type(d) is not int or d < 0:
                break
            size *= d
        else:
            if size <= MAX_DIM:
                dims = shape
    if dims is None:
        dims = _normalize_shape(shape)
        size = 1
        for d in dims:
            size *= d
    try:
        dt = _DTYPES[dtype]
    except (KeyError, TypeError):  # TypeError: an unhashable dtype-like (a field list)
        dt = check_dtype(where, dtype)
        if dt.hasobject:
            raise InvalidArgument(f"{where}: dtype {dt} holds Python objects") from None
        if (type(dtype) in (str, type) or isinstance(dtype, np.dtype)) and len(_DTYPES) < 256:
            _DTYPES[dtype] = dt
    return dims, dt, size, size * dt.itemsize


_DTYPES: dict[Any, np.dtype[Any]] = {}  # dtype-likes (names, types, dtypes) already checked


def tensor_over(
    buffer: Buffer, dims: tuple[int, ...], dtype: np.dtype[Any], size: int, nbytes: int
) -> Tensor:
    """A tensor over the start of ``buffer`` for a layout that `tensor_layout` gave
    (``env.empty``: shape and dtype are checked once, not again here).

    Raises:
        InvalidArgument: ``buffer`` is not an aioep.Buffer of at least ``nbytes`` (an
            allocator that broke its contract).
    """
    if not isinstance(buffer, Buffer) or buffer.nbytes < nbytes:
        raise InvalidArgument(
            f"Tensor: an allocator gave {buffer!r} for {nbytes} bytes (shape {dims}, dtype "
            f"{dtype}); it must give an aioep.Buffer of at least that size"
        )
    tensor = Tensor.__new__(Tensor)
    tensor.shape = dims
    tensor.dtype = dtype
    tensor._size = size
    tensor.nbytes = nbytes
    tensor.buffer = buffer
    tensor.byte_offset = 0
    return tensor


def _normalize_shape(shape: Sequence[int] | int) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        dims: tuple[Any, ...] = (shape,)
    elif isinstance(shape, (str, bytes, Mapping)) or not isinstance(shape, Iterable):
        raise InvalidArgument(
            f"shape must be an int or a sequence of ints >= 0, got {describe(shape)}"
        )
    else:
        try:
            dims = tuple(shape)
        except TypeError as exc:  # a 0-d array, an iterable that refuses to iterate
            raise InvalidArgument(
                f"shape must be an int or a sequence of ints >= 0, got {describe(shape)}"
            ) from exc
    out: list[int] = []
    size = 1
    for d in dims:
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 0:
            raise InvalidArgument(f"shape {dims!r}: every dimension must be an int >= 0")
        out.append(int(d))
        size *= int(d)
    if len(out) > _MAX_NDIM or size > MAX_DIM:
        raise InvalidArgument(
            f"shape {tuple(out)!r}: too large ({len(out)} dimensions, {size} elements; at most "
            f"{_MAX_NDIM} dimensions and {MAX_DIM} elements)"
        )
    return tuple(out)


_MAX_NDIM = 64  # numpy's limit


def as_tensor(value: object, *, role: str, writable: bool = False) -> Tensor:
    """Accept a Tensor or a numpy array (wrapped zero-copy) for an argument named ``role``."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous:
            if writable:
                raise InvalidArgument(
                    f"{role}: destination array of shape {value.shape} is not C-contiguous"
                )
            value = np.ascontiguousarray(value)
        return Tensor.from_numpy(value)
    raise InvalidArgument(
        f"{role}: expected an aioep.Tensor or numpy.ndarray, got {type(value).__name__}"
    )
