"""Foreign tensors: objects of other libraries (PyTorch, CuPy, JAX, numba...) taken
zero-copy wherever aioep takes a tensor, through DLPack (``__dlpack__`` /
``__dlpack_device__``) or the CUDA Array Interface (``__cuda_array_interface__``).

The registered backends' `MemoryImporter` hooks say which device owns
the memory; the result is a `Tensor` over an `ImportedBuffer`, which keeps
the producer alive, calls the DLPack deleter when it dies, and is never freed by aioep.
Stream order follows the array API standard: the producer gets the consumer's stream in
``__dlpack__(stream=...)``; a CUDA Array Interface's ``stream`` is waited on (on the
device where the copy has a stream, else on a worker thread before the copy runs).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base.errors import InvalidArgument
from .._base.validate import describe
from .._plugin.buffer import Buffer, ImportedBuffer
from .._plugin.exports import handed_out
from .._plugin.importer import MemoryImporter
from .._plugin.notification import Notification
from .._plugin.stream import SyncStream
from .._plugin.stream_impl import NotificationImpl, StreamImpl
from .._plugin.tensor import Tensor, imported_host_tensor
from .dlpack import (
    MAX_VERSION,
    DLDeviceType,
    exported_buffer,
    is_legacy_import,
    numpy_dtype_bits,
    read_capsule,
)

if TYPE_CHECKING:
    from .._plugin.factory import EpFactory

__all__ = [
    "as_tensor",
    "import_copy_args",
    "import_feeds",
    "import_value",
    "importers_of",
    "is_foreign",
]

_NUMPY_READS_FLAGS = int(np.__version__.split(".")[0]) >= 2
"""numpy >= 2 reads DLPack's read-only flag; numpy 1.x marks every import read-only (and
cannot read a versioned capsule), so there aioep reads the capsule itself."""
_cache: weakref.WeakKeyDictionary[EpFactory, MemoryImporter | None] = weakref.WeakKeyDictionary()


def importers_of(factories: Iterable[EpFactory]) -> list[MemoryImporter]:
    """The memory importers of ``factories`` (each factory's one, made on first use)."""
    out = []
    for factory in factories:
        try:
            importer = _cache[factory]
        except KeyError:
            importer = _cache[factory] = factory.create_memory_importer()
        if importer is not None:
            out.append(importer)
    return out


def is_foreign(value: object) -> bool:
    """True for an object aioep takes through DLPack or the CUDA Array Interface (not a
    Tensor or numpy array, which are taken as they are)."""
    t = type(value)
    if t is Tensor or t is np.ndarray or isinstance(value, (Tensor, np.ndarray)):
        return False
    if hasattr(t, "__dlpack__"):
        return True
    try:
        return hasattr(value, "__cuda_array_interface__")
    except Exception:  # a property that raises: as_tensor names the error
        return True


def import_copy_args(
    src: Sequence[Any],
    dst: Sequence[Any],
    importers: Callable[[], Sequence[MemoryImporter]],
    stream: SyncStream | None,
) -> tuple[Sequence[Any], Sequence[Any], list[NotificationImpl]]:
    """``src`` and ``dst`` of a ``copy_tensors`` call with foreign objects imported (the
    lists themselves when they hold none), and the producers' work the copy must wait for.
    ``importers()`` gives the registered importers (only called for memory other than host
    RAM). Anything else (not a list or tuple, not a tensor) is left for the copy's own
    validation to name."""
    waits: list[NotificationImpl] = []
    lists: list[Sequence[Any]] = [src, dst]
    for k, values in enumerate(lists):
        if type(values) is not list and type(values) is not tuple:
            continue
        out: list[Any] | None = None
        for i, v in enumerate(values):
            t = type(v)
            if t is Tensor or t is np.ndarray:
                continue
            if hasattr(t, "__dlpack_device__") and hasattr(t, "__dlpack__"):
                # Inline the common case, a host array handed over by DLPack: this is the
                # per-call overhead of every such copy.
                try:
                    device = v.__dlpack_device__()
                    host = int(device[0]) == DLDeviceType.CPU
                except Exception:
                    host = False  # as_tensor reports it
                if host:
                    if out is None:
                        out = list(values)
                    out[i] = _from_host_dlpack(v, _ROLES[k], i, k == 1)
                    continue
            if not is_foreign(v):
                continue  # not ours to judge: the copy's validation names what is wrong
            if out is None:
                out = list(values)
            impl = None if stream is None or not isinstance(stream, SyncStream) else stream.impl
            out[i], wait = as_tensor(
                v, role=f"copy_tensors {_ROLES[k]} {i}", writable=k == 1, importers=importers,
                stream=impl,
            )  # fmt: skip
            if wait is not None:
                waits.append(wait)
        if out is not None:
            lists[k] = out
    return lists[0], lists[1], waits


_ROLES = ("source", "destination")


def import_value(
    importers: Callable[[], list[MemoryImporter]],
    value: object,
    role: str,
    *,
    writable: bool = False,
) -> tuple[Tensor | np.ndarray[Any, Any], NotificationImpl | None]:
    """`as_tensor` with the environment's ``importers`` and no stream (a value bound for
    later use: IOBinding)."""
    return as_tensor(value, role=role, writable=writable, importers=importers, stream=None)


async def import_feeds(
    importers: Callable[[], list[MemoryImporter]], inputs: Any, stream: SyncStream | None
) -> Any:
    """A session run's ``inputs`` with foreign values imported (the mapping itself when it
    holds none). The producers' pending work is waited for: on ``stream``, on the device,
    or awaited here without blocking the loop."""
    if not isinstance(inputs, Mapping) or not any(is_foreign(v) for v in inputs.values()):
        return inputs
    impl = None if stream is None else stream.impl
    out = dict(inputs)
    waits: list[NotificationImpl] = []
    for name, value in inputs.items():
        if is_foreign(value):
            out[name], wait = as_tensor(
                value, role=f"run: input {name!r}", writable=False,
                importers=importers, stream=impl,
            )  # fmt: skip
            if wait is not None:
                waits.append(wait)
    for wait in waits:
        if stream is not None:
            stream.wait(Notification(wait))
        else:
            await Notification(wait)
    return out


def as_tensor(
    value: object,
    *,
    role: str,
    writable: bool,
    importers: Callable[[], Sequence[MemoryImporter]],
    stream: StreamImpl | None = None,
) -> tuple[Tensor | np.ndarray[Any, Any], NotificationImpl | None]:
    """Wrap a foreign object zero-copy for the argument named ``role``.

    Returns the tensor (or, for strided host memory read as a source, a numpy view the
    copy packs) and the producer's pending work to wait for (None: nothing). ``stream``
    is the backend stream the memory will be used on (None: none). ``importers()`` gives
    the registered importers; host RAM (``kDLCPU``) is the built-in host device's and
    needs none.

    Raises:
        InvalidArgument: no registered device owns the memory, the dtype or layout is
            unsupported, the producer refused, or ``writable`` and it is read-only.
    """
    t = type(value)
    if hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__"):
        return _from_dlpack(value, role, writable, importers, stream)
    try:
        cai = getattr(value, "__cuda_array_interface__", None)
    except Exception as exc:
        raise InvalidArgument(
            f"{role}: {t.__name__}.__cuda_array_interface__ raised {type(exc).__name__}: {exc}"
        ) from exc
    if cai is not None:
        return _from_cai(value, cai, role, writable, importers, stream)
    raise InvalidArgument(
        f"{role}: expected an aioep.Tensor, a numpy array or an object with __dlpack__ or "
        f"__cuda_array_interface__, got {t.__name__}"
    )


def _device_name(device_type: int) -> str:
    try:
        return f"kDL{DLDeviceType(device_type).name.title().replace('_', '')}"
    except ValueError:
        return f"DLPack device type {device_type}"


def _from_dlpack(
    value: Any,
    role: str,
    writable: bool,
    importers: Callable[[], Sequence[MemoryImporter]],
    stream: StreamImpl | None,
) -> tuple[Tensor | np.ndarray[Any, Any], NotificationImpl | None]:
    try:
        device = value.__dlpack_device__()
        device_type, device_id = int(device[0]), int(device[1])
    except Exception as exc:
        raise InvalidArgument(
            f"{role}: {type(value).__name__}.__dlpack_device__() failed: {exc}"
        ) from exc
    if device_type == DLDeviceType.CPU:
        # Host RAM: the built-in host device owns it (its importer says HOST_MEMORY_INFO).
        return _from_host_dlpack(value, role, None, writable), None
    name = type(value).__name__
    owners = [imp for imp in importers() if device_type in imp.dlpack_device_types]
    if not owners:
        raise InvalidArgument(
            f"{role}: {name} lives on {_device_name(device_type)} device {device_id}, which "
            "no registered backend owns"
        )
    producer_stream = owners[0].dlpack_stream(device_type, device_id, stream)
    try:
        try:
            capsule = value.__dlpack__(stream=producer_stream, max_version=MAX_VERSION)
        except TypeError:  # a producer older than DLPack 1.0 takes no max_version
            capsule = value.__dlpack__(stream=producer_stream)
    except InvalidArgument:
        raise
    except Exception as exc:
        raise InvalidArgument(f"{role}: {name}.__dlpack__ failed: {exc}") from exc
    try:
        view = read_capsule(capsule)
    except BufferError as exc:
        raise InvalidArgument(
            f"{role}: {name}.__dlpack__ gave a capsule aioep cannot use: {exc}"
        ) from exc
    del capsule
    try:
        if (view.device_type, view.device_id) != (device_type, device_id):
            raise InvalidArgument(
                f"{role}: {name}.__dlpack__ gave a tensor on device "
                f"({view.device_type}, {view.device_id}), but __dlpack_device__ said "
                f"({device_type}, {device_id})"
            )
        if not view.c_contiguous:
            raise InvalidArgument(
                f"{role}: {name} of shape {view.shape} has strides {view.strides} (elements); "
                "device memory must be C-contiguous (make a contiguous copy first)"
            )
        if writable and view.readonly:
            raise InvalidArgument(
                f"{role}: {name} is read-only (DLPack flag); it cannot be written"
            )
        nbytes = view.nbytes
        # aioep's own memory, whoever wrapped it since (one of its capsules, or memory it
        # handed out): that buffer, so that its environment's ownership rule applies.
        mine = exported_buffer(view) or handed_out(device_type, device_id, view.data, nbytes)
        owner, info = _adopt(owners, device_type, device_id, view.data, nbytes)
        if info is None and mine is None:
            raise InvalidArgument(
                f"{role}: {name}'s memory ({nbytes} bytes at {view.data:#x} on "
                f"{_device_name(device_type)} device {device_id}) is owned by no registered "
                "device"
            )
        wait = None if info is None else owner.producer_work(info, producer_stream, stream)
        if mine is not None:
            # The buffer keeps the memory alive: the producer's hold is not needed.
            view.release()
            return _over(mine, view.shape, view.dtype, view.data, role), wait
        buffer = ImportedBuffer(
            view.data, nbytes, info, producer=value, keep=view, release=view.release,
            readonly=view.readonly,
        )  # fmt: skip
    except BaseException:
        view.release()
        raise
    return Tensor(buffer, view.shape, view.dtype), wait


def _over(buffer: Buffer, shape: tuple[int, ...], dtype: Any, ptr: int, role: str) -> Tensor:
    """A tensor over ``buffer`` (aioep memory that came back wrapped) at address ``ptr``."""
    try:
        return Tensor(buffer, shape, dtype, byte_offset=ptr - buffer.ptr)
    except InvalidArgument as exc:  # pragma: no cover - handed_out checked the bounds
        raise InvalidArgument(f"{role}: {exc}") from exc


def _from_host_dlpack(
    value: Any, kind: str, index: int | None, writable: bool
) -> Tensor | np.ndarray[Any, Any]:
    """A host tensor over ``value``'s ``kDLCPU`` memory (a strided source: a numpy view the
    copy packs). ``kind`` and ``index`` name the argument (``index`` None: ``kind`` is the
    whole name)."""
    # numpy reads the capsule in C (DLPack 1.x, the read-only flag, the deleter) and gives
    # a view that owns the managed tensor; host memory takes no stream (None).
    try:
        array: np.ndarray[Any, Any] = (
            np.from_dlpack(value) if _NUMPY_READS_FLAGS else _host_array_of_capsule(value)
        )
    except Exception as exc:
        raise InvalidArgument(
            f"{_role(kind, index)}: {type(value).__name__} could not be read through DLPack: {exc}"
        ) from exc
    flags = array.flags
    if writable and not flags.writeable:
        if not is_legacy_import(array):
            raise InvalidArgument(
                f"{_role(kind, index)}: {type(value).__name__} is read-only (DLPack flag); it "
                "cannot be written"
            )
        # numpy >= 2 marks a legacy (pre-1.0) capsule's memory read-only: that ABI has no
        # read-only flag at all. aioep writes into it as into a legacy device capsule, as
        # PyTorch and CuPy do: a producer that may not grant writes refuses to export a
        # legacy capsule (numpy's and aioep's own exports do).
        array = np.asarray(_Writable(array))
        flags = array.flags
    if not flags.c_contiguous:
        if writable:
            raise InvalidArgument(
                f"{_role(kind, index)}: destination {type(value).__name__} of shape "
                f"{array.shape} is not C-contiguous (strides {array.strides})"
            )
        return array  # a source: the copy packs it (off the loop when large)
    # The hot path of a host tensor handed over by DLPack.
    return imported_host_tensor(array, value, not flags.writeable)


class _HostCapsuleArray:
    """A consumed ``kDLCPU`` capsule as numpy's array interface: the array made from it
    keeps this object (and so the producer's managed tensor) alive; the deleter runs when
    it goes."""

    def __init__(self, value: Any) -> None:
        try:
            capsule = value.__dlpack__(stream=None, max_version=MAX_VERSION)
        except TypeError:  # a producer older than DLPack 1.0 takes no max_version
            capsule = value.__dlpack__(stream=None)
        view = read_capsule(capsule)
        self._finalizer = weakref.finalize(self, view.release)
        if view.device_type != DLDeviceType.CPU:
            self._finalizer()
            raise BufferError(
                f"the capsule is on DLPack device type {view.device_type}, not kDLCPU"
            )
        itemsize = view.dtype.itemsize
        self.__array_interface__ = {
            "version": 3,
            "data": (view.data, view.readonly),
            "shape": view.shape,
            "typestr": view.dtype.str,
            "strides": None if view.strides is None else tuple(s * itemsize for s in view.strides),
        }


class _Writable:
    """A writable array interface over a read-only numpy array's memory (keeping it)."""

    __slots__ = ("__array_interface__", "base")

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.base = array
        interface = dict(array.__array_interface__)
        interface["data"] = (interface["data"][0], False)
        self.__array_interface__ = interface


def _host_array_of_capsule(value: Any) -> np.ndarray[Any, Any]:
    return np.asarray(_HostCapsuleArray(value))


def _role(kind: str, index: int | None) -> str:
    return kind if index is None else f"copy_tensors {kind} {index}"


def _adopt(
    importers: Iterable[MemoryImporter], device_type: int, device_id: int, ptr: int, nbytes: int
) -> tuple[MemoryImporter, Any]:
    first: MemoryImporter | None = None
    for imp in importers:
        first = first or imp
        info = imp.adopt(device_type, device_id, ptr, nbytes)
        if info is not None:
            return imp, info
    return first or MemoryImporter(), None


def _from_cai(
    value: Any,
    cai: Any,
    role: str,
    writable: bool,
    importers: Callable[[], Sequence[MemoryImporter]],
    stream: StreamImpl | None,
) -> tuple[Tensor, NotificationImpl | None]:
    name = type(value).__name__
    what = f"{role}: {name}.__cuda_array_interface__"
    shape, dtype, ptr, readonly, producer_stream = _read_cai(cai, what)
    if writable and readonly:
        raise InvalidArgument(f"{what}: the data is read-only (data[1] is True)")
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if ptr == 0 and nbytes:
        raise InvalidArgument(f"{what}: data[0] is a null pointer for {nbytes} bytes of data")
    # The interface names no device: aioep's own memory is found by the buffer that handed
    # it out (its environment's ownership rule then applies), other memory by each
    # importer from the pointer.
    mine = handed_out(DLDeviceType.CUDA, -1, ptr, nbytes)
    owner, info = _adopt(importers(), DLDeviceType.CUDA, -1, ptr, nbytes)
    if info is None and mine is None:
        raise InvalidArgument(
            f"{what}: {nbytes} bytes at {ptr:#x} are memory that no registered device owns"
        )
    wait = None
    if producer_stream is not None and info is not None:
        wait = owner.producer_work(info, producer_stream, stream)
    if mine is not None:
        return _over(mine, shape, dtype, ptr, role), wait
    buffer = ImportedBuffer(ptr, nbytes, info, producer=value, readonly=readonly)
    return Tensor(buffer, shape, dtype), wait


_DEVICE_BITS = numpy_dtype_bits()  # a CAI's f16 is numpy's long double: as in DLPack


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _read_cai(cai: Any, what: str) -> tuple[tuple[int, ...], np.dtype[Any], int, bool, int | None]:
    """Shape, dtype, data pointer, read-only flag and producer stream (None: none) of a CUDA
    Array Interface, every field checked (InvalidArgument naming the field and its value)."""
    if not isinstance(cai, Mapping):
        raise InvalidArgument(f"{what} must be a dict, got {describe(cai)}")
    try:
        keys = ("version", "shape", "typestr", "data", "strides", "stream", "mask")
        fields: dict[str, Any] = {k: cai.get(k) for k in keys}
    except Exception as exc:
        raise InvalidArgument(f"{what} could not be read: {type(exc).__name__}: {exc}") from exc
    version = fields["version"]
    if not _is_int(version) or int(version) < 0:
        raise InvalidArgument(f"{what}: version must be an int, got {describe(version)}")
    shape_in = fields["shape"]
    if not isinstance(shape_in, (tuple, list)) or not all(_is_int(d) and d >= 0 for d in shape_in):
        raise InvalidArgument(
            f"{what}: shape must be a tuple of ints >= 0, got {describe(shape_in)}"
        )
    shape = tuple(int(d) for d in shape_in)
    typestr = fields["typestr"]
    try:
        if not isinstance(typestr, str):
            raise TypeError("not a str")
        dtype = np.dtype(typestr)
    except Exception as exc:
        raise InvalidArgument(
            f"{what}: typestr must be a numpy type string, got {describe(typestr)}"
        ) from exc
    if (
        dtype.hasobject
        or dtype.byteorder == ">"
        or dtype.kind not in "biufc"
        or dtype.itemsize * 8 not in _DEVICE_BITS.get(dtype.kind, (8, 16, 32, 64))
    ):
        raise InvalidArgument(f"{what}: unsupported dtype {dtype} ({typestr!r})")
    data = fields["data"]
    if (
        not isinstance(data, (tuple, list))
        or len(data) != 2
        or not (data[0] is None or (_is_int(data[0]) and data[0] >= 0))
        or not isinstance(data[1], (bool, np.bool_))
    ):
        raise InvalidArgument(
            f"{what}: data must be a tuple (pointer: int, read_only: bool), got {describe(data)}"
        )
    ptr, readonly = int(data[0] or 0), bool(data[1])
    strides = fields["strides"]
    if strides is not None:
        if (
            not isinstance(strides, (tuple, list))
            or len(strides) != len(shape)
            or not all(_is_int(s) for s in strides)
        ):
            raise InvalidArgument(
                f"{what}: strides must be None or a tuple of {len(shape)} int(s) (bytes per "
                f"step), got {describe(strides)}"
            )
        step = dtype.itemsize
        for d, st in zip(reversed(shape), reversed(strides)):
            if d != 1 and st != step:
                raise InvalidArgument(
                    f"{what}: shape {shape} with byte strides {tuple(strides)} is not "
                    "C-contiguous; device memory must be (make a contiguous copy first)"
                )
            step *= d
    if fields["mask"] is not None:
        raise InvalidArgument(f"{what}: masked arrays are not supported")
    producer_stream = fields["stream"] if int(version) >= 3 else None
    if producer_stream is not None:
        if not _is_int(producer_stream):
            raise InvalidArgument(
                f"{what}: stream must be None or an int (a stream handle), got "
                f"{describe(producer_stream)}"
            )
        producer_stream = int(producer_stream)
        if producer_stream == 0:
            raise InvalidArgument(
                f"{what}: stream 0 is disallowed (ambiguous); use 1, 2 or a handle"
            )
    return shape, dtype, ptr, readonly, producer_stream
