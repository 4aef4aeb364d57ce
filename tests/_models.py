"""ONNX models and onnxruntime's answers for them, shared by the session, IOBinding,
ownership, foreign-tensor and ort-backend tests (importable as ``_models``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from _baseline import ort_baseline
from onnx import TensorProto as TP
from onnx import helper as h


def value_info(name: str, shape: Any, elem: int = TP.FLOAT) -> Any:
    return h.make_tensor_value_info(name, elem, shape)


def model_of(
    nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: Sequence[Any] = ()
) -> Any:
    graph = h.make_graph(nodes, "g", inputs, outputs, list(inits))
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def chain(dtype: Any = np.float32) -> Any:
    """add(x,w) -> exp -> mul(.,x) -> sigmoid -> sub(., x) -> relu: ops alternate claimable/not."""
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    w = onnx.numpy_helper.from_array(np.linspace(-1, 1, 12).reshape(3, 4).astype(dtype), "w")
    nodes = [
        h.make_node("Add", ["x", "w"], ["a"]),
        h.make_node("Exp", ["a"], ["b"]),
        h.make_node("Mul", ["b", "x"], ["c"]),
        h.make_node("Sigmoid", ["c"], ["d"]),
        h.make_node("Sub", ["d", "x"], ["e"]),
        h.make_node("Relu", ["e"], ["y"]),
    ]
    return model_of(
        nodes,
        [value_info("x", [3, 4], elem)],
        [value_info("y", [3, 4], elem), value_info("c", [3, 4], elem)],
        [w],
    )


def reference(model: Any, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort_baseline(model)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def add_model(n: int | str = 4) -> Any:
    """y = x + x over float[n] (``n`` a name: a dimension the model leaves open)."""
    return model_of(
        [h.make_node("Add", ["x", "x"], ["y"])], [value_info("x", [n])], [value_info("y", [n])]
    )
