"""Reading a model's initializers and validating their external data references.

The rules are ONNX Runtime's (``ExternalDataInfo::Create``, ``ValidateExternalDataPath``,
``GetExternalDataInfo``; notes/ort_reference.md items 53-59), applied to every
initializer before anything is allocated or read:

- the ``external_data`` keys are ``location``, ``offset``, ``length`` and ``checksum``,
  each with a non-empty value; anything else is a model format error;
- ``location`` is relative, and ``weakly_canonical(model_dir / location)`` (symlinks
  resolved) lies inside ``weakly_canonical(model_dir)``, compared component by component;
- ``offset`` and ``length`` are decimal integers that fit ORT's ``ptrdiff_t`` and
  ``size_t`` ("Failed to parse value" otherwise) and are non-negative;
- ``length`` equals the tensor's byte size; when absent it means "to the end of the
  file", which must then equal it; ``offset + length`` lies within the file;
- the file exists (else `NoSuchFile`) and is a regular file;
- string and undefined tensors are refused, and so are ORT's in-memory address tags.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._base.errors import ErrorCode, InvalidArgument, NoSuchFile, NotImplementedByEp
from .._base.paths import resolve_location

__all__ = [
    "ExternalData",
    "InitializerSpec",
    "check_external_data",
    "read_initializers",
    "resolve_location",
]

_KNOWN_KEYS = frozenset({"location", "offset", "length", "checksum"})
_MEM_ADDR_TAG = "*/_ORT_MEM_ADDR_/*"  # ORT's tag for initializers that point into process memory
_OFFSET_MAX = 2**63 - 1  # ORT parses offset as ptrdiff_t
_LENGTH_MAX = 2**64 - 1  # and length as size_t
_INTEGER = re.compile(r"-?[0-9]+")
# onnx data types whose elements are packed several to a byte: numpy has no such layout.
# (type name -> bits per element)
_SUB_BYTE_BITS = {"INT4": 4, "UINT4": 4, "FLOAT4E2M1": 4, "INT2": 2, "UINT2": 2}


@dataclass(frozen=True)
class ExternalData:
    """A validated external data reference: ``length`` bytes at ``offset`` of ``path``."""

    location: str
    """The location as written in the model."""
    path: str
    """The resolved absolute path (symlinks followed), inside the model's directory."""
    offset: int
    length: int


