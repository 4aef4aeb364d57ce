from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from _baseline import ort_baseline  # noqa: E402
from _models import chain, model_of, reference, value_info  # noqa: E402
from onnx import TensorProto as TP  # noqa: E402
from onnx import helper as h  # noqa: E402

import aioep  # noqa: E402
import aioep._session.plan  # noqa: E402
from aioep import ClosedError, DeviceType, InvalidArgument, MemoryType, Tensor  # noqa: E402
from aioep._environment.host import HostAllocator  # noqa: E402
from aioep._graph.graph import GraphView  # noqa: E402
from aioep._plugin.buffer import HOST_MEMORY_INFO  # noqa: E402
from aioep._plugin.ep import CompiledNode, Ep, FusedGroup, IndexedSubGraph, MetaDef  # noqa: E402
from aioep._session.plan import CopyPoint  # noqa: E402
from aioep.abc import EpFactory, ThreadStream  # noqa: E402

pytestmark = pytest.mark.anyio

CPU = "CPUExecutionProvider"

# -- a host-memory test EP -------------------------------------------------------------------
_OPS: dict[str, Callable[..., Any]] = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Relu": lambda x: np.maximum(x, 0),
    "MatMul": np.matmul,
    "Tanh": np.tanh,
    "Identity": lambda x: x,
}

Claim = Callable[[GraphView], list[IndexedSubGraph]]


class _HostKernel(CompiledNode):
    def __init__(self, ep: HostTestEp, group: FusedGroup) -> None:
        self.ep, self.group = ep, group

    async def __call__(self, inputs: Sequence[Tensor], stream: Any) -> list[Tensor]:
        assert stream is None
        meta = self.group.meta_def
        env = {n: t.numpy() for n, t in zip(meta.inputs, inputs)}
        await anyio.lowlevel.checkpoint()  # let other runs interleave
        for node in self.group.nodes:
            env[node.outputs[0]] = _OPS[node.op_type](*(env[n] for n in node.inputs))
        outs = []
        for name in meta.outputs:
            value = np.asarray(env[name])
            out = self.ep.allocate(value.shape, value.dtype)
            out.numpy()[...] = value
            outs.append(out)
        self.ep.calls += 1
        return outs


class HostTestEp(Ep):
    def __init__(self, name: str, claim: Claim) -> None:
        super().__init__()
        self.name = name
        self.claim = claim
        self.calls = 0
        self.compiled: list[FusedGroup] = []
        self.compile_thread = 0
        self.released = False

    def get_capability(self, graph: GraphView) -> list[IndexedSubGraph]:
        return self.claim(graph)

    def compile(self, fused_groups: Sequence[FusedGroup]) -> list[CompiledNode]:
        self.compile_thread = threading.get_ident()
        self.compiled.extend(fused_groups)
        return [_HostKernel(self, g) for g in fused_groups]

    def release(self) -> None:
        self.released = True


class HostTestFactory(EpFactory):
    vendor = "tests"

    def __init__(self, name: str, claim: Claim) -> None:
        self.name = name
        self.claim = claim
        self.eps: list[HostTestEp] = []

    def get_supported_devices(
        self, hardware: Sequence[aioep.HardwareDevice]
    ) -> list[aioep.EpDevice]:
        cpu = next(hw for hw in hardware if hw.type is DeviceType.CPU)
        return [aioep.EpDevice(self, cpu, memory_infos={MemoryType.DEFAULT: HOST_MEMORY_INFO})]

    def create_allocator(self, memory_info: aioep.MemoryInfo, options: Any) -> aioep.Allocator:
        return HostAllocator(memory_info)

    def create_ep(self, ep_devices: Any, options: Any) -> Ep:
        ep = HostTestEp(self.name, self.claim)
        self.eps.append(ep)
        return ep


def claim_ops(*ops: str, fuse: bool = True) -> Claim:
    def claim(graph: GraphView) -> list[IndexedSubGraph]:
        nodes = [i for i in graph.unassigned_nodes if graph.nodes[i].op_type in ops]
        if not fuse:
            return [IndexedSubGraph((i,)) for i in nodes]
        return [
            IndexedSubGraph(g, MetaDef(f"test_{k}", *graph.boundary(g)))
            for k, g in enumerate(graph.convex_groups(nodes))
        ]

    return claim


def claim_fixed(*groups: Sequence[int]) -> Claim:
    return lambda graph: [IndexedSubGraph(tuple(g)) for g in groups]


@contextlib.asynccontextmanager
async def environment(
    **factories: Claim,
) -> AsyncIterator[tuple[aioep.Environment, dict[str, Any]]]:
    async with aioep.Environment(autoload=False) as env:
        devices: dict[str, Any] = {}
        for name, claim in factories.items():
            (devices[name],) = env.register_library(name, HostTestFactory(name, claim))
        yield env, devices


