"""ONNX models built for onnxruntime: a node group of a graph view as a standalone model, and
a whole model in a form the installed onnxruntime loads."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._base.errors import NotImplementedByEp
from .ort_compat import ir_version_for_ort
from .types import _onnx

if TYPE_CHECKING:
    from .types import Initializer, Node, ValueInfo

__all__ = ["SplitSource", "extract_model", "whole_model_source"]


class SplitSource(Protocol):
    """What `extract_model` reads of a graph (a `GraphView` satisfies it): the model, its
    nodes, initializers and value types, and where a node group meets the rest."""

    @property
    def model(self) -> Any: ...
    @property
    def nodes(self) -> Sequence[Node]: ...
    @property
    def initializers(self) -> Mapping[str, Initializer]: ...
    def value_info(self, name: str) -> ValueInfo | None: ...
    def boundary(self, indices: Iterable[int]) -> tuple[tuple[str, ...], tuple[str, ...]]: ...


def extract_model(
    graph: SplitSource,
    indices: Iterable[int],
    inputs: Sequence[str] | None = None,
    outputs: Sequence[str] | None = None,
    *,
    load_external_data: bool = True,
) -> Any:
    """A standalone ``onnx.ModelProto`` that computes a node group of ``graph``; see
    `GraphView.extract_model`."""
    onnx = _onnx()
    helper = onnx.helper
    source = graph.model
    group = sorted(set(indices))
    b_in, b_out = graph.boundary(group)
    inputs = b_in if inputs is None else tuple(inputs)
    outputs = b_out if outputs is None else tuple(outputs)
    inits = []
    graph_inputs = []
    for name in inputs:
        init = graph.initializers.get(name)
        if init is not None:
            if init.external and load_external_data:
                inits.append(onnx.numpy_helper.from_array(init.numpy(), name))
            else:
                inits.append(init.proto)
        else:
            graph_inputs.append(_value_info_proto(graph, helper, name))
    model = helper.make_model(
        helper.make_graph(
            [graph.nodes[i].proto for i in group],
            f"{source.graph.name or 'graph'}_part",
            graph_inputs,
            [_value_info_proto(graph, helper, name) for name in outputs],
            initializer=inits,
        ),
        opset_imports=list(source.opset_import),
        ir_version=ir_version_for_ort(source),
    )
    model.functions.extend(source.functions)
    return model


def _value_info_proto(graph: SplitSource, helper: Any, name: str) -> Any:
    info = graph.value_info(name)
    if info is None or info.kind == "unknown":
        raise NotImplementedByEp(
            f"the type of value {name!r} is unknown (ONNX shape inference could not find it), "
            "so the graph cannot be split there"
        )
    if info.kind != "tensor":
        return helper.make_value_info(name, info.type_proto)
    shape = None if info.shape is None else list(info.shape)
    return helper.make_tensor_value_info(name, info.elem_type, shape)


def whole_model_source(model: str | os.PathLike[str] | bytes | Any) -> str | bytes:
    """What onnxruntime loads for a model given as a path, bytes or a proto: the path or the
    bytes as they are, or the proto's bytes (from a copy with a capped IR version where the
    installed onnxruntime needs one: also for bytes)."""
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    if isinstance(model, bytes):
        proto = _onnx().ModelProto()
        proto.ParseFromString(model)
        if ir_version_for_ort(proto) == proto.ir_version:
            return model
        model = proto
    ir_version = ir_version_for_ort(model)
    if ir_version != model.ir_version:
        copy = type(model)()
        copy.CopyFrom(model)
        copy.ir_version = ir_version
        model = copy
    data: bytes = model.SerializeToString()
    return data
