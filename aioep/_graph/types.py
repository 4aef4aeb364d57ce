"""The elements of a graph view: values (`ValueInfo`), nodes (`Node`) and
constant tensors (`Initializer`), read from the ``onnx`` package's protos."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._base.errors import ErrorCode, InvalidArgument, NoSuchFile, import_optional
from .._base.paths import resolve_location

__all__ = ["Dim", "Initializer", "Node", "ValueInfo"]

Dim = int | str | None


def _onnx() -> Any:
    return import_optional("onnx", "aioep sessions")


@dataclass(frozen=True)
class ValueInfo:
    """Type and shape of a value; ``shape`` is None when the rank is unknown and a
    dimension is an int, a symbolic name (str) or None when unknown.

    ``kind`` is the ONNX type's kind: ``"tensor"``, ``"sequence"``, ``"optional"``,
    ``"map"``, ``"sparse_tensor"``, ``"opaque"``, or ``"unknown"`` where the type is
    not known; ``elem_type`` and ``shape`` describe tensors only (0 and None
    otherwise). ``type_proto`` is the ``onnx.TypeProto`` of a value that is not a
    tensor (None for tensors and unknown types).
    """

    name: str
    elem_type: int
    shape: tuple[Dim, ...] | None
    kind: str = "tensor"
    type_proto: Any = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def dtype(self) -> np.dtype[Any] | None:
        """The numpy dtype of a tensor value, or None (unknown type, or not a tensor)."""
        if not self.elem_type:
            return None
        onnx = _onnx()
        try:
            dtype: np.dtype[Any] = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.elem_type))
        except (KeyError, TypeError, ValueError):
            return None
        return dtype

    @property
    def is_device_tensor(self) -> bool:
        """True for a tensor of a known numeric (or bool) element type: a value that can
        live in device memory. String tensors, sequences, optionals and maps, and values
        of unknown type, live on the host only."""
        if self.kind != "tensor":
            return False
        dtype = self.dtype
        return dtype is not None and not dtype.hasobject


@dataclass(frozen=True)
class Node:
    """One node; ``index`` is its position in `GraphView.nodes` (topological order).

    ``inputs`` keeps ONNX's empty string for a missing optional input.
    ``implicit_inputs`` are outer-scope values read by subgraph attributes (If, Loop, Scan).
    """

    index: int
    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: Mapping[str, Any] = field(compare=False)
    implicit_inputs: tuple[str, ...] = ()
    proto: Any = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def all_inputs(self) -> tuple[str, ...]:
        """Explicit (non-empty) then implicit inputs, without duplicates."""
        seen: dict[str, None] = {}
        for name in (*self.inputs, *self.implicit_inputs):
            if name:
                seen.setdefault(name, None)
        return tuple(seen)


class Initializer:
    """A constant tensor of the model; its data is read only by
    [`numpy`][aioep.abc.Initializer.numpy]."""

    __slots__ = ("_base_dir", "_proto", "dtype", "external", "name", "shape")

    def __init__(self, proto: Any, base_dir: Path | None) -> None:
        """Raises `InvalidArgument` for a negative dimension or a data type that is not
        a tensor element type (0, UNDEFINED, or one onnx does not know)."""
        onnx = _onnx()
        self._proto = proto
        self._base_dir = base_dir
        self.name: str = proto.name
        self.shape: tuple[int, ...] = tuple(int(d) for d in proto.dims)
        if any(d < 0 for d in self.shape):
            raise InvalidArgument(
                f"model format error! initializer {self.name!r} has a negative dimension in its "
                f"shape {list(self.shape)}",
                code=ErrorCode.INVALID_PROTOBUF,
            )
        self.dtype: np.dtype[Any] = _element_dtype(onnx, proto)
        self.external: bool = proto.data_location == onnx.TensorProto.EXTERNAL

    @property
    def proto(self) -> Any:
        """The ``onnx.TensorProto`` (external data not loaded)."""
        return self._proto

    @property
    def nbytes(self) -> int:
        """Size of the data in bytes."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def numpy(self) -> npt.NDArray[Any]:
        """Read the data (from the external file when the data is external).

        Raises:
            NoSuchFile: the external data file is missing.
            InvalidArgument: the data cannot be read: its external file lies outside the
                model's folder (ORT's rule: no absolute path, no ``..`` or symbolic link that
                leads out), the model has no folder (given as a proto, without one), or the
                data does not match the declared shape.
        """
        onnx = _onnx()
        proto, base = self._proto, ""
        if self.external:
            proto, base = self._external_proto(onnx)
        try:
            return np.asarray(onnx.numpy_helper.to_array(proto, base_dir=base))
        except FileNotFoundError as exc:
            raise NoSuchFile(
                f"initializer {self.name!r}: external data file not found: {exc}"
            ) from exc
        except (
            ValueError,
            TypeError,
            KeyError,
            OverflowError,
            onnx.checker.ValidationError,
        ) as exc:
            # Data that does not match the declared shape, or an element type onnx cannot read.
            raise InvalidArgument(
                f"initializer {self.name!r} (element type {self._proto.data_type}, dims "
                f"{list(self._proto.dims)}) cannot be read: {type(exc).__name__}: {exc}"
            ) from exc

    def _external_proto(self, onnx: Any) -> tuple[Any, str]:
        """A copy of the proto that names its external file by its real path, and that path's
        folder: onnx reads it without its own location check (stricter than ORT's: it
        refuses any symbolic link), which `resolve_location` has made."""
        if self._base_dir is None:
            raise InvalidArgument(
                f"initializer {self.name!r} keeps its data in an external file, but the model "
                "was given without a folder to find it in (bytes or a ModelProto); give the "
                "model's path, or the folder (GraphView.from_model(model, external_data_dir=...))"
            )
        location = next((e.value for e in self._proto.external_data if e.key == "location"), "")
        full = resolve_location(os.fspath(self._base_dir), location, self.name)
        if not os.path.isfile(full):
            raise NoSuchFile(
                f"initializer {self.name!r}: external data file {location!r} does not exist "
                f"(resolved to {full!r})"
            )
        proto = onnx.TensorProto()
        proto.CopyFrom(self._proto)  # no data: it is in the file
        for entry in proto.external_data:
            if entry.key == "location":
                entry.value = os.path.basename(full)
        return proto, os.path.dirname(full)

    def __repr__(self) -> str:
        ext = " external" if self.external else ""
        return f"<Initializer {self.name!r} {self.dtype}{list(self.shape)}{ext}>"