# -- models ----------------------------------------------------------------------------------
def mlp(dtype: Any = np.float32, hidden: int = 16) -> Any:
    """MatMul -> Add -> Relu -> Gemm -> Tanh -> MatMul, with an Exp side output."""
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    rng = np.random.default_rng(42)
    w1 = onnx.numpy_helper.from_array(rng.standard_normal((8, hidden)).astype(dtype), "w1")
    b1 = onnx.numpy_helper.from_array(rng.standard_normal(hidden).astype(dtype), "b1")
    w2 = onnx.numpy_helper.from_array(rng.standard_normal((hidden, hidden)).astype(dtype), "w2")
    b2 = onnx.numpy_helper.from_array(rng.standard_normal(hidden).astype(dtype), "b2")
    w3 = onnx.numpy_helper.from_array(rng.standard_normal((hidden, 4)).astype(dtype), "w3")
    nodes = [
        h.make_node("MatMul", ["x", "w1"], ["h1"]),
        h.make_node("Add", ["h1", "b1"], ["h2"]),
        h.make_node("Relu", ["h2"], ["h3"]),
        h.make_node("Gemm", ["h3", "w2", "b2"], ["h4"], transB=1, alpha=0.5),
        h.make_node("Tanh", ["h4"], ["h5"]),
        h.make_node("MatMul", ["h5", "w3"], ["y"]),
        h.make_node("Exp", ["h3"], ["side"]),
    ]
    return model_of(
        nodes,
        [value_info("x", ["N", 8], elem)],
        [value_info("y", ["N", 4], elem), value_info("side", ["N", hidden], elem)],
        [w1, b1, w2, b2, w3],
    )


def assert_matches(
    outputs: dict[str, Tensor], expected: dict[str, np.ndarray], rtol: float = 1e-5
) -> None:
    assert set(outputs) == set(expected)
    for name, want in expected.items():
        got = outputs[name].numpy()
        assert got.dtype == want.dtype, name
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol, err_msg=name)


# -- partitioning ----------------------------------------------------------------------------
async def test_all_claimed() -> None:
    async with environment(ep=claim_ops("Add", "Mul", "Relu")) as (env, devs):
        nodes = [
            h.make_node("Add", ["x", "x"], ["a"]),
            h.make_node("Mul", ["a", "x"], ["b"]),
            h.make_node("Relu", ["b"], ["y"]),
        ]
        model = model_of(nodes, [value_info("x", [5])], [value_info("y", [5])])
        async with await env.create_session(model, [devs["ep"]]) as sess:
            assert sess.assignment == ("ep", "ep", "ep")
            ep = env.ep_devices(ep_name="ep")[0].factory.eps[0]
            assert len(ep.compiled) == 1
            assert ep.compiled[0].meta_def.name == "test_0"
            x = np.linspace(-2, 2, 5, dtype=np.float32)
            out = await sess.run({"x": x})
            np.testing.assert_allclose(out["y"].numpy(), np.maximum((x + x) * x, 0))
            del out  # EP outputs hold allocator buffers
        assert ep.released


async def test_none_claimed() -> None:
    async with environment(ep=claim_ops()) as (env, devs):
        sess = await env.create_session(chain(), [devs["ep"]])
        assert sess.assignment == (CPU,) * 6
        x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
        assert_matches(await sess.run({"x": x}), reference(chain(), {"x": x}))
        await sess.aclose()


async def test_interleaved_claims_split_the_cpu_fallback() -> None:
    async with environment(ep=claim_ops("Add", "Mul", "Sub", "Relu")) as (env, devs):
        sess = await env.create_session(chain(), [devs["ep"]])
        assert sess.assignment == ("ep", CPU, "ep", CPU, "ep", "ep")
        ep = devs["ep"].factory.eps[0]
        assert [g.meta_def.inputs for g in ep.compiled] == [("x", "w"), ("b", "x"), ("d", "x")]
        x = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
        assert_matches(await sess.run({"x": x}), reference(chain(), {"x": x}))
        assert ep.calls == 3
        await sess.aclose()


async def test_priority_order_and_single_node_claims() -> None:
    async with environment(
        first=claim_ops("Add", fuse=False), second=claim_ops("Add", "Mul", "Sub", fuse=False)
    ) as (env, devs):
        sess = await env.create_session(chain(), [devs["first"], devs["second"]])
        assert sess.assignment == ("first", CPU, "second", CPU, "second", CPU)
        x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)
        assert_matches(await sess.run({"x": x}), reference(chain(), {"x": x}))
        await sess.aclose()
        # Reversed priority: "second" takes the Add too.
        sess = await env.create_session(chain(), [devs["second"], devs["first"]])
        assert sess.assignment == ("second", CPU, "second", CPU, "second", CPU)
        await sess.aclose()


@pytest.mark.parametrize(
    ("claims", "match"),
    [
        ([[0, 99]], r"EP 'ep' claimed node\(s\) \[99\] that do not exist"),
        ([[-1]], r"EP 'ep' claimed node\(s\) \[-1\] that do not exist"),
        ([[0, 2]], r"EP 'ep' claimed a non-convex group \(nodes \[0, 2\]\).*node\(s\) 1 \(Exp\)"),
        ([[]], "empty node group"),
        ([[1, 1]], "twice"),
    ],
)
async def test_bad_claims_are_invalid_argument(claims: list[list[int]], match: str) -> None:
    async with environment(ep=claim_fixed(*claims)) as (env, devs):
        with pytest.raises(InvalidArgument, match=match):
            await env.create_session(chain(), [devs["ep"]])
        assert not env._open_streams()