@dataclass(frozen=True)
class InitializerSpec:
    """One initializer to load: its shape, dtype and where its bytes come from."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    nbytes: int
    external: ExternalData | None
    inline: npt.NDArray[Any] | None
    """The data of an initializer stored in the model itself (C-contiguous)."""


def _format_error(name: str, what: str) -> InvalidArgument:
    return InvalidArgument(
        f"model format error! initializer {name!r}: {what}", code=ErrorCode.INVALID_PROTOBUF
    )


def _parse_int(name: str, key: str, value: str, maximum: int) -> int:
    # The length first: int() refuses strings of over 4,300 digits with its own ValueError,
    # and no value in range has more digits than the maximum (a sign aside).
    if (
        not _INTEGER.fullmatch(value)
        or len(value.lstrip("-").lstrip("0")) > len(str(maximum))
        or int(value) > maximum
    ):
        shown = value if len(value) <= 40 else f"{value[:20]}...({len(value)} characters)"
        raise InvalidArgument(
            f"initializer {name!r}: Failed to parse value {shown!r} of external data key "
            f"{key!r} as an integer in [0, {maximum}]"
        )
    number = int(value)
    if number < 0:
        raise InvalidArgument(
            f"initializer {name!r}: external data {key} must be >= 0, got {number}"
        )
    return number


def _dtype_of(tensor: Any) -> np.dtype[Any]:
    from onnx import TensorProto, helper

    name = tensor.name
    data_type = int(tensor.data_type)
    if data_type == TensorProto.STRING:
        raise InvalidArgument(
            f"initializer {name!r} is a string tensor; string tensors cannot be placed in "
            "device memory or loaded from external data"
        )
    if data_type == TensorProto.UNDEFINED:
        raise _format_error(name, "data type is UNDEFINED")
    sub_byte = {getattr(TensorProto, t, None) for t in _SUB_BYTE_BITS} - {None}
    if data_type in sub_byte:
        raise NotImplementedByEp(
            f"initializer {name!r}: data type {TensorProto.DataType.Name(data_type)} packs "
            "several elements per byte, which aioep tensors cannot hold yet"
        )
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(data_type))
    except (KeyError, ValueError, TypeError) as exc:
        raise _format_error(name, f"unknown data type {data_type}") from exc


def _external_info(tensor: Any, nbytes: int, base_dir: str) -> ExternalData:
    name = tensor.name
    entries: dict[str, str] = {}
    for entry in tensor.external_data:
        key, value = entry.key, entry.value
        if not key or not value:
            raise _format_error(
                name, f"Need a key and a value for the external data info, got {key!r}={value!r}"
            )
        if key not in _KNOWN_KEYS:
            raise _format_error(
                name,
                f"unknown external data key {key!r} (known: {', '.join(sorted(_KNOWN_KEYS))})",
            )
        if key in entries:
            raise _format_error(name, f"external data key {key!r} appears twice")
        entries[key] = value
    location = entries.get("location")
    if location is None:
        raise _format_error(name, "Missing 'location' in its external data info")
    if location == _MEM_ADDR_TAG:
        raise InvalidArgument(
            f"initializer {name!r}: The model contains initializers with arbitrary in-memory "
            "references, which are not supported by external data loading"
        )
    offset = (
        _parse_int(name, "offset", entries["offset"], _OFFSET_MAX) if "offset" in entries else 0
    )
    length = (
        _parse_int(name, "length", entries["length"], _LENGTH_MAX) if "length" in entries else None
    )
    path = resolve_location(base_dir, location, name)
    if length is not None and length != nbytes:
        raise InvalidArgument(
            f"initializer {name!r}: external data size mismatch: length {length} in the model, "
            f"but the tensor holds {nbytes} bytes"
        )
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise NoSuchFile(
            f"external data file of initializer {name!r} does not exist: {location!r} "
            f"(resolved to {path!r})"
        ) from exc
    except OSError as exc:
        raise InvalidArgument(
            f"initializer {name!r}: cannot stat external data file {path!r}: {exc}"
        ) from exc
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(
            f"initializer {name!r}: external data location {location!r} is not a regular file"
        )
    size = st.st_size
    if offset > size:
        raise InvalidArgument(
            f"initializer {name!r}: external data offset {offset} lies beyond the end of "
            f"{location!r} ({size} bytes)"
        )
    if length is None:
        length = size - offset
        if length != nbytes:
            raise InvalidArgument(
                f"initializer {name!r}: external data size mismatch: {location!r} holds {length} "
                f"bytes from offset {offset} to its end, but the tensor holds {nbytes} bytes"
            )
    elif offset + length > size:
        raise InvalidArgument(
            f"initializer {name!r}: external data range [{offset}, {offset + length}) lies "
            f"beyond the end of {location!r} ({size} bytes)"
        )
    return ExternalData(location, path, offset, length)


def _spec(tensor: Any, base_dir: str) -> InitializerSpec:
    from onnx import TensorProto, numpy_helper

    name = tensor.name
    dims = tuple(int(d) for d in tensor.dims)
    if any(d < 0 for d in dims):
        raise _format_error(name, f"negative dimension in shape {dims}")
    dtype = _dtype_of(tensor)
    count = 1
    for d in dims:
        count *= d
    nbytes = count * dtype.itemsize
    if tensor.data_location == TensorProto.EXTERNAL:
        info = _external_info(tensor, nbytes, base_dir)
        return InitializerSpec(name, dims, dtype, nbytes, info, None)
    if len(tensor.external_data):
        raise _format_error(name, "has external_data entries but data_location is not EXTERNAL")
    try:
        array = np.ascontiguousarray(numpy_helper.to_array(tensor))
    except Exception as exc:
        raise _format_error(name, f"cannot read its inline data: {exc}") from exc
    if array.shape != dims or array.dtype != dtype:
        raise _format_error(
            name,
            f"inline data has shape {array.shape} and dtype {array.dtype}, "
            f"expected {dims} and {dtype}",
        )
    return InitializerSpec(name, dims, dtype, nbytes, None, array)


def check_external_data(tensors: Iterable[Any], base_dir: str) -> list[ExternalData]:
    """Validate the external data reference of each of ``tensors`` (``onnx.TensorProto``) kept
    in a file, by the rules above, without reading any data; the others are skipped.

    A session checks its model with this before anything runs, whichever EP reads the data
    (packed sub-byte types included: onnxruntime's CPU EP reads them). Blocking (it stats the
    files): run it off the event loop.

    Raises:
        NoSuchFile: an external data file does not exist.
        InvalidArgument: a reference breaks one of the rules above.
    """
    from onnx import TensorProto

    found = []
    for tensor in tensors:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        name = tensor.name
        data_type = int(tensor.data_type)
        dims = tuple(int(d) for d in tensor.dims)
        if any(d < 0 for d in dims):
            raise _format_error(name, f"negative dimension in shape {dims}")
        count = 1
        for d in dims:
            count *= d
        bits = next(
            (b for t, b in _SUB_BYTE_BITS.items() if getattr(TensorProto, t, None) == data_type),
            None,
        )
        nbytes = (count * bits + 7) // 8 if bits else count * _dtype_of(tensor).itemsize
        found.append(_external_info(tensor, nbytes, base_dir))
    return found


def read_initializers(model_path: str, names: Sequence[str] | None) -> list[InitializerSpec]:
    """Read the model's graph (no external data) and validate the chosen initializers.

    Blocking (it parses the model and stats files): run it off the event loop.

    Raises:
        NoSuchFile: the model or an external data file does not exist.
        InvalidArgument: the model or an initializer breaks one of the rules above.
    """
    import onnx

    model_path = os.path.abspath(model_path)
    if not os.path.isfile(model_path):
        raise NoSuchFile(f"load_initializers: model file {model_path!r} does not exist")
    try:
        model = onnx.load(model_path, load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and onnx's own errors
        raise InvalidArgument(
            f"load_initializers: {model_path!r} is not a valid ONNX model: {exc}",
            code=ErrorCode.INVALID_PROTOBUF,
        ) from exc
    by_name: dict[str, Any] = {}
    for tensor in model.graph.initializer:
        if tensor.name in by_name:
            raise _format_error(tensor.name, "more than one initializer has this name")
        by_name[tensor.name] = tensor
    if names is None:
        chosen = list(by_name)
    else:
        chosen = list(dict.fromkeys(names))
        missing = [n for n in chosen if n not in by_name]
        if missing:
            raise InvalidArgument(
                f"load_initializers: {model_path!r} has no initializer(s) named {missing}"
            )
    base_dir = os.path.dirname(os.path.abspath(model_path))
    return [_spec(by_name[n], base_dir) for n in chosen]
