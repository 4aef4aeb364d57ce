"""A session's inputs and outputs as onnxruntime's Python API describes them (``NodeArg``)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._base.errors import import_optional

if TYPE_CHECKING:
    from .._graph.graph import GraphView
    from .._graph.types import ValueInfo

__all__ = ["NodeArg", "node_args", "ort_node_args"]

# The names ONNX shape inference makes up for dimensions it cannot name; onnxruntime's own
# inference leaves those dimensions without a name (None).
_MADE_UP = re.compile(r"unk__[0-9]+")


@dataclass(frozen=True)
class NodeArg:
    """A model input or output as onnxruntime's ``NodeArg`` shows it (``session.get_inputs()``).

    ``type`` is onnxruntime's type string (``'tensor(float)'``, ``'seq(tensor(int64))'``,
    ``'map(string,tensor(float))'``, ``'optional(tensor(float))'``). ``shape`` is a list with,
    per dimension, its size, its symbolic name, or None where the model names neither; it
    is ``[]`` for a scalar, a tensor of unknown rank and a sequence or map (an optional
    tensor shows the tensor's shape).
    """

    name: str
    type: str
    shape: list[int | str | None]


def node_args(graph: GraphView, infos: Iterable[ValueInfo]) -> tuple[NodeArg, ...]:
    """The NodeArgs of ``infos`` (values of ``graph``)."""
    onnx = import_optional("onnx", "aioep sessions")
    declared = _declared_dim_names(graph.model.graph)
    return tuple(_node_arg(onnx, info, declared) for info in infos)


def ort_node_args(session: Any) -> tuple[tuple[NodeArg, ...], tuple[NodeArg, ...]]:
    """The inputs' and outputs' NodeArgs of an ``onnxruntime.InferenceSession``."""
    inputs = tuple(NodeArg(a.name, a.type, list(a.shape)) for a in session.get_inputs())
    outputs = tuple(NodeArg(a.name, a.type, list(a.shape)) for a in session.get_outputs())
    return inputs, outputs


def _declared_dim_names(graph: Any) -> set[str]:
    """The dimension names the model itself writes (a made-up name it uses stays)."""
    names: set[str] = set()
    stack = [vi.type for vi in (*graph.input, *graph.output, *graph.value_info)]
    while stack:
        tp = stack.pop()
        which = tp.WhichOneof("value")
        if which in ("tensor_type", "sparse_tensor_type"):
            t = getattr(tp, which)
            names.update(d.dim_param for d in t.shape.dim if d.dim_param)
        elif which == "sequence_type":
            stack.append(tp.sequence_type.elem_type)
        elif which == "optional_type":
            stack.append(tp.optional_type.elem_type)
        elif which == "map_type":
            stack.append(tp.map_type.value_type)
    return names


def _node_arg(onnx: Any, info: ValueInfo, declared: set[str]) -> NodeArg:
    if info.type_proto is not None:
        return NodeArg(
            info.name, _type_string(onnx, info.type_proto), _proto_shape(info.type_proto, declared)
        )
    shape = [_dim(d, declared) for d in info.shape or ()]
    return NodeArg(info.name, f"tensor({_element(onnx, info.elem_type)})", shape)


def _dim(d: int | str | None, declared: set[str]) -> int | str | None:
    if isinstance(d, str) and _MADE_UP.fullmatch(d) and d not in declared:
        return None
    return d


def _element(onnx: Any, elem_type: int) -> str:
    try:
        return str(onnx.TensorProto.DataType.Name(elem_type)).lower()
    except ValueError:  # a number onnx does not know
        return f"unknown{elem_type}"


def _type_string(onnx: Any, tp: Any) -> str:
    which = tp.WhichOneof("value")
    if which == "tensor_type":
        return f"tensor({_element(onnx, tp.tensor_type.elem_type)})"
    if which == "sparse_tensor_type":
        return f"sparse_tensor({_element(onnx, tp.sparse_tensor_type.elem_type)})"
    if which == "sequence_type":
        return f"seq({_type_string(onnx, tp.sequence_type.elem_type)})"
    if which == "optional_type":
        return f"optional({_type_string(onnx, tp.optional_type.elem_type)})"
    if which == "map_type":
        key = _element(onnx, tp.map_type.key_type)
        return f"map({key},{_type_string(onnx, tp.map_type.value_type)})"
    if which == "opaque_type":
        return f"opaque({tp.opaque_type.domain},{tp.opaque_type.name})"
    return "unknown"


def _proto_shape(tp: Any, declared: set[str]) -> list[int | str | None]:
    which = tp.WhichOneof("value")
    if which == "optional_type":
        return _proto_shape(tp.optional_type.elem_type, declared)
    if which not in ("tensor_type", "sparse_tensor_type"):
        return []
    t = getattr(tp, which)
    dims: list[int | str | None] = []
    for d in t.shape.dim:
        kind = d.WhichOneof("value")
        dims.append(
            d.dim_value if kind == "dim_value" else _dim(d.dim_param, declared) if kind else None
        )
    return dims
