from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto as TP  # noqa: E402
from onnx import helper as h  # noqa: E402

import aioep  # noqa: E402
from aioep import InvalidArgument, NoSuchFile  # noqa: E402
from aioep._graph.graph import GraphView  # noqa: E402


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
    from aioep._graph.ort_compat import ort_limits

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
    from aioep._graph.ort_compat import ort_limits

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


def test_value_kinds_and_host_only_values() -> None:
    seq_t = h.make_sequence_type_proto(h.make_tensor_type_proto(TP.FLOAT, None))
    opt_t = h.make_optional_type_proto(h.make_tensor_type_proto(TP.FLOAT, [2]))
    nodes = [
        h.make_node("SplitToSequence", ["x"], ["seq"], axis=0),
        h.make_node("Identity", ["opt"], ["o"]),
        h.make_node("Cast", ["x"], ["s"], to=TP.STRING),
        h.make_node("Add", ["x", "x"], ["a"]),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [_vi("x", [2, 2]), h.make_value_info("opt", opt_t)],
        [
            h.make_value_info("seq", seq_t),
            h.make_value_info("o", opt_t),
            _vi("s", [2, 2], TP.STRING),
            _vi("a", [2, 2]),
        ],
    )
    g = GraphView.from_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 18)]))
    kinds = {
        n: (g.value_info(n).kind, g.value_info(n).is_device_tensor)
        for n in ("x", "seq", "opt", "s", "a")
    }
    assert kinds == {
        "x": ("tensor", True),
        "seq": ("sequence", False),
        "opt": ("optional", False),
        "s": ("tensor", False),  # strings live on the host
        "a": ("tensor", True),
    }
    assert g.value_info("s").dtype == np.dtype(object)
    assert g.value_info("seq").type_proto.HasField("sequence_type")
    # A sub-model keeps a sequence value's type at its boundary.
    sub = g.extract_model([0], ["x"], ["seq"])
    assert sub.graph.output[0].type.HasField("sequence_type")
    (parts,) = ort.InferenceSession(
        sub.SerializeToString(), providers=["CPUExecutionProvider"]
    ).run(None, {"x": np.ones((2, 2), np.float32)})
    assert len(parts) == 2


def test_unknown_types_and_lazy_attributes() -> None:
    nodes = [h.make_node("CustomOp", ["x"], ["y"], domain="custom", alpha=1.5, name="c")]
    graph = h.make_graph(nodes, "g", [_vi("x", [2])], [h.make_empty_tensor_value_info("y")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("custom", 1)])
    g = GraphView.from_model(model)
    assert g.value_info("y").kind == "unknown"
    assert not g.value_info("y").is_device_tensor
    assert g.value_info("nothing") is None
    attrs = g.nodes[0].attributes
    assert len(attrs) == 1
    assert dict(attrs) == {"alpha": pytest.approx(1.5)}
    with pytest.raises(KeyError):
        attrs["beta"]


def test_shape_inference_keeps_small_initializer_values_without_the_weights() -> None:
    # The weights are left out of shape inference; Reshape's target shape is kept.
    big = onnx.numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    shape = onnx.numpy_helper.from_array(np.array([4096], np.int64), "shape")
    nodes = [
        h.make_node("Add", ["x", "w"], ["a"]),
        h.make_node("Reshape", ["a", "shape"], ["y"]),
    ]
    g = GraphView.from_model(_model(nodes, [_vi("x", [64, 64])], [_vi("y", None)], [big, shape]))
    assert g.value_info("a").shape == (64, 64)
    assert g.value_info("y").shape == (4096,)
    assert g.value_info("w").shape == (64, 64)
    assert [i.name for i in g.inputs] == ["x"]


def test_from_model_takes_the_model_bytes() -> None:
    model = diamond()
    g = GraphView.from_model(model.SerializeToString())
    assert [n.op_type for n in g.nodes] == [n.op_type for n in GraphView.from_model(model).nodes]
    assert g.model_path is None
    assert g.external_data_dir is None
    np.testing.assert_array_equal(g.initializers["w"].numpy(), np.full((2, 3), 0.5, np.float32))
    with pytest.raises(InvalidArgument, match="8 bytes given are not a serialized ONNX model"):
        GraphView.from_model(b"\xff\x00 not a")
    with pytest.raises(InvalidArgument, match=r"path, its bytes or an onnx\.ModelProto"):
        GraphView.from_model(bytearray(model.SerializeToString()))


