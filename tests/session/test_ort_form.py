"""onnxruntime's habits on an aioep session: ``run(output_names, input_feed, run_options)``
beside aioep's ``run(inputs, stream)``, ``get_inputs()`` / ``get_outputs()`` as NodeArgs, and
the argument errors in between; each compared with what the installed onnxruntime does."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from _baseline import ort_baseline  # noqa: E402
from _models import chain, model_of, value_info  # noqa: E402
from onnx import TensorProto as TP  # noqa: E402
from onnx import helper as h  # noqa: E402
from test_session import (  # noqa: E402
    CPU,
    HostTestFactory,
    _HostKernel,
    claim_ops,
    environment,
    sim_environment,
)

import aioep  # noqa: E402
from aioep import ClosedError, EpError, InvalidArgument, Tensor  # noqa: E402

pytestmark = pytest.mark.anyio

SIM = "SimExecutionProvider"


@contextlib.asynccontextmanager
async def chain_session(on_sim: bool) -> AsyncIterator[tuple[aioep.Environment, Any, Any]]:
    """chain() on the CPU alone, or with the sim claiming what it runs (a run then copies
    device outputs to the host); yields the environment, the session and the sims."""
    async with sim_environment() as (env, sims):
        sess = await env.create_session(chain(), sims[:1] if on_sim else [])
        async with sess:
            assert (SIM in sess.assignment) is on_sim
            yield env, sess, sims


def _feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)}


def _assert_same(got: Sequence[Any], want: Sequence[Any]) -> None:
    assert isinstance(got, list)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert type(g) is type(w) is np.ndarray
        assert (g.dtype, g.shape) == (w.dtype, w.shape)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


# -- run(output_names, input_feed, run_options) ------------------------------------------------
@pytest.mark.parametrize("on_sim", [False, True])
async def test_ort_form_returns_what_onnxruntime_returns(on_sim: bool) -> None:
    feeds = _feeds()
    ref = ort_baseline(chain())
    async with chain_session(on_sim) as (_, sess, _):
        # None and [] ask for every output, in the model's order (onnxruntime: the same).
        _assert_same(await sess.run(None, feeds), ref.run(None, feeds))
        _assert_same(await sess.run([], feeds), ref.run([], feeds))
        _assert_same(await sess.run(["c"], feeds), ref.run(["c"], feeds))
        _assert_same(await sess.run(("c", "y", "c"), feeds), ref.run(("c", "y", "c"), feeds))
        got = await sess.run(output_names=["y"], input_feed=feeds, run_options=None)
        _assert_same(got, ref.run(output_names=["y"], input_feed=feeds, run_options=None))
        _assert_same(await sess.run(None, feeds, None), ref.run(None, feeds, None))
        _assert_same(await sess.run(None, input_feed=feeds), ref.run(None, input_feed=feeds))
        # The arrays are the caller's: writable, and not the next run's.
        first = await sess.run(["y"], feeds)
        first[0][...] = 7
        _assert_same(await sess.run(["y"], feeds), ref.run(["y"], feeds))
        # aioep's own form still returns tensors.
        outputs = await sess.run(feeds)
        assert set(outputs) == {"y", "c"}
        assert all(isinstance(t, Tensor) for t in outputs.values())
        del outputs  # device tensors: dropped before the environment closes


async def test_ort_form_with_a_stream_returns_complete_host_arrays() -> None:
    feeds = _feeds()
    want = ort_baseline(chain()).run(None, feeds)
    async with chain_session(True) as (env, sess, sims), env.create_sync_stream(sims[0]) as stream:
        _assert_same(await sess.run(None, feeds, stream=stream), want)
        # The mapping form keeps its positional stream.
        outputs = await sess.run(feeds, stream, output_location="host")
        np.testing.assert_allclose(outputs["y"].numpy(), want[0], rtol=1e-5, atol=1e-6)


def _zipmap_model() -> Any:
    """x + x (an EP may take it), then ZipMap: a sequence of maps (int64 -> float)."""
    seq_map = h.make_sequence_type_proto(
        h.make_map_type_proto(TP.INT64, h.make_tensor_type_proto(TP.FLOAT, []))
    )
    nodes = [
        h.make_node("Add", ["x", "x"], ["a"]),
        h.make_node("ZipMap", ["a"], ["z"], domain="ai.onnx.ml", classlabels_int64s=[3, 5]),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [value_info("x", [2, 2])],
        [h.make_value_info("z", seq_map), value_info("a", [2, 2])],
    )
    return h.make_model(
        graph, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("ai.onnx.ml", 3)]
    )


def _sequence_model() -> Any:
    """SplitToSequence (a sequence of tensors out) and an optional passed through."""
    seq_t = h.make_sequence_type_proto(h.make_tensor_type_proto(TP.FLOAT, None))
    opt_t = h.make_optional_type_proto(h.make_tensor_type_proto(TP.FLOAT, [2]))
    nodes = [
        h.make_node("Add", ["x", "x"], ["a"]),
        h.make_node("SplitToSequence", ["a"], ["seq"], axis=0),
        h.make_node("Identity", ["opt"], ["opt_out"]),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [value_info("x", [2, 2]), h.make_value_info("opt", opt_t)],
        [h.make_value_info("seq", seq_t), h.make_value_info("opt_out", opt_t)],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])


@pytest.mark.parametrize("claimed", [False, True])
async def test_ort_form_gives_sequences_maps_and_optionals_as_onnxruntime(claimed: bool) -> None:
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    async with environment(ep=claim_ops("Add")) as (env, devs):
        ep_devices = [devs["ep"]] if claimed else []
        model = _zipmap_model()
        want = ort_baseline(model).run(None, {"x": x})
        async with await env.create_session(model, ep_devices) as sess:
            assert (sess.assignment[0] == "ep") is claimed
            got = await sess.run(None, {"x": x})
            assert got[0] == want[0]  # a list of {label: probability} dicts
            assert isinstance(got[0][0], dict)
            np.testing.assert_array_equal(got[1], want[1])
        model = _sequence_model()
        ref = ort_baseline(model)
        async with await env.create_session(model, ep_devices) as sess:
            for opt in (None, np.ones(2, np.float32)):
                want = ref.run(None, {"x": x, "opt": opt})
                got = await sess.run(None, {"x": x, "opt": opt})
                assert isinstance(got[0], list)
                _assert_same(got[0], want[0])
                if opt is None:
                    assert (got[1], want[1]) == (None, None)
                else:
                    _assert_same([got[1]], [want[1]])


async def test_ort_form_gives_string_outputs_as_writable_arrays() -> None:
    nodes = [h.make_node("Add", ["x", "x"], ["a"]), h.make_node("Identity", ["s"], ["t"])]
    model = model_of(
        nodes,
        [value_info("x", [2]), value_info("s", [2], TP.STRING)],
        [value_info("a", [2]), value_info("t", [2], TP.STRING)],
    )
    feeds = {"x": np.ones(2, np.float32), "s": np.array(["ab", "c"], dtype=object)}
    async with environment(ep=claim_ops("Add")) as (env, devs):
        sess = await env.create_session(model, [devs["ep"]])
        async with sess:
            assert sess.assignment == ("ep", CPU)
            a, t = await sess.run(None, feeds)
            assert t.dtype == object
            assert list(t) == ["ab", "c"]
            t[0] = "changed"  # as onnxruntime's: the caller's own array
            np.testing.assert_array_equal(a, [2, 2])


# -- argument errors ---------------------------------------------------------------------------
async def test_run_argument_errors_name_the_forms_and_never_print_an_array() -> None:
    big = {"x": np.zeros((3, 4), np.float32) + np.arange(12, dtype=np.float32).reshape(3, 4)}
    async with chain_session(True) as (env, sess, sims):
        with pytest.raises(InvalidArgument, match=r"first argument .* got str 'y'.*run\(\['y'\]"):
            await sess.run("y", big)
        with pytest.raises(InvalidArgument, match=r"run\(inputs, stream=None.*run\(output_names"):
            await sess.run(np.ones(3), big)
        with pytest.raises(
            InvalidArgument, match=r"unknown output name\(s\) \['nope'\].*\['y', 'c'\]"
        ):
            await sess.run(["y", "nope"], big)
        with pytest.raises(InvalidArgument, match=r"output_names\[0\] is int 1"):
            await sess.run([1], big)
        with pytest.raises(InvalidArgument, match=r"got list of 1 item\(s\); inputs go in a map"):
            await sess.run([big["x"]])
        with pytest.raises(InvalidArgument, match=r"input_feed must map.*dict\(pairs\)"):
            await sess.run(None, list(big.items()))
        with pytest.raises(InvalidArgument, match="run_options must be None or an onnxruntime"):
            await sess.run(None, big, {"log_severity_level": 0})
        async with env.create_sync_stream(sims[0]) as stream:
            with pytest.raises(InvalidArgument, match=r"stream is a keyword in this form"):
                await sess.run(None, big, stream)
        # Each form's own keywords only; InvalidArgument is a TypeError too, as Python's own.
        with pytest.raises(TypeError, match="unexpected keyword argument 'output_location'"):
            await sess.run(None, big, output_location="host")
        with pytest.raises(InvalidArgument, match="unexpected keyword argument 'run_options'"):
            await sess.run(big, run_options=None)
        with pytest.raises(InvalidArgument, match="takes from 1 to 2 positional arguments"):
            await sess.run(big, None, None)
        with pytest.raises(InvalidArgument, match="missing 1 required positional argument"):
            await sess.run(input_feed=big)
        with pytest.raises(InvalidArgument, match="missing 1 required positional argument"):
            await sess.run()
        # The mapping form with onnxruntime's argument order mixed up: the feeds land in
        # ``stream``; the message names them without printing the array.
        with pytest.raises(InvalidArgument, match=r"stream must be an aioep\.SyncStream") as info:
            await sess.run(big, big)
        assert "dict with keys ['x']" in str(info.value)
        with pytest.raises(InvalidArgument) as info2:
            await sess.run(None, list(big.items()))
        for exc in (info.value, info2.value):
            assert "11." not in str(exc)  # the array's last element
            assert "array(" not in str(exc)


# -- run_options -------------------------------------------------------------------------------
class _Terminating(HostTestFactory):
    """An EP whose kernel sets ``run_options.terminate`` while it runs (as another thread
    would, to stop a run)."""

    run_options: Any = None

    def create_ep(self, ep_devices: Any, options: Any) -> Any:
        ep = super().create_ep(ep_devices, options)
        factory = self

        class Kernel(_HostKernel):
            async def __call__(self, inputs: Sequence[Tensor], stream: Any) -> list[Tensor]:
                factory.run_options.terminate = True
                return await super().__call__(inputs, stream)

        ep.compile = lambda groups: [Kernel(ep, g) for g in groups]  # type: ignore[method-assign]
        return ep


async def test_run_options_terminate_and_settings_onnxruntime_takes() -> None:
    feeds = _feeds()
    want = ort_baseline(chain()).run(None, feeds)
    options = ort.RunOptions()
    options.log_severity_level = 3
    options.logid = "aioep-test"
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    for on_sim in (False, True):
        async with chain_session(on_sim) as (_, sess, _):
            _assert_same(await sess.run(None, feeds, options), want)
            options.terminate = True
            with pytest.raises(
                EpError, match="terminate is set: the run stopped before it started"
            ):
                await sess.run(None, feeds, options)
            options.terminate = False
            _assert_same(await sess.run(None, feeds, run_options=options), want)
    # Set while the run is under way: the run stops before its next step.
    factory = _Terminating("ep", claim_ops("Add"))
    factory.run_options = ort.RunOptions()
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("ep", factory)
        async with await env.create_session(chain(), [dev]) as sess:
            assert sess.assignment[0] == "ep"
            with pytest.raises(EpError, match=r"stopped before step 1 of"):
                await sess.run(None, feeds, factory.run_options)
            factory.run_options.terminate = False
            with pytest.raises(EpError, match=r"terminate"):  # the kernel sets it again
                await sess.run(None, feeds, factory.run_options)


# -- get_inputs() / get_outputs() --------------------------------------------------------------
def _typed_io_model() -> Any:
    """Inputs and outputs of every kind NodeArg shows: symbolic, unnamed and inferred dims,
    unknown rank, a scalar, a declared name that looks made up, strings, bfloat16, float8,
    sequences, maps, optionals, and an initializer listed among the graph's inputs."""
    seq_t = h.make_sequence_type_proto(h.make_tensor_type_proto(TP.FLOAT, [2, "Q"]))
    map_t = h.make_map_type_proto(TP.INT64, h.make_tensor_type_proto(TP.FLOAT, None))
    opt_t = h.make_optional_type_proto(h.make_tensor_type_proto(TP.FLOAT, [2]))
    inputs = [
        value_info("x", ["N", None, 3]),
        value_info("r", None),
        value_info("s", []),
        value_info("k", ["unk__7", 4]),
        value_info("str", [None], TP.STRING),
        value_info("b", [1], TP.BFLOAT16),
        value_info("f8", [2], TP.FLOAT8E4M3FN),
        h.make_value_info("seq", seq_t),
        h.make_value_info("map", map_t),
        h.make_value_info("opt", opt_t),
        value_info("w", [3]),
    ]
    w = onnx.numpy_helper.from_array(np.ones(3, np.float32), "w")
    nodes = [
        h.make_node("Relu", ["x"], ["relu"]),
        h.make_node("Concat", ["k", "k"], ["cat"], axis=0),
        h.make_node("NonZero", ["x"], ["nz"]),
        h.make_node("Add", ["x", "w"], ["xw"]),
        h.make_node("Identity", ["r"], ["r2"]),
        h.make_node("Identity", ["s"], ["s2"]),
        h.make_node("Identity", ["str"], ["str2"]),
        h.make_node("Identity", ["b"], ["b2"]),
        h.make_node("Identity", ["f8"], ["f82"]),
        h.make_node("Identity", ["seq"], ["seq2"]),
        h.make_node("Identity", ["opt"], ["opt2"]),
    ]
    outputs = [
        value_info("relu", None),  # inferred: ['N', None, 3]
        value_info("cat", None),  # inferred: a dim ONNX's inference names unk__N
        value_info("nz", None, TP.INT64),
        value_info("xw", ["N", "M", 3]),
        value_info("r2", None),
        value_info("s2", None),
        value_info("str2", None, TP.STRING),
        value_info("b2", None, TP.BFLOAT16),
        value_info("f82", None, TP.FLOAT8E4M3FN),
        h.make_value_info(
            "seq2", h.make_sequence_type_proto(h.make_tensor_type_proto(TP.FLOAT, None))
        ),
        h.make_value_info("opt2", opt_t),
    ]
    graph = h.make_graph(nodes, "g", inputs, outputs, [w])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 21)])


