"""The sim execution provider: runs a few ONNX ops with numpy on sim device memory.

It claims the nodes it supports (default domain, float and int tensors), fuses
each maximal connected convex group of them into one compiled node, and runs that
node as one piece of work on the sim stream's worker thread, so it is ordered
with the copies on that stream like a kernel launch on a GPU stream. Output
shapes are worked out on the host at enqueue time (as a real EP does before a
launch); the data is read and written only through the device's memory views.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import numpy as np
import numpy.typing as npt

from aioep import InvalidArgument, MemoryType, SyncStream, Tensor
from aioep.abc import CompiledNode, Ep, FusedGroup, GraphView, IndexedSubGraph, MetaDef, Node

from ._stream import SimStream

if TYPE_CHECKING:
    from ._device import SimDevices

__all__ = ["SUPPORTED_OPS", "SimEp"]

_Array = npt.NDArray[Any]


def _gemm(node: Node, a: _Array, b: _Array, c: _Array | None = None) -> _Array:
    at = node.attributes
    if at.get("transA", 0):
        a = a.T
    if at.get("transB", 0):
        b = b.T
    out = float(at.get("alpha", 1.0)) * (a @ b)
    if c is not None:
        out = out + float(at.get("beta", 1.0)) * c
    return out.astype(a.dtype, copy=False)


_UNARY: dict[str, Callable[[_Array], _Array]] = {
    "Relu": lambda x: np.maximum(x, x.dtype.type(0)),
    "Sigmoid": lambda x: (1 / (1 + np.exp(-x))).astype(x.dtype, copy=False),
    "Tanh": np.tanh,
    "Identity": lambda x: x,
    "Neg": np.negative,
    "Abs": np.abs,
}
_BINARY: dict[str, Callable[[_Array, _Array], _Array]] = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "MatMul": np.matmul,
}
SUPPORTED_OPS = frozenset({*_UNARY, *_BINARY, "Gemm"})
MIN_OPSET = 7
"""Oldest ``ai.onnx`` opset claimed: before 7, Add/Sub/Mul/Gemm broadcast by their
``broadcast``/``axis`` attributes rather than numpy's rules (onnxruntime's floor too)."""
_FLOAT_ONLY = frozenset({"Sigmoid", "Tanh"})
_DTYPES = frozenset(np.dtype(t) for t in ("float16", "float32", "float64", "int32", "int64"))


def _matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if not a or not b:
        raise InvalidArgument("MatMul needs inputs of rank >= 1")
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise InvalidArgument(f"MatMul: shapes {a} and {b} do not match")
    out = (*np.broadcast_shapes(a2[:-2], b2[:-2]), a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return tuple(int(d) for d in out)


def _shape_of(node: Node, shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    op = node.op_type
    if op in _UNARY:
        return shapes[0]
    if op == "MatMul":
        return _matmul_shape(shapes[0], shapes[1])
    if op == "Gemm":
        a, b = shapes[0], shapes[1]
        if len(a) != 2 or len(b) != 2:
            raise InvalidArgument(f"Gemm {node.name!r}: A and B must be 2-D, got {a} and {b}")
        m = a[1] if node.attributes.get("transA", 0) else a[0]
        n = b[0] if node.attributes.get("transB", 0) else b[1]
        return (m, n)
    return tuple(int(d) for d in np.broadcast_shapes(*shapes))


class _SimKernel(CompiledNode):
    """One fused group: output shapes on the host, the numpy work on the stream's worker."""

    def __init__(self, ep: SimEp, group: FusedGroup) -> None:
        self._ep = ep
        self._meta = group.meta_def
        self._nodes = group.nodes

    def _plan(self, inputs: Sequence[Tensor]) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        known = {n: (t.shape, t.dtype) for n, t in zip(self._meta.inputs, inputs)}
        for node in self._nodes:
            args = [known[n] for n in node.inputs if n]
            known[node.outputs[0]] = (_shape_of(node, [s for s, _ in args]), args[0][1])
        return known

    async def __call__(self, inputs: Sequence[Tensor], stream: SyncStream | None) -> list[Tensor]:
        if len(inputs) != len(self._meta.inputs):
            raise InvalidArgument(
                f"{self._meta.name}: {len(inputs)} input(s) given, {len(self._meta.inputs)} expected"
            )
        plan = self._plan(inputs)
        outputs = [
            self._ep.allocate(plan[n][0], plan[n][1], stream=stream) for n in self._meta.outputs
        ]
        work = _Work(self._ep.factory, self._meta, self._nodes, list(inputs), outputs)
        if stream is None:
            await anyio.to_thread.run_sync(work)
        else:
            impl = stream.impl
            if not isinstance(impl, SimStream):
                raise InvalidArgument(f"{self._meta.name}: {stream!r} is not a sim stream")
            impl.enqueue(work)  # the closure keeps the tensors alive until it ran
        return outputs