@pytest.mark.parametrize(
    ("data_type", "dims", "match"),
    [
        (0, [4], r"data type 0 \(0 is UNDEFINED\)"),
        (99, [4], "data type 99, which is not an ONNX tensor element type"),
        (TP.FLOAT, [-4], r"negative dimension in its shape \[-4\]"),
    ],
)
def test_a_malformed_initializer_is_invalid_argument(
    data_type: int, dims: list[int], match: str
) -> None:
    w = onnx.TensorProto(name="w", data_type=data_type, dims=dims, raw_data=b"\0" * 16)
    model = _model([h.make_node("Add", ["x", "w"], ["y"])], [_vi("x", [4])], [_vi("y", [4])], [w])
    with pytest.raises(InvalidArgument, match=match) as caught:
        GraphView.from_model(model)
    assert caught.value.code is aioep.ErrorCode.INVALID_PROTOBUF
    assert "initializer 'w'" in str(caught.value)


def _external_model(folder: Path, location: str) -> Path:
    """diamond() with its initializer ``w`` in the external file ``location``, saved in
    ``folder`` as m.onnx (the data itself in ``folder``/w.bin)."""
    folder.mkdir(parents=True, exist_ok=True)
    np.full((2, 3), 0.5, np.float32).tofile(folder / "w.bin")
    model = diamond()
    w = model.graph.initializer[0]
    w.ClearField("raw_data")
    w.data_location = TP.EXTERNAL
    w.external_data.add(key="location", value=location)
    path = folder / "m.onnx"
    onnx.save(model, path)
    return path


def test_external_data_follows_onnxruntimes_folder_rule(tmp_path: Path) -> None:
    want = np.full((2, 3), 0.5, np.float32)
    outside = tmp_path / "outside"
    # A symbolic link inside the folder to a file inside it: ORT reads it (onnx's own
    # reader would refuse any link).
    path = _external_model(tmp_path / "m", "link.bin")
    (tmp_path / "m" / "link.bin").symlink_to(tmp_path / "m" / "w.bin")
    np.testing.assert_array_equal(GraphView.from_model(path).initializers["w"].numpy(), want)
    # Out of the folder: InvalidArgument naming the initializer and the file (never onnx's
    # ValidationError).
    _external_model(outside, "w.bin")
    (tmp_path / "m" / "out_link.bin").symlink_to(outside / "w.bin")
    for location, match in [
        ("../outside/w.bin", "'../outside/w.bin' escapes model directory"),
        (str(outside / "w.bin"), "Absolute paths not allowed"),
        ("out_link.bin", "'out_link.bin' escapes model directory"),
    ]:
        path = _external_model(tmp_path / "m", location)
        with pytest.raises(InvalidArgument, match=match) as caught:
            GraphView.from_model(path).initializers["w"].numpy()
        assert "initializer: w" in str(caught.value)
    # A proto has no folder, unless one is given.
    model = onnx.load(_external_model(tmp_path / "m", "w.bin"), load_external_data=False)
    with pytest.raises(InvalidArgument, match="without a folder"):
        GraphView.from_model(model).initializers["w"].numpy()
    g = GraphView.from_model(model.SerializeToString(), external_data_dir=tmp_path / "m")
    assert g.external_data_dir == tmp_path / "m"
    np.testing.assert_array_equal(g.initializers["w"].numpy(), want)
    with pytest.raises(NoSuchFile, match="is not a folder"):
        GraphView.from_model(model, external_data_dir=tmp_path / "nowhere")
    with pytest.raises(InvalidArgument, match="external_data_dir is for a model given as bytes"):
        GraphView.from_model(tmp_path / "m" / "m.onnx", external_data_dir=tmp_path)