async def test_claim_overlapping_a_higher_priority_ep(caplog: pytest.LogCaptureFixture) -> None:
    """As onnxruntime's partitioner: a group with a node an earlier EP (or an earlier group)
    claimed is dropped with a logged warning, and the session runs."""
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    want = reference(chain(), {"x": x})
    async with environment(a=claim_fixed([0]), b=claim_fixed([0, 1, 2], [2])) as (env, devs):
        with caplog.at_level("WARNING", logger="aioep"):
            sess = await env.create_session(chain(), [devs["a"], devs["b"]])
        async with sess:
            assert sess.assignment[:3] == ("a", CPU, "b")
            assert_matches(await sess.run({"x": x}, output_location="host"), want)
    assert any(
        "EP 'b' claimed node(s) 0 (Add) that were already claimed by 'a'" in r.getMessage()
        for r in caplog.records
    )
    async with (
        environment(ep=claim_fixed([2], [2, 3])) as (env, devs),
        await env.create_session(chain(), [devs["ep"]]) as sess,
    ):
        assert sess.assignment[:4] == (CPU, CPU, "ep", CPU)
        assert_matches(await sess.run({"x": x}, output_location="host"), want)


async def test_bad_meta_def_and_cyclic_claims() -> None:
    def bad_meta(graph: GraphView) -> list[IndexedSubGraph]:
        return [IndexedSubGraph((0, 1), MetaDef("m", ("x",), ("b",)))]

    async with environment(ep=bad_meta) as (env, devs):
        with pytest.raises(
            InvalidArgument, match=r"meta_def inputs lack values the group reads: \['w'\]"
        ):
            await env.create_session(chain(), [devs["ep"]])
    # a1 -> b1, b2 -> c1, c2 -> a2: each group convex, together a cycle.
    nodes = [
        h.make_node("Relu", ["x"], ["a1"]),
        h.make_node("Neg", ["a1"], ["b1"]),
        h.make_node("Relu", ["x"], ["b2"]),
        h.make_node("Neg", ["b2"], ["c1"]),
        h.make_node("Relu", ["x"], ["c2"]),
        h.make_node("Neg", ["c2"], ["a2"]),
    ]
    model = model_of(
        nodes, [value_info("x", [2])], [value_info(n, [2]) for n in ("b1", "c1", "a2")]
    )
    async with environment(ep=claim_fixed([0, 5], [1, 2], [3, 4])) as (env, devs):
        with pytest.raises(InvalidArgument, match="cycle"):
            await env.create_session(model, [devs["ep"]])


# -- numerics --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
async def test_matches_onnxruntime(dtype: Any) -> None:
    async with environment(ep=claim_ops("MatMul", "Add", "Relu", "Tanh")) as (env, devs):
        for model, shapes in ((chain(dtype), [(3, 4)]), (mlp(dtype), [(1, 8), (5, 8)])):
            sess = await env.create_session(model, [devs["ep"]])
            assert CPU in sess.assignment
            assert "ep" in sess.assignment
            rng = np.random.default_rng(7)
            for shape in shapes:
                x = rng.standard_normal(shape).astype(dtype)
                assert_matches(await sess.run({"x": x}), reference(model, {"x": x}))
            await sess.aclose()


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
async def test_models_newer_than_onnxruntime_are_stamped_or_refused(split: bool) -> None:
    # onnx stamps new models with its newest IR version, which an older onnxruntime refuses
    # (onnx 1.23 writes IR 14; onnxruntime 1.23 loads up to 11): aioep caps it.
    from aioep._graph.ort_compat import ort_limits

    limits = ort_limits()
    assert limits is not None
    async with environment(ep=claim_ops("Add", "Mul") if split else claim_ops()) as (env, devs):
        model = chain()
        model.ir_version = 99
        devices = [devs["ep"]]
        async with await env.create_session(model, devices) as sess:
            assert ("ep" in sess.assignment) is split
            x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
            assert_matches(await sess.run({"x": x}), reference(model, {"x": x}))
        too_new = chain()
        too_new.opset_import[0].version = limits.max_opset + 1
        with pytest.raises(InvalidArgument, match=f"opset {limits.max_opset + 1}"):
            await env.create_session(too_new, devices)


async def test_model_from_path_and_host_device(tmp_path: Any) -> None:
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp(), path)
    async with aioep.Environment(autoload=False) as env:
        host = env.ep_devices(device_type=DeviceType.CPU)[0]
        async with await env.create_session(path, [host], {"intra_op_num_threads": 1}) as sess:
            assert sess.assignment == (CPU,) * 7
            x = np.ones((2, 8), np.float32)
            assert_matches(await sess.run({"x": x}), reference(mlp(), {"x": x}))


