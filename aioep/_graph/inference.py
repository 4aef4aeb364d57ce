"""Value types of a graph: ONNX shape inference, run once on first use, on a copy of the
model without its large weights."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from .types import Initializer, ValueInfo, _onnx, _value_info

__all__ = ["GraphValues"]

# Initializers up to this size keep their values for inference (shapes that Reshape reads).
_INFERENCE_KEEP_BYTES = 4096


def _for_inference(onnx: Any, model: Any) -> Any:
    """``model`` for shape inference: large initializers become typed graph inputs, so the
    model is not serialized twice with its weights (inference only needs their shapes;
    small ones, such as the shapes Reshape reads, keep their values)."""
    graph = model.graph
    big = {
        t.name
        for t in graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL or t.ByteSize() > _INFERENCE_KEEP_BYTES
    }
    if not big:
        return model
    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    g = light.graph
    g.name = graph.name
    g.node.extend(graph.node)
    g.input.extend(graph.input)
    g.output.extend(graph.output)
    g.value_info.extend(graph.value_info)
    declared = {i.name for i in graph.input}
    for t in graph.initializer:
        if t.name not in big:
            g.initializer.append(t)
        elif t.name not in declared:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return light


class GraphValues:
    """The graph's value types, from ONNX shape inference run on first use; shared by the
    views of one graph. Several threads may ask at once."""

    def __init__(self, model: Any, initializers: Mapping[str, Initializer]) -> None:
        self._model = model
        self._initializers = initializers
        self._protos: dict[str, Any] | None = None
        self._infos: dict[str, ValueInfo] = {}
        self._lock = threading.Lock()

    def _infer(self) -> dict[str, Any]:
        with self._lock:
            if self._protos is None:
                onnx = _onnx()
                graph = self._model.graph
                try:
                    inferred = onnx.shape_inference.infer_shapes(
                        _for_inference(onnx, self._model), strict_mode=False
                    ).graph
                    infos = [*inferred.input, *inferred.value_info, *inferred.output]
                except Exception:  # inference is a help, not a requirement
                    infos = [*graph.input, *graph.value_info, *graph.output]
                protos: dict[str, Any] = {}
                for vi in infos:
                    protos.setdefault(vi.name, vi)
                self._protos = protos
            return self._protos

    def get(self, name: str) -> ValueInfo | None:
        """The type and shape of ``name``, or None for a name the graph does not know."""
        info = self._infos.get(name)
        if info is not None:
            return info
        proto = (self._protos or self._infer()).get(name)
        if proto is not None:
            info = _value_info(_onnx(), proto)
        elif name in self._initializers:
            init = self._initializers[name]
            info = ValueInfo(name, int(init.proto.data_type), init.shape)
        else:
            return None
        # Converted when first asked for: a large model has thousands of values.
        self._infos[name] = info
        return info
