"""A whole model in a form the installed onnxruntime loads (a node group's model is
`GraphView.extract_model`'s, in ``graph``)."""

from __future__ import annotations

import os
from typing import Any

from .ort_compat import ir_version_for_ort
from .types import _onnx

__all__ = ["whole_model_source"]


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