def _fields(args: Sequence[Any]) -> list[tuple[str, str, list[Any]]]:
    return [(a.name, a.type, a.shape) for a in args]


@pytest.mark.parametrize("claimed", [False, True])
async def test_get_inputs_and_outputs_equal_onnxruntime_node_args(claimed: bool) -> None:
    # Claimed: aioep describes the model itself (onnxruntime does not load it whole).
    model = _typed_io_model()
    ref = ort_baseline(model)
    async with environment(ep=claim_ops("Relu")) as (env, devs):
        sess = await env.create_session(model, [devs["ep"]] if claimed else [])
        await sess.aclose()
        assert ("ep" in sess.assignment) is claimed
        inputs, outputs = sess.get_inputs(), sess.get_outputs()
        assert _fields(inputs) == _fields(ref.get_inputs())
        assert _fields(outputs) == _fields(ref.get_outputs())
        # A few values spelled out, and repr as onnxruntime's str().
        by_name = {a.name: a for a in [*inputs, *outputs]}
        assert (by_name["x"].type, by_name["x"].shape) == ("tensor(float)", ["N", None, 3])
        assert by_name["cat"].shape == [None, 4]
        assert by_name["k"].shape == ["unk__7", 4]
        assert (by_name["seq"].type, by_name["seq"].shape) == ("seq(tensor(float))", [])
        assert by_name["map"].type == "map(int64,tensor(float))"
        assert by_name["opt"].type == "optional(tensor(float))"
        assert "w" not in by_name
        assert [repr(a) for a in inputs] == [str(a) for a in ref.get_inputs()]
        # Each call gives a new list, as onnxruntime's.
        sess.get_inputs().clear()
        assert len(sess.get_inputs()) == len(inputs)


# -- the session's life ------------------------------------------------------------------------
async def test_a_cpu_only_session_closes_with_its_environment() -> None:
    env = aioep.Environment(autoload=False)
    await env.__aenter__()
    sess = await env.create_session(chain())
    feeds = _feeds()
    assert (await sess.run(feeds))["y"].shape == (3, 4)
    await env.aclose()  # no warning: the session it closed is in the close report
    report = env.close_report
    assert report is not None
    assert any("Session open" in s for s in report.sessions), report
    assert sess.closed
    with pytest.raises(ClosedError, match=r"closed \(.* when its environment closed"):
        await sess.run(feeds)
    with pytest.raises(ClosedError):
        await sess.run(None, feeds)


async def test_closing_the_session_before_the_environment_warns_nothing() -> None:
    async with aioep.Environment(autoload=False) as env:
        async with await env.create_session(chain()) as sess:
            await sess.run(_feeds())
        with pytest.raises(InvalidArgument, match="cannot be unregistered"):
            env.unregister_library("host")
    assert sess.closed