async def test_claims_initializer_reads_and_compile_run_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each can be long on a large model (an external-data read, an ORT session build).
    threads: dict[str, int] = {}
    real_read = aioep._session.plan._read_initializers

    def read(graph: GraphView, names: list[str]) -> list[np.ndarray]:
        threads["read"] = threading.get_ident()
        return real_read(graph, names)

    def claim(graph: GraphView) -> list[IndexedSubGraph]:
        threads["claim"] = threading.get_ident()
        return claim_ops("MatMul", "Add")(graph)

    monkeypatch.setattr(aioep._session.plan, "_read_initializers", read)
    async with (
        environment(ep=claim) as (env, devs),
        await env.create_session(mlp(), [devs["ep"]]) as sess,
    ):
        (ep,) = devs["ep"].factory.eps
        threads["compile"] = ep.compile_thread
        x = np.ones((2, 8), np.float32)
        assert_matches(await sess.run({"x": x}), reference(mlp(), {"x": x}))
    loop = threading.get_ident()
    assert set(threads) == {"read", "claim", "compile"}
    assert loop not in threads.values(), threads


# -- concurrency -----------------------------------------------------------------------------
async def test_100_concurrent_runs() -> None:
    async with environment(ep=claim_ops("Add", "Mul", "Sub", "Relu")) as (env, devs):
        model = chain()
        sess = await env.create_session(model, [devs["ep"]])
        rng = np.random.default_rng(9)
        xs = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(100)]
        results: list[Any] = [None] * 100

        async def one(i: int) -> None:
            results[i] = await sess.run({"x": xs[i]})

        async with anyio.create_task_group() as tg:
            for i in range(100):
                tg.start_soon(one, i)
        ref = ort_baseline(model)
        for x, out in zip(xs, results):
            y, c = ref.run(None, {"x": x})
            np.testing.assert_allclose(out["y"].numpy(), y, rtol=1e-6)
            np.testing.assert_allclose(out["c"].numpy(), c, rtol=1e-6)
        results.clear()
        del out
        await sess.aclose()


# -- API errors and lifecycle ----------------------------------------------------------------
async def test_run_argument_errors_and_close() -> None:
    async with environment(ep=claim_ops("Add")) as (env, devs):
        sess = await env.create_session(chain(), [devs["ep"]])
        x = np.zeros((3, 4), np.float32)
        with pytest.raises(InvalidArgument, match="missing input 'x'"):
            await sess.run({})
        with pytest.raises(InvalidArgument, match=r"unknown input name\(s\) \['z'\]"):
            await sess.run({"x": x, "z": x})
        with pytest.raises(InvalidArgument, match="dtype float64"):
            await sess.run({"x": x.astype(np.float64)})
        with pytest.raises(InvalidArgument, match="shape"):
            await sess.run({"x": np.zeros((2, 4), np.float32)})
        with pytest.raises(InvalidArgument, match="output_location"):
            await sess.run({"x": x}, output_location="gpu")
        out = await sess.run({"x": Tensor.from_numpy(x)}, output_location="host")
        assert out["y"].is_host_accessible
        await sess.aclose()
        await sess.aclose()
        assert sess.closed
        with pytest.raises(ClosedError):
            await sess.run({"x": x})
        with pytest.raises(InvalidArgument, match="unknown option"):
            await env.create_session(chain(), [devs["ep"]], {"bogus": 1})
        with pytest.raises(aioep.NoSuchFile):
            await env.create_session("/nonexistent/model.onnx")


async def test_factory_without_eps_is_not_implemented() -> None:
    class NoEp(HostTestFactory):
        def create_ep(self, ep_devices: Any, options: Any) -> Ep:
            return EpFactory.create_ep(self, ep_devices, options)

    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("noep", NoEp("noep", claim_ops()))
        with pytest.raises(aioep.NotImplementedByEp, match="cannot create an EP"):
            await env.create_session(chain(), [dev])


# -- the sim backend -------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def sim_environment(**options: Any) -> AsyncIterator[tuple[aioep.Environment, Any]]:
    pytest.importorskip("aioep_sim")
    async with aioep.Environment(autoload=False) as env:
        devices = env.register_library("sim", "aioep_sim:SimFactory", options or None)
        yield env, devices


async def test_sim_ep_fuses_and_keeps_outputs_on_device() -> None:
    async with sim_environment() as (env, sims):
        model = mlp()
        async with await env.create_session(model, [sims[0]]) as sess:
            sim = "SimExecutionProvider"
            assert sess.assignment == (sim, sim, sim, sim, sim, sim, CPU)
            x = np.random.default_rng(5).standard_normal((6, 8)).astype(np.float32)
            out = await sess.run({"x": x})
            assert not out["y"].is_host_accessible  # stays in sim device memory
            assert out["side"].is_host_accessible  # made by the CPU fallback
            with pytest.raises(InvalidArgument, match="device memory"):
                out["y"].numpy()
            host = np.empty((6, 4), np.float32)
            await aioep.copy_tensors([out["y"]], [host])
            want = reference(model, {"x": x})
            np.testing.assert_allclose(host, want["y"], rtol=1e-5, atol=1e-5)
            assert_matches(await sess.run({"x": x}, output_location="host"), want)
            del out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
async def test_sim_interleaved_matches_onnxruntime(dtype: Any) -> None:
    async with sim_environment(latency_us=20) as (env, sims):
        model = chain(dtype)
        sess = await env.create_session(model, [sims[0]])
        sim = "SimExecutionProvider"
        assert sess.assignment == (sim, CPU, sim, sim, sim, sim)
        x = np.random.default_rng(11).standard_normal((3, 4)).astype(dtype)
        assert_matches(await sess.run({"x": x}, output_location="host"), reference(model, {"x": x}))
        await sess.aclose()
        assert not env._open_streams()