class _Work:
    """The device work of one call (runs on the stream's worker thread)."""

    __slots__ = ("factory", "inputs", "meta", "nodes", "outputs")

    def __init__(
        self,
        factory: SimDevices,
        meta: MetaDef,
        nodes: Sequence[Node],
        inputs: list[Tensor],
        outputs: list[Tensor],
    ) -> None:
        self.factory = factory
        self.meta = meta
        self.nodes = nodes
        self.inputs = inputs
        self.outputs = outputs

    def _view(self, t: Tensor) -> _Array:
        if t.is_host_accessible:
            return t.numpy()
        raw = self.factory.device(t.memory_info).memory.view(t.data_ptr, t.nbytes)
        return raw.view(t.dtype).reshape(t.shape)

    def __call__(self) -> None:
        env: dict[str, _Array] = {n: self._view(t) for n, t in zip(self.meta.inputs, self.inputs)}
        for node in self.nodes:
            args = [env[n] for n in node.inputs if n]
            half = args[0].dtype == np.float16
            if half:
                # fp16 storage, fp32 arithmetic (as GPUs and onnxruntime's CPU kernels do):
                # numpy's float16 matmul rounds every partial sum.
                args = [a.astype(np.float32) for a in args]
            op = node.op_type
            if op in _UNARY:
                out = _UNARY[op](args[0])
            elif op == "Gemm":
                out = _gemm(node, *args)
            else:
                out = _BINARY[op](args[0], args[1])
            env[node.outputs[0]] = out.astype(np.float16) if half else out
        for name, t in zip(self.meta.outputs, self.outputs):
            np.copyto(self._view(t), env[name], casting="no")


class SimEp(Ep):
    """The sim EP for one session; ``factory.create_ep(ep_devices, options)`` makes it.

    Options: ``ops`` (comma-separated subset of `SUPPORTED_OPS` to claim).
    """

    name = "SimExecutionProvider"

    def __init__(self, factory: SimDevices, options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        opts = dict(options or {})
        ops = opts.pop("ops", None)
        if opts:
            raise InvalidArgument(f"SimExecutionProvider: unknown option(s) {sorted(opts)}")
        if ops is None:
            self.ops = SUPPORTED_OPS
        else:
            wanted = frozenset(o.strip() for o in str(ops).split(",") if o.strip())
            bad = sorted(wanted - SUPPORTED_OPS)
            if bad:
                raise InvalidArgument(
                    f"SimExecutionProvider: ops {bad} are not supported; "
                    f"supported: {sorted(SUPPORTED_OPS)}"
                )
            self.ops = wanted
        self.factory = factory

    def _supports(self, graph: GraphView, node: Node) -> bool:
        if node.domain not in ("", "ai.onnx") or node.op_type not in self.ops:
            return False
        opset = graph.opsets.get("", graph.opsets.get("ai.onnx", 0))
        if opset < MIN_OPSET:
            return False
        if len(node.outputs) != 1 or node.implicit_inputs:
            return False
        for name in [n for n in node.inputs if n] + list(node.outputs):
            info = graph.value_info(name)
            dtype = None if info is None else info.dtype
            if dtype is None or dtype not in _DTYPES:
                return False
            if node.op_type in _FLOAT_ONLY and dtype.kind != "f":
                return False
        return True

    def get_capability(self, graph: GraphView) -> list[IndexedSubGraph]:
        supported = [i for i in graph.unassigned_nodes if self._supports(graph, graph.nodes[i])]
        claims = []
        for k, group in enumerate(graph.convex_groups(supported)):
            inputs, outputs = graph.boundary(group)
            claims.append(IndexedSubGraph(group, MetaDef(f"sim_fused_{k}", inputs, outputs)))
        return claims

    def compile(self, fused_groups: Sequence[FusedGroup]) -> list[CompiledNode]:
        if self.memory_info.memory_type is not MemoryType.DEFAULT:  # pragma: no cover
            raise InvalidArgument(f"{self!r} runs on DEFAULT memory only")
        return [_SimKernel(self, g) for g in fused_groups]