def _element_dtype(onnx: Any, proto: Any) -> np.dtype[Any]:
    """The numpy dtype of an initializer's element type, or a format error naming it."""
    data_type = int(proto.data_type)
    if data_type != onnx.TensorProto.UNDEFINED:
        try:
            dtype: np.dtype[Any] = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type))
        except (KeyError, TypeError, ValueError):
            pass
        else:
            return dtype
    undefined = " (0 is UNDEFINED)" if data_type == onnx.TensorProto.UNDEFINED else ""
    raise InvalidArgument(
        f"model format error! initializer {proto.name!r} has data type {data_type}{undefined}, "
        "which is not an ONNX tensor element type",
        code=ErrorCode.INVALID_PROTOBUF,
    )


def _attribute_value(onnx: Any, attr: Any) -> Any:
    if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        return attr.g if attr.type == onnx.AttributeProto.GRAPH else tuple(attr.graphs)
    value = onnx.helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, list):
        return tuple(
            v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v for v in value
        )
    return value


class _Attributes(Mapping[str, Any]):
    """A node's attributes, each converted from its ``AttributeProto`` when first read."""

    __slots__ = ("_done", "_protos")

    def __init__(self, protos: Sequence[Any]) -> None:
        self._protos = {a.name: a for a in protos}
        self._done: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        try:
            return self._done[key]
        except KeyError:
            value = _attribute_value(_onnx(), self._protos[key])
            self._done[key] = value
            return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._protos)

    def __len__(self) -> int:
        return len(self._protos)

    def __repr__(self) -> str:
        return repr(dict(self))


_GRAPH_ATTRIBUTE_TYPES = (5, 10)  # AttributeProto.GRAPH, GRAPHS


def _new_node(**fields: Any) -> Node:
    # Node is frozen: its generated __init__ sets each field through object.__setattr__,
    # which on a model of thousands of nodes costs more than building the rest of the view.
    node = object.__new__(Node)
    node.__dict__.update(fields)
    return node


def _value_info(onnx: Any, vi: Any) -> ValueInfo:
    t = vi.type
    which = t.WhichOneof("value")
    if which != "tensor_type":
        if which is None:
            return ValueInfo(vi.name, 0, None, "unknown")
        # A copy: the inferred model this came from holds a copy of every initializer.
        proto = onnx.TypeProto()
        proto.CopyFrom(t)
        return ValueInfo(vi.name, 0, None, which.removesuffix("_type"), proto)
    tt = t.tensor_type
    shape: tuple[Dim, ...] | None = None
    if tt.HasField("shape"):
        dims: list[Dim] = []
        for d in tt.shape.dim:
            kind = d.WhichOneof("value")
            dims.append(d.dim_value if kind == "dim_value" else d.dim_param if kind else None)
        shape = tuple(dims)
    if not tt.elem_type:
        return ValueInfo(vi.name, 0, shape, "unknown")
    return ValueInfo(vi.name, int(tt.elem_type), shape)