async def test_the_plan_lists_the_values_that_cross_memories() -> None:
    # chain() on the sim: Add | Exp on the CPU | Mul..Relu; a goes to the host, b back.
    async with (
        sim_environment() as (env, sims),
        await env.create_session(chain(), [sims[0]]) as sess,
    ):
        plan = sess._plan
        sim = sims[0].memory_info(MemoryType.DEFAULT).device
        host = HOST_MEMORY_INFO.device
        assert [s.partition.ep_name for s in plan.steps] == [SIM, CPU, SIM]
        assert plan.copy_points == (CopyPoint("a", 1, sim, host), CopyPoint("b", 2, host, sim))
        assert plan.direct is None
    # An EP in host memory shares it with the CPU fallback: nothing crosses.
    async with (
        environment(ep=claim_ops("Add", "Mul", "Sub")) as (env, devs),
        await env.create_session(chain(), [devs["ep"]]) as sess,
    ):
        assert len(sess._plan.steps) > 1
        assert sess._plan.copy_points == ()


async def test_sim_device_inputs_user_stream_and_concurrency() -> None:
    async with sim_environment(latency_us=10) as (env, sims):
        model = chain()
        sess = await env.create_session(model, [sims[0]])
        ref = ort_baseline(model)
        rng = np.random.default_rng(13)
        xs = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(100)]
        results: list[Any] = [None] * 100

        async def one(i: int) -> None:
            results[i] = await sess.run({"x": xs[i]}, output_location="host")

        async with anyio.create_task_group() as tg:
            for i in range(100):
                tg.start_soon(one, i)
        for x, out in zip(xs, results):
            y, c = ref.run(None, {"x": x})
            np.testing.assert_allclose(out["y"].numpy(), y, rtol=1e-5)
            np.testing.assert_allclose(out["c"].numpy(), c, rtol=1e-5)

        # A device input produced on the user's stream, and outputs ordered on that stream.
        mem = sims[0].memory_info(MemoryType.DEFAULT)
        async with env.create_sync_stream(sims[0]) as stream:
            dx = env.empty((3, 4), np.float32, mem)
            aioep.copy_tensors([xs[0]], [dx], stream)
            out = await sess.run({"x": dx}, stream)
            host = np.empty((3, 4), np.float32)
            await aioep.copy_tensors([out["y"]], [host], stream)
            np.testing.assert_allclose(host, ref.run(None, {"x": xs[0]})[0], rtol=1e-5)
            del out, dx
        results.clear()
        await sess.aclose()


async def test_sim_ep_options() -> None:
    async with sim_environment() as (env, sims):
        sess = await env.create_session(
            chain(), [sims[0]], {"ep_options": {"SimExecutionProvider": {"ops": "Relu"}}}
        )
        assert sess.assignment == (CPU,) * 5 + ("SimExecutionProvider",)
        await sess.aclose()
        with pytest.raises(InvalidArgument, match="not supported"):
            await env.create_session(
                chain(), [sims[0]], {"ep_options": {"SimExecutionProvider": {"ops": "Conv"}}}
            )


# -- the ort backend's delegating EP ---------------------------------------------------------
async def test_ort_plugin_ep_delegates_to_onnxruntime() -> None:
    ort_ep = pytest.importorskip("aioep_ort._ep")
    cpu = [d for d in ort.get_ep_devices() if d.ep_name == CPU]

    class OrtCpuFactory(HostTestFactory):
        def create_ep(self, ep_devices: Any, options: Any) -> Ep:
            return ort_ep.OrtPluginEp("OrtCpu", cpu, options)

    async with environment(t=claim_ops("Add", "Mul")) as (env, devs):
        (dev,) = env.register_library("ortcpu", OrtCpuFactory("OrtCpu", claim_ops()))
        async with await env.create_session(chain(), [devs["t"], dev]) as sess:
            assert sess.assignment == ("t", "OrtCpu", "t", "OrtCpu", "OrtCpu", "OrtCpu")
            x = np.random.default_rng(17).standard_normal((3, 4)).astype(np.float32)
            assert_matches(await sess.run({"x": x}), reference(chain(), {"x": x}))


