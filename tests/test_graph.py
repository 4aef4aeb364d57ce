from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto as TP  # noqa: E402
from onnx import helper as h  # noqa: E402

from aioep import InvalidArgument, NoSuchFile  # noqa: E402
from aioep._graph import GraphView  # noqa: E402


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = h.make_graph(nodes, "g", inputs, outputs, list(inits))
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])


def _vi(name, shape, elem=TP.FLOAT):
    return h.make_tensor_value_info(name, elem, shape)


def diamond():
    """x -> a=Add(x,w) -> b=Exp(a) -> c=Mul(a,b) -> y=Relu(c)."""
    w = onnx.numpy_helper.from_array(np.full((2, 3), 0.5, np.float32), "w")
    nodes = [
        h.make_node("Add", ["x", "w"], ["a"], name="add"),
        h.make_node("Exp", ["a"], ["b"], name="exp"),
        h.make_node("Mul", ["a", "b"], ["c"], name="mul"),
        h.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    return _model(nodes, [_vi("x", [2, 3])], [_vi("y", [2, 3])], [w])


def test_nodes_in_topological_order_with_types_and_attributes() -> None:
    nodes = [
        h.make_node("Relu", ["b"], ["y"], name="second"),
        h.make_node("Gemm", ["x", "w"], ["b"], name="first", transB=1, alpha=2.0),
    ]
    w = onnx.numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    g = GraphView.from_model(_model(nodes, [_vi("x", ["N", 3])], [_vi("y", None)], [w]))
    assert [n.name for n in g.nodes] == ["first", "second"]
    assert [n.index for n in g.nodes] == [0, 1]
    gemm = g.nodes[0]
    assert (gemm.op_type, gemm.domain, gemm.inputs, gemm.outputs) == (
        "Gemm",
        "",
        ("x", "w"),
        ("b",),
    )
    assert gemm.attributes["transB"] == 1
    assert gemm.attributes["alpha"] == pytest.approx(2.0)
    assert g.value_info("b").shape == ("N", 4)  # from shape inference
    assert g.value_info("b").dtype == np.float32
    assert [i.name for i in g.inputs] == ["x"]
    assert g.output_names == ("y",)
    assert g.producer("b") == 0
    assert g.consumers("b") == (1,)
    assert g.predecessors(1) == {0}
    assert g.successors(0) == {1}
    assert g.opsets[""] == 17
    assert g.initializers["w"].shape == (4, 3)
    assert g.is_constant("w")
    assert not g.is_constant("x")


def test_external_data_is_loaded_only_when_asked(tmp_path: Path) -> None:
    model = diamond()
    big = np.arange(4096, dtype=np.float32).reshape(64, 64)
    model.graph.initializer.append(onnx.numpy_helper.from_array(big, "big"))
    path = tmp_path / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, location="w.bin", size_threshold=1024)
    g = GraphView.from_model(path)
    init = g.initializers["big"]
    assert init.external
    assert init.shape == (64, 64)
    assert init.dtype == np.float32
    assert not init.proto.raw_data  # not read at load time
    np.testing.assert_array_equal(init.numpy(), big)
    assert not g.initializers["w"].external
    (tmp_path / "w.bin").unlink()
    with pytest.raises(NoSuchFile):
        g.initializers["big"].numpy()


def test_bad_models_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(NoSuchFile, match="does not exist"):
        GraphView.from_model(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\xff\x00 not a model")
    with pytest.raises(InvalidArgument):
        GraphView.from_model(tmp_path / "junk.onnx")
    with pytest.raises(InvalidArgument, match="ModelProto"):
        GraphView.from_model(42)
    cyclic = _model(
        [h.make_node("Relu", ["b"], ["a"], name="p"), h.make_node("Relu", ["a"], ["b"], name="q")],
        [],
        [_vi("a", [1])],
    )
    with pytest.raises(InvalidArgument, match="cycle"):
        GraphView.from_model(cyclic)
    with pytest.raises(TypeError, match="from_model"):
        GraphView()


def test_extract_model_caps_the_ir_version_to_the_installed_onnxruntime() -> None:
    from aioep._ort_compat import ort_limits

    limits = ort_limits()
    assert limits is not None
    assert limits.version == ort.__version__
    future = diamond()
    future.ir_version = 99  # newer than any onnxruntime loads
    sub = GraphView.from_model(future).extract_model([1, 2])
    assert sub.ir_version == limits.max_ir_version
    ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    old = diamond()
    old.ir_version = 8  # older than the runtime's newest: kept as it is
    assert GraphView.from_model(old).extract_model([1, 2]).ir_version == 8
    assert [(o.domain, o.version) for o in sub.opset_import] == [("", 17)]


def test_extract_model_refuses_an_opset_onnxruntime_does_not_know() -> None:
    from aioep._ort_compat import ort_limits

    limits = ort_limits()
    assert limits is not None
    model = _model([h.make_node("Relu", ["x"], ["y"])], [_vi("x", [2])], [_vi("y", [2])])
    model.opset_import[0].version = limits.max_opset + 1
    with pytest.raises(InvalidArgument, match=rf"opset {limits.max_opset + 1}.*onnxruntime"):
        GraphView.from_model(model).extract_model([0])


def test_boundary_convex_groups_and_extract_model() -> None:
    g = GraphView.from_model(diamond())
    assert g.boundary([0]) == (("x", "w"), ("a",))
    assert g.boundary([1, 2]) == (("a",), ("c",))
    # {add, mul} is not convex (add -> exp -> mul): split around exp.
    assert g.convex_groups([0, 2, 3]) == [(0,), (2, 3)]
    assert g.convex_groups([0, 1, 2, 3]) == [(0, 1, 2, 3)]
    sub = g.extract_model([1, 2])
    sess = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    a = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    (c,) = sess.run(None, {"a": a})
    np.testing.assert_allclose(c, a * np.exp(a), rtol=1e-6)


def test_convex_groups_split_unconnected_parts() -> None:
    nodes = [
        h.make_node("Relu", ["x"], ["a"]),
        h.make_node("Neg", ["x"], ["b"]),
        h.make_node("Add", ["a", "b"], ["y"]),
    ]
    g = GraphView.from_model(_model(nodes, [_vi("x", [2])], [_vi("y", [2])]))
    assert g.convex_groups([0, 1]) == [(0,), (1,)]


def test_subgraph_reads_are_implicit_inputs() -> None:
    then_g = h.make_graph([h.make_node("Relu", ["a"], ["t"])], "then", [], [_vi("t", [2])])
    else_g = h.make_graph([h.make_node("Neg", ["a"], ["e"])], "else", [], [_vi("e", [2])])
    nodes = [
        h.make_node("Abs", ["x"], ["a"]),
        h.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g),
    ]
    g = GraphView.from_model(
        _model(nodes, [_vi("x", [2]), _vi("cond", [], TP.BOOL)], [_vi("y", [2])])
    )
    node_if = g.nodes[1]
    assert node_if.implicit_inputs == ("a",)
    assert g.predecessors(1) == {0}
    assert g.boundary([1]) == (("cond", "a"), ("y",))