class _PointerKernel(CompiledNode):
    """Relu whose queued work holds only raw addresses, as a C-backed EP's would."""

    def __init__(self, ep: _PointerEp) -> None:
        self.ep = ep

    async def __call__(self, inputs: Sequence[Tensor], stream: Any) -> list[Tensor]:
        (x,) = inputs
        out = self.ep.allocate(x.shape, x.dtype)
        self.ep.seen.append(weakref.ref(x.buffer))
        src, dst, n, gate = x.data_ptr, out.data_ptr, x.nbytes, self.ep.gate

        def relu() -> None:
            gate.wait()
            a = np.ctypeslib.as_array((ctypes.c_float * (n // 4)).from_address(src))
            b = np.ctypeslib.as_array((ctypes.c_float * (n // 4)).from_address(dst))
            np.maximum(a, 0, out=b)

        stream.impl.enqueue(relu)
        return [out]


class _PointerEp(Ep):
    name = "ptr"

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.seen: list[weakref.ref[aioep.Buffer]] = []

    def get_capability(self, graph: GraphView) -> list[IndexedSubGraph]:
        return claim_ops("Relu")(graph)

    def compile(self, fused_groups: Sequence[FusedGroup]) -> list[CompiledNode]:
        return [_PointerKernel(self) for _ in fused_groups]


class _PointerFactory(HostTestFactory):
    def __init__(self) -> None:
        super().__init__("ptr", claim_ops("Relu"))
        self.ep = _PointerEp()

    def is_stream_aware(self) -> bool:
        return True

    def create_sync_stream(self, memory_device: Any, options: Any) -> Any:
        return ThreadStream("ptr-stream")

    def create_ep(self, ep_devices: Any, options: Any) -> Ep:
        return self.ep


async def test_cancelled_run_holds_its_tensors_until_the_stream_passes() -> None:
    x = np.random.default_rng(8).standard_normal((3, 4)).astype(np.float32)
    model = model_of(
        [h.make_node("Exp", ["x"], ["e"]), h.make_node("Relu", ["e"], ["y"])],
        [value_info("x", [3, 4])],
        [value_info("y", [3, 4])],
    )
    async with aioep.Environment(autoload=False) as env:
        factory = _PointerFactory()
        (dev,) = env.register_library("ptr", factory)
        async with await env.create_session(model, [dev]) as sess:
            assert sess.assignment == (CPU, "ptr")
            with anyio.move_on_after(0.2) as scope:
                await sess.run({"x": x})  # the Relu waits behind the gate
            assert scope.cancelled_caught
            (exp_out,) = factory.ep.seen
            gc.collect()
            # The queued Relu reads the Exp output by address: it must still be alive.
            assert exp_out() is not None
            factory.ep.gate.set()
            await sess.streams["ptr"]
            gc.collect()
            assert exp_out() is None
            out = await sess.run({"x": x})
            np.testing.assert_allclose(out["y"].numpy(), np.maximum(np.exp(x), 0), rtol=1e-6)
            del out


async def test_unregister_refused_while_a_session_is_open() -> None:
    async with aioep.Environment(autoload=False) as env:
        (dev,) = env.register_library("ep", HostTestFactory("ep", claim_ops("Add")))
        sess = await env.create_session(chain(), [dev])
        with pytest.raises(aioep.InUseError, match="1 open session"):
            env.unregister_library("ep")
        assert "ep" in env.libraries
        await sess.aclose()
        env.unregister_library("ep")
        assert "ep" not in env.libraries


async def test_environment_exit_closes_and_reports_an_open_session() -> None:
    env = aioep.Environment(autoload=False)
    await env.__aenter__()
    (dev,) = env.register_library("ep", HostTestFactory("ep", claim_ops("Add")))
    sess = await env.create_session(chain(), [dev])
    await env.aclose()  # onnxruntime's habit (never closing a session) is no warning
    assert sess.closed
    assert env.close_report is not None
    (found,) = env.close_report.sessions
    assert "Session open" in found
    assert env.state == "closed"


# -- values ONNX's conformance suite exercises -----------------------------------------------
SIM = "SimExecutionProvider"


def _scalar_model() -> Any:
    """Gemm with a 0-d bias c, then ReduceSum to a 0-d output; Add/Relu for the EPs."""
    nodes = [
        h.make_node("Gemm", ["a", "b", "c"], ["g"]),
        h.make_node("Relu", ["g"], ["r"]),
        h.make_node("ReduceSum", ["r"], ["s"], keepdims=0),
        h.make_node("Add", ["s", "c"], ["y"]),
    ]
    return model_of(
        nodes,
        [value_info("a", [2, 3]), value_info("b", [3, 4]), value_info("c", [])],
        [value_info("y", []), value_info("r", [2, 4])],
    )


@pytest.mark.parametrize("on_sim", [False, True])
async def test_scalar_inputs_and_outputs_keep_their_shape(on_sim: bool) -> None:
    async with sim_environment() as (env, sims):
        model = _scalar_model()
        async with await env.create_session(model, sims[:1] if on_sim else []) as sess:
            assert (SIM in sess.assignment) is on_sim
            rng = np.random.default_rng(0)
            feeds = {
                "a": rng.standard_normal((2, 3)).astype(np.float32),
                "b": rng.standard_normal((3, 4)).astype(np.float32),
                "c": np.array(0.5, np.float32),  # 0-d
            }
            out = await sess.run(feeds, output_location="host")
            assert out["y"].shape == ()
            assert_matches(out, reference(model, feeds))
            with pytest.raises(InvalidArgument, match=r"has shape \(1,\), the model expects \[\]"):
                await sess.run({**feeds, "c": np.array([0.5], np.float32)})


async def test_zero_size_tensors_run_on_the_sim_device() -> None:
    async with sim_environment() as (env, sims):
        nodes = [h.make_node("Add", ["x", "x"], ["a"]), h.make_node("Relu", ["a"], ["y"])]
        model = model_of(nodes, [value_info("x", ["N", 3])], [value_info("y", ["N", 3])])
        async with await env.create_session(model, [sims[0]]) as sess:
            assert sess.assignment == (SIM, SIM)
            out = await sess.run({"x": np.zeros((0, 3), np.float32)}, output_location="host")
            assert out["y"].shape == (0, 3)
            assert out["y"].numpy().shape == (0, 3)


async def test_nodes_nothing_reads_are_not_claimed_or_run() -> None:
    async with environment(ep=claim_ops("Add", "Relu", fuse=False)) as (env, devs):
        const = h.make_tensor("v", TP.FLOAT, [1], [2.0])
        nodes = [
            h.make_node("Constant", [], ["k"], value=const),  # nothing reads k
            h.make_node("Add", ["x", "x"], ["a"]),
            h.make_node("Relu", ["a"], ["dead"]),  # nothing reads dead either
            h.make_node("Exp", ["a"], ["y"]),
        ]
        model = model_of(nodes, [value_info("x", [3])], [value_info("y", [3])])
        async with await env.create_session(model, [devs["ep"]]) as sess:
            assert sess.assignment == (CPU, "ep", CPU, CPU)
            x = np.arange(3, dtype=np.float32)
            assert_matches(await sess.run({"x": x}), reference(model, {"x": x}))


def _string_model() -> Any:
    """s (strings) -> StringConcat -> Identity; x -> Add -> Identity: one of each."""
    nodes = [
        h.make_node("StringConcat", ["s", "s"], ["n"]),
        h.make_node("Identity", ["n"], ["t"]),
        h.make_node("Add", ["x", "x"], ["a"]),
        h.make_node("Identity", ["a"], ["y"]),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [value_info("s", [3], TP.STRING), value_info("x", [3])],
        [value_info("t", [3], TP.STRING), value_info("y", [3])],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 20)])


async def test_string_tensors_pass_through_the_cpu_fallback() -> None:
    async with environment(ep=claim_ops("Add", "Identity", fuse=False)) as (env, devs):
        model = _string_model()
        async with await env.create_session(model, [devs["ep"]]) as sess:
            # The Identity of strings is left to the fallback: EP values are device tensors.
            assert sess.assignment == (CPU, CPU, "ep", "ep")
            for given in (np.array(["ab", "Cd", "e"]), np.array(["ab", "Cd", "e"], object)):
                out = await sess.run({"s": given, "x": np.ones(3, np.float32)})
                assert out["t"].dtype == object
                assert out["t"].is_host_accessible
                assert out["t"].numpy().tolist() == ["abab", "CdCd", "ee"]
                np.testing.assert_array_equal(out["y"].numpy(), np.full(3, 2, np.float32))
            with pytest.raises(InvalidArgument, match="Python objects"):
                await aioep.copy_tensors([out["t"]], [np.empty(3, object)])
            with pytest.raises(InvalidArgument, match="input 'x' has dtype <U1"):
                await sess.run({"s": given, "x": np.array(["a", "b", "c"])})
            del out  # EP outputs hold allocator buffers


def _sequence_model() -> Any:
    """x -> SplitToSequence -> seq (CPU); x -> Add (EP); SequenceInsert(seq, a) (CPU):
    a sequence crosses from one CPU part to a later one, and is a graph output; opt is an
    optional input passed through Identity."""
    seq_t = h.make_sequence_type_proto(h.make_tensor_type_proto(TP.FLOAT, None))
    opt_t = h.make_optional_type_proto(h.make_tensor_type_proto(TP.FLOAT, [2]))
    nodes = [
        h.make_node("SplitToSequence", ["x"], ["seq"], axis=0),
        h.make_node("Add", ["x", "x"], ["a"]),
        h.make_node("SequenceInsert", ["seq", "a"], ["out"]),
        h.make_node("Identity", ["opt"], ["opt_out"]),
    ]
    graph = h.make_graph(
        nodes,
        "g",
        [value_info("x", [2, 2]), h.make_value_info("opt", opt_t)],
        [h.make_value_info("out", seq_t), h.make_value_info("opt_out", opt_t)],
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])


async def test_sequences_and_optionals_pass_through_the_cpu_fallback() -> None:
    async with environment(ep=claim_ops("Add", "Identity")) as (env, devs):
        model = _sequence_model()
        async with await env.create_session(model, [devs["ep"]]) as sess:
            assert sess.assignment == (CPU, "ep", CPU, CPU)
            x = np.arange(4, dtype=np.float32).reshape(2, 2)
            out = await sess.run({"x": x, "opt": None})
            assert out["opt_out"] is None
            assert isinstance(out["out"], list)
            assert all(isinstance(t, Tensor) for t in out["out"])
            want = [x[:1], x[1:], x + x]
            for got, expected in zip(out["out"], want, strict=True):
                np.testing.assert_array_equal(got.numpy(), expected)
            out = await sess.run({"x": x, "opt": np.ones(2, np.float32)})
            np.testing.assert_array_equal(out["opt_out"].numpy(), np.ones(2, np.float32))
            with pytest.raises(InvalidArgument, match="input 'x'"):
                await sess.run({"x": [x], "opt": None})
            del out, got


async def test_a_sequence_input_needs_a_list() -> None:
    seq_t = h.make_sequence_type_proto(h.make_tensor_type_proto(TP.FLOAT, None))
    nodes = [h.make_node("SequenceLength", ["s"], ["n"])]
    graph = h.make_graph(
        nodes, "g", [h.make_value_info("s", seq_t)], [value_info("n", [], TP.INT64)]
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    async with environment() as (env, _), await env.create_session(model) as sess:
        out = await sess.run({"s": [np.ones(2, np.float32), np.zeros(3, np.float32)]})
        assert out["n"].numpy() == 2
        with pytest.raises(InvalidArgument, match="input 's' is a sequence"):
            await sess.run({"s": np.ones(2, np.float32)})


async def test_sim_computes_float16_in_float32_and_skips_old_opsets() -> None:
    async with sim_environment() as (env, sims):
        rng = np.random.default_rng(7)
        a = rng.random((4, 64)).astype(np.float16)
        b = rng.random((64, 5)).astype(np.float16)
        nodes = [h.make_node("MatMul", ["a", "b"], ["y"])]
        model = model_of(
            nodes,
            [value_info("a", [4, 64], TP.FLOAT16), value_info("b", [64, 5], TP.FLOAT16)],
            [value_info("y", [4, 5], TP.FLOAT16)],
        )
        async with await env.create_session(model, [sims[0]]) as sess:
            assert sess.assignment == (SIM,)
            out = await sess.run({"a": a, "b": b}, output_location="host")
            want = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)
            np.testing.assert_array_equal(out["y"].numpy(), want)
        # Before opset 7, Add broadcasts by its 'broadcast'/'axis' attributes: not the sim's.
        old = h.make_model(
            h.make_graph(
                [h.make_node("Add", ["x", "x"], ["y"])],
                "g",
                [value_info("x", [3])],
                [value_info("y", [3])],
            ),
            opset_imports=[h.make_opsetid("", 6)],
        )
        graph = GraphView.from_model(old)
        ep = sims[0].factory.create_ep([sims[0]], None)
        assert ep.get_capability(graph) == []


async def test_progress_bar_on_create_session(capsys: pytest.CaptureFixture[str]) -> None:
    """create_session shows a bar over its stages when asked (or, by default, when stderr
    is a terminal: not under pytest's capture), and refuses a progress that is not a bool."""
    async with sim_environment() as (env, sims):
        async with await env.create_session(chain(), [sims[0]]):
            pass
        assert "create_session" not in capsys.readouterr().err  # not a terminal: no bar
        async with await env.create_session(chain(), [sims[0]], {"progress": True}):
            pass
        err = capsys.readouterr().err
        assert "create_session" in err
        assert "3/3" in err  # initializer upload, the sim's compile, the CPU part's load
        async with await env.create_session(chain(), [sims[0]], {"progress": False}):
            pass
        assert capsys.readouterr().err == ""
        with pytest.raises(InvalidArgument, match="progress must be True, False or None"):
            await env.create_session(chain(), [sims[0]], {"progress": "yes"})


async def test_compiled_groups_are_released_when_create_session_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An EP whose compile fails for its second group (here: returns a non-CompiledNode)
    fails create_session, and the groups compiled before it are released."""
    released: list[FusedGroup] = []

    class _Tracked(_HostKernel):
        def release(self) -> None:
            released.append(self.group)

    def compile_half(self: HostTestEp, fused: Sequence[FusedGroup]) -> list[Any]:
        return [_Tracked(self, fused[0]), *["not a node"] * (len(fused) - 1)]

    monkeypatch.setattr(HostTestEp, "compile", compile_half)
    async with environment(ep=claim_ops("Add", "Mul", "Sub")) as (env, devs):
        with pytest.raises(InvalidArgument, match=r"not an aioep\.CompiledNode"):
            await env.create_session(chain(), [devs["ep"]])
    assert len(released) == 1


async def test_an_omitted_optional_input_is_none_as_in_onnxruntime() -> None:
    """onnxruntime runs a model whose optional-typed input is left out (it is None); so does
    aioep, while a missing tensor input is still refused."""
    opt = h.make_optional_type_proto(h.make_tensor_type_proto(TP.FLOAT, [2]))
    graph = h.make_graph(
        [h.make_node("OptionalHasElement", ["o"], ["has"]), h.make_node("Identity", ["x"], ["y"])],
        "g",
        [value_info("x", [2]), h.make_value_info("o", opt)],
        [value_info("y", [2]), value_info("has", [], TP.BOOL)],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    x = np.array([1.5, -2.0], np.float32)
    oracle = ort_baseline(model)  # IR version capped: the newest onnxruntime for 3.10 reads IR 11
    want_y, want_has = oracle.run(None, {"x": x})
    async with (
        aioep.Environment(autoload=False) as env,
        await env.create_session(model) as sess,
    ):
        out = await sess.run({"x": x}, output_location="host")
        np.testing.assert_array_equal(out["y"].numpy(), want_y)
        assert bool(out["has"].numpy()) is bool(want_has) is False
        with pytest.raises(InvalidArgument, match="missing input 'x'"):
            await sess.run({"o": None})
        binding = sess.io_binding()
        binding.bind_input("x", x)
        bound = await sess.run_with_binding(binding)
        np.testing.assert_array_equal(np.asarray(bound["y"].numpy()), want_y)
        del out, bound, binding
