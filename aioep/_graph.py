"""A read-only view of an ONNX model graph for execution providers (ORT's ``OrtGraph`` /
``GraphViewer``), built on the ``onnx`` package.

EPs look at a :class:`GraphView` in ``get_capability``: nodes in topological order
(:class:`Node`: index, op type, domain, inputs, outputs, attributes), value types
and shapes (:class:`ValueInfo`, from ONNX shape inference), and initializers
(:class:`Initializer`; external data is read only when asked).
"""

from __future__ import annotations

import functools
import heapq
import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import numpy.typing as npt

from ._errors import InvalidArgument, NoSuchFile, NotImplementedByEp
from ._ort_compat import ir_version_for_ort

__all__ = ["GraphView", "Initializer", "Node", "ValueInfo"]

Dim = int | str | None


def _onnx() -> Any:
    try:
        import onnx
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise NotImplementedByEp(
            "aioep sessions need the 'onnx' package: pip install 'aioep[onnx]'"
        ) from exc
    return onnx


@dataclass(frozen=True)
class ValueInfo:
    """Type and shape of a value; ``shape`` is None when the rank is unknown and a
    dimension is an int, a symbolic name (str) or None when unknown.

    ``kind`` is the ONNX type's kind: ``"tensor"``, ``"sequence"``, ``"optional"``,
    ``"map"``, ``"sparse_tensor"``, ``"opaque"``, or ``"unknown"`` where the type is
    not known; ``elem_type`` and ``shape`` describe tensors only (0 and None
    otherwise). ``type_proto`` is the ``onnx.TypeProto`` of a value that is not a
    tensor (None for tensors and unknown types).
    """

    name: str
    elem_type: int
    shape: tuple[Dim, ...] | None
    kind: str = "tensor"
    type_proto: Any = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def dtype(self) -> np.dtype[Any] | None:
        """The numpy dtype of a tensor value, or None (unknown type, or not a tensor)."""
        if not self.elem_type:
            return None
        onnx = _onnx()
        try:
            dtype: np.dtype[Any] = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(self.elem_type))
        except (KeyError, TypeError, ValueError):
            return None
        return dtype

    @property
    def is_device_tensor(self) -> bool:
        """True for a tensor of a known numeric (or bool) element type: a value that can
        live in device memory. String tensors, sequences, optionals and maps, and values
        of unknown type, live on the host only."""
        if self.kind != "tensor":
            return False
        dtype = self.dtype
        return dtype is not None and not dtype.hasobject


@dataclass(frozen=True)
class Node:
    """One node; ``index`` is its position in :attr:`GraphView.nodes` (topological order).

    ``inputs`` keeps ONNX's empty string for a missing optional input.
    ``implicit_inputs`` are outer-scope values read by subgraph attributes (If, Loop, Scan).
    """

    index: int
    name: str
    op_type: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: Mapping[str, Any] = field(compare=False)
    implicit_inputs: tuple[str, ...] = ()
    proto: Any = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def all_inputs(self) -> tuple[str, ...]:
        """Explicit (non-empty) then implicit inputs, without duplicates."""
        seen: dict[str, None] = {}
        for name in (*self.inputs, *self.implicit_inputs):
            if name:
                seen.setdefault(name, None)
        return tuple(seen)


class Initializer:
    """A constant tensor of the model; its data is read only by :meth:`numpy`."""

    __slots__ = ("_base_dir", "_proto", "dtype", "external", "name", "shape")

    def __init__(self, proto: Any, base_dir: Path | None) -> None:
        onnx = _onnx()
        self._proto = proto
        self._base_dir = base_dir
        self.name: str = proto.name
        self.shape: tuple[int, ...] = tuple(int(d) for d in proto.dims)
        self.dtype: np.dtype[Any] = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(proto.data_type))
        self.external: bool = proto.data_location == onnx.TensorProto.EXTERNAL

    @property
    def proto(self) -> Any:
        """The ``onnx.TensorProto`` (external data not loaded)."""
        return self._proto

    @property
    def nbytes(self) -> int:
        """Size of the data in bytes."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def numpy(self) -> npt.NDArray[Any]:
        """Read the data (from the external file when the data is external).

        Raises:
            NoSuchFile: the external data file is missing.
        """
        onnx = _onnx()
        base = "" if self._base_dir is None else os.fspath(self._base_dir)
        if self.external and self._base_dir is None:
            raise InvalidArgument(
                f"initializer {self.name!r} has external data, but the model was given as a "
                "proto without a path; load it with GraphView.from_model(path)"
            )
        if self.external:
            location = next((e.value for e in self._proto.external_data if e.key == "location"), "")
            file = Path(base) / location
            if not file.is_file():
                raise NoSuchFile(
                    f"initializer {self.name!r}: external data file {str(file)!r} does not exist"
                )
        try:
            return np.asarray(onnx.numpy_helper.to_array(self._proto, base_dir=base))
        except FileNotFoundError as exc:
            raise NoSuchFile(
                f"initializer {self.name!r}: external data file not found: {exc}"
            ) from exc

    def __repr__(self) -> str:
        ext = " external" if self.external else ""
        return f"<Initializer {self.name!r} {self.dtype}{list(self.shape)}{ext}>"


def _attribute_value(onnx: Any, attr: Any) -> Any:
    if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        return attr.g if attr.type == onnx.AttributeProto.GRAPH else tuple(attr.graphs)
    value = onnx.helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, list):
        return tuple(
            v.decode("utf-8", errors="replace") if isinstance(v, bytes) else v for v in value
        )
    return value


class _Attributes(Mapping[str, Any]):
    """A node's attributes, each converted from its ``AttributeProto`` when first read."""

    __slots__ = ("_done", "_protos")

    def __init__(self, protos: Sequence[Any]) -> None:
        self._protos = {a.name: a for a in protos}
        self._done: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        try:
            return self._done[key]
        except KeyError:
            value = _attribute_value(_onnx(), self._protos[key])
            self._done[key] = value
            return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._protos)

    def __len__(self) -> int:
        return len(self._protos)

    def __repr__(self) -> str:
        return repr(dict(self))


_GRAPH_ATTRIBUTE_TYPES = (5, 10)  # AttributeProto.GRAPH, GRAPHS


def _new_node(**fields: Any) -> Node:
    # Node is frozen: its generated __init__ sets each field through object.__setattr__,
    # which for a model of thousands of nodes took longer than the rest of the view.
    node = object.__new__(Node)
    node.__dict__.update(fields)
    return node


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


_INFERENCE_KEEP_BYTES = 4096


def _outer_scope_reads(graph: Any) -> set[str]:
    """Names a subgraph reads that it neither defines nor receives as inputs."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    reads: set[str] = set()
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                reads.add(name)
        for attr in node.attribute:
            for sub in (attr.g,) if attr.HasField("g") else tuple(attr.graphs):
                reads |= _outer_scope_reads(sub) - defined
        defined.update(o for o in node.output if o)
    return reads


def _value_info(onnx: Any, vi: Any) -> ValueInfo:
    t = vi.type
    which = t.WhichOneof("value")
    if which != "tensor_type":
        if which is None:
            return ValueInfo(vi.name, 0, None, "unknown")
        # A copy: the inferred model this came from holds a copy of every initializer.
        proto = onnx.TypeProto()
        proto.CopyFrom(t)
        return ValueInfo(vi.name, 0, None, which.removesuffix("_type"), proto)
    tt = t.tensor_type
    shape: tuple[Dim, ...] | None = None
    if tt.HasField("shape"):
        dims: list[Dim] = []
        for d in tt.shape.dim:
            kind = d.WhichOneof("value")
            dims.append(d.dim_value if kind == "dim_value" else d.dim_param if kind else None)
        shape = tuple(dims)
    if not tt.elem_type:
        return ValueInfo(vi.name, 0, shape, "unknown")
    return ValueInfo(vi.name, int(tt.elem_type), shape)


class _Values:
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


class GraphView:
    """A read-only view of a model's main graph; build it with :meth:`from_model`.

    Attributes: ``nodes`` (topological order), ``inputs`` and ``outputs``
    (:class:`ValueInfo`, graph inputs that are initializers excluded),
    ``initializers`` (name -> :class:`Initializer`), ``opsets`` (domain -> version).
    """

    __slots__ = (
        "_assigned",
        "_consumers",
        "_model",
        "_output_names",
        "_outputs",
        "_preds",
        "_producer",
        "_values",
        "initializers",
        "inputs",
        "model_path",
        "nodes",
        "opsets",
    )

    _assigned: Mapping[int, str]
    _consumers: dict[str, tuple[int, ...]]
    _model: Any
    _producer: dict[str, int]
    _output_names: tuple[str, ...]
    _outputs: tuple[ValueInfo, ...] | None
    _preds: tuple[frozenset[int], ...]
    _values: _Values
    initializers: Mapping[str, Initializer]
    inputs: tuple[ValueInfo, ...]
    model_path: Path | None
    nodes: tuple[Node, ...]
    opsets: Mapping[str, int]

    def __init__(self) -> None:
        raise TypeError("use GraphView.from_model(path_or_model_proto) to create a GraphView")

    @classmethod
    def from_model(cls, model: str | os.PathLike[str] | Any) -> GraphView:
        """View an ONNX model given as a path or an ``onnx.ModelProto``.

        External initializer data is not loaded. Raises :class:`NoSuchFile` for a
        missing file and :class:`InvalidArgument` for something that is not a model
        or a graph that is not a DAG.
        """
        onnx = _onnx()
        path: Path | None = None
        if isinstance(model, (str, os.PathLike)):
            path = Path(os.fspath(model))
            if not path.is_file():
                raise NoSuchFile(f"ONNX model file {str(path)!r} does not exist")
            try:
                proto = onnx.load(os.fspath(path), load_external_data=False)
            except Exception as exc:
                raise InvalidArgument(
                    f"{str(path)!r} is not a readable ONNX model: {type(exc).__name__}: {exc}"
                ) from exc
        elif isinstance(model, onnx.ModelProto):
            proto = model
        else:
            raise InvalidArgument(
                f"expected an ONNX model path or onnx.ModelProto, got {type(model).__name__}"
            )
        self = object.__new__(cls)
        self.model_path = path
        self._model = proto
        self._assigned = MappingProxyType({})
        self._build(onnx, proto, None if path is None else path.parent)
        return self

    def _build(self, onnx: Any, model: Any, base_dir: Path | None) -> None:
        graph = model.graph
        self.opsets = MappingProxyType({o.domain: int(o.version) for o in model.opset_import})
        self.initializers = MappingProxyType(
            {t.name: Initializer(t, base_dir) for t in graph.initializer}
        )
        self._values = _Values(model, self.initializers)
        self.inputs = tuple(
            _value_info(onnx, i) for i in graph.input if i.name not in self.initializers
        )
        self._outputs = None
        self._output_names = tuple(o.name for o in graph.output)

        raw = list(graph.node)
        implicit: list[tuple[str, ...]] = []
        for node in raw:
            reads: set[str] = set()
            for attr in node.attribute:
                if attr.type in _GRAPH_ATTRIBUTE_TYPES:
                    for sub in (attr.g,) if attr.HasField("g") else tuple(attr.graphs):
                        reads |= _outer_scope_reads(sub)
            implicit.append(tuple(sorted(reads - set(node.input))) if reads else ())
        order = _topological_order(
            raw, implicit, set(self.initializers) | {i.name for i in graph.input}
        )
        nodes: list[Node] = []
        producer: dict[str, int] = {}
        consumers: dict[str, list[int]] = {}
        preds: list[frozenset[int]] = []
        for index, old in enumerate(order):
            p = raw[old]
            inputs = tuple(p.input)
            all_inputs = tuple(dict.fromkeys(n for n in (*inputs, *implicit[old]) if n))
            node = _new_node(
                index=index,
                name=p.name,
                op_type=p.op_type,
                domain=p.domain,
                inputs=inputs,
                outputs=tuple(p.output),
                attributes=_Attributes(p.attribute),
                implicit_inputs=implicit[old],
                proto=p,
                all_inputs=all_inputs,  # the cached property's value
            )
            nodes.append(node)
            # Producers come first in topological order: they are all known by now.
            preds.append(frozenset(producer[n] for n in all_inputs if n in producer))
            for out in node.outputs:
                if out:
                    producer[out] = index
            for name in all_inputs:
                consumers.setdefault(name, []).append(index)
        self.nodes = tuple(nodes)
        self._producer = producer
        self._preds = tuple(preds)
        self._consumers = {k: tuple(v) for k, v in consumers.items()}

    # -- queries ---------------------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The underlying ``onnx.ModelProto`` (do not modify it)."""
        return self._model

    def value_info(self, name: str) -> ValueInfo | None:
        """Type and shape of a value (graph input, output, intermediate or initializer).

        The first call runs ONNX shape inference (a session that only uses the CPU
        fallback never needs it).
        """
        return self._values.get(name)

    @property
    def outputs(self) -> tuple[ValueInfo, ...]:
        """The graph outputs' :class:`ValueInfo` (shapes from inference)."""
        if self._outputs is None:
            onnx = _onnx()
            self._outputs = tuple(
                self._values.get(o.name) or _value_info(onnx, o) for o in self._model.graph.output
            )
        return self._outputs

    def producer(self, name: str) -> int | None:
        """Index of the node that produces ``name`` (None for inputs and initializers)."""
        return self._producer.get(name)

    def consumers(self, name: str) -> tuple[int, ...]:
        """Indices of the nodes that read ``name`` (explicitly or from a subgraph)."""
        return self._consumers.get(name, ())

    def predecessors(self, index: int) -> set[int]:
        """Indices of the nodes whose outputs node ``index`` reads."""
        return set(self._preds[index])

    def successors(self, index: int) -> set[int]:
        """Indices of the nodes that read an output of node ``index``."""
        return {c for name in self.nodes[index].outputs if name for c in self.consumers(name)}

    def is_constant(self, name: str) -> bool:
        """True for an initializer."""
        return name in self.initializers

    @property
    def output_names(self) -> tuple[str, ...]:
        """Names of the graph outputs."""
        return self._output_names

    def assigned_ep(self, index: int) -> str | None:
        """The EP that already claimed node ``index`` (during partitioning), or None."""
        return self._assigned.get(index)

    @property
    def unassigned_nodes(self) -> tuple[int, ...]:
        """Indices of the nodes no higher-priority EP has claimed yet."""
        return tuple(i for i in range(len(self.nodes)) if i not in self._assigned)

    def _with_assigned(self, assigned: Mapping[int, str]) -> GraphView:
        view = object.__new__(GraphView)
        for name in GraphView.__slots__:
            object.__setattr__(view, name, getattr(self, name))
        view._assigned = MappingProxyType(dict(assigned))
        return view

    def boundary(self, indices: Iterable[int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(inputs, outputs) of a node group: the values it reads from outside (initializers
        included) and the values it makes that are read outside or are graph outputs."""
        group = set(indices)
        produced: set[str] = set()
        inputs: dict[str, None] = {}
        for i in sorted(group):
            for name in self.nodes[i].all_inputs:
                if name not in produced:
                    inputs.setdefault(name, None)
            produced.update(o for o in self.nodes[i].outputs if o)
        graph_outputs = set(self.output_names)
        outputs = [
            name
            for i in sorted(group)
            for name in self.nodes[i].outputs
            if name and (name in graph_outputs or any(c not in group for c in self.consumers(name)))
        ]
        return tuple(inputs), tuple(outputs)

    def convex_groups(self, indices: Iterable[int]) -> list[tuple[int, ...]]:
        """Split a node set into connected groups that are each convex and that can run one
        after another (a helper for EPs that fuse what they support, like ORT's
        ``CreateSupportedPartitions``).

        Nodes are visited in a topological order that stays within the set as long
        as it can; each run of set nodes is then split into connected components.
        """
        wanted = set(indices)
        labels = [i in wanted for i in range(len(self.nodes))]
        runs = _grouped_runs([self.predecessors(i) for i in range(len(self.nodes))], labels)
        groups: list[tuple[int, ...]] = []
        for label, run in runs:
            if label:
                groups.extend(self._components(run))
        return groups

    def _components(self, run: Sequence[int]) -> list[tuple[int, ...]]:
        members = set(run)
        seen: set[int] = set()
        out: list[tuple[int, ...]] = []
        for start in run:
            if start in seen:
                continue
            comp, stack = [], [start]
            seen.add(start)
            while stack:
                n = stack.pop()
                comp.append(n)
                for m in (self.predecessors(n) | self.successors(n)) & members:
                    if m not in seen:
                        seen.add(m)
                        stack.append(m)
            out.append(tuple(sorted(comp)))
        return out

    # -- sub-models ------------------------------------------------------------------------
    def extract_model(
        self,
        indices: Iterable[int],
        inputs: Sequence[str] | None = None,
        outputs: Sequence[str] | None = None,
        *,
        load_external_data: bool = True,
    ) -> Any:
        """A standalone ``onnx.ModelProto`` that computes a node group (for delegating it to
        onnxruntime). Defaults to the group's :meth:`boundary`; initializers the group
        reads become initializers of the sub-model (external data loaded).

        The sub-model keeps the source model's opsets and IR version, the latter capped to
        the newest the installed onnxruntime loads.

        Raises:
            InvalidArgument: the model needs an opset or IR version newer than the
                installed onnxruntime supports.
        """
        onnx = _onnx()
        helper = onnx.helper
        group = sorted(set(indices))
        b_in, b_out = self.boundary(group)
        inputs = b_in if inputs is None else tuple(inputs)
        outputs = b_out if outputs is None else tuple(outputs)
        inits = []
        graph_inputs = []
        for name in inputs:
            init = self.initializers.get(name)
            if init is not None:
                if init.external and load_external_data:
                    inits.append(onnx.numpy_helper.from_array(init.numpy(), name))
                else:
                    inits.append(init.proto)
            else:
                graph_inputs.append(self._value_info_proto(helper, name))
        model = helper.make_model(
            helper.make_graph(
                [self.nodes[i].proto for i in group],
                f"{self._model.graph.name or 'graph'}_part",
                graph_inputs,
                [self._value_info_proto(helper, name) for name in outputs],
                initializer=inits,
            ),
            opset_imports=list(self._model.opset_import),
            ir_version=ir_version_for_ort(self._model),
        )
        model.functions.extend(self._model.functions)
        return model

    def _value_info_proto(self, helper: Any, name: str) -> Any:
        info = self.value_info(name)
        if info is None or info.kind == "unknown":
            raise NotImplementedByEp(
                f"the type of value {name!r} is unknown (ONNX shape inference could not find it), "
                "so the graph cannot be split there"
            )
        if info.kind != "tensor":
            return helper.make_value_info(name, info.type_proto)
        shape = None if info.shape is None else list(info.shape)
        return helper.make_tensor_value_info(name, info.elem_type, shape)

    def __repr__(self) -> str:
        where = f" {str(self.model_path)!r}" if self.model_path is not None else ""
        return f"<GraphView{where} nodes={len(self.nodes)} inputs={len(self.inputs)} outputs={len(self.outputs)}>"


def _topological_order(
    raw: Sequence[Any], implicit: Sequence[tuple[str, ...]], known: set[str]
) -> list[int]:
    """Kahn's algorithm, stable (the file order where it is already valid)."""
    producer: dict[str, int] = {}
    for i, node in enumerate(raw):
        for out in node.output:
            if out:
                if out in producer:
                    raise InvalidArgument(
                        f"value {out!r} is produced by two nodes ({raw[producer[out]].name!r} and "
                        f"{node.name!r})"
                    )
                producer[out] = i
    if all(
        producer.get(n, -1) < i for i, node in enumerate(raw) for n in (*node.input, *implicit[i])
    ):
        return list(range(len(raw)))  # the file order is already topological (the usual case)
    indegree = [0] * len(raw)
    succ: list[list[int]] = [[] for _ in raw]
    for i, node in enumerate(raw):
        preds = {producer[n] for n in (*node.input, *implicit[i]) if n and n in producer}
        for p in preds:
            succ[p].append(i)
        indegree[i] = len(preds)
    ready = [i for i, d in enumerate(indegree) if d == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for s in succ[i]:
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(ready, s)
    if len(order) != len(raw):
        stuck = [raw[i].name or f"#{i}" for i in range(len(raw)) if indegree[i] > 0]
        raise InvalidArgument(f"the graph has a cycle through nodes {stuck[:10]}")
    return order


def _grouped_runs(
    preds: Sequence[Iterable[int]], labels: Sequence[Any]
) -> list[tuple[Any, list[int]]]:
    """Order units topologically, preferring to continue with the label just emitted, and
    return the runs of equal labels in that order.

    ``preds[u]`` are unit ``u``'s predecessors. Raises ValueError (with the units
    left over) if the units do not form a DAG.
    """
    n = len(preds)
    succ: list[list[int]] = [[] for _ in range(n)]
    indegree = [0] * n
    for u, ps in enumerate(preds):
        uniq = set(ps)
        uniq.discard(u)
        indegree[u] = len(uniq)
        for p in uniq:
            succ[p].append(u)
    ready: dict[Any, list[int]] = {}
    for u in range(n):
        if indegree[u] == 0:
            heapq.heappush(ready.setdefault(labels[u], []), u)
    runs: list[tuple[Any, list[int]]] = []
    current: Any = object()
    emitted = 0
    while emitted < n:
        heap = ready.get(current)
        if not heap:
            candidates = [(h[0], label) for label, h in ready.items() if h]
            if not candidates:
                left = [u for u in range(n) if indegree[u] > 0]
                raise ValueError(left)
            _, current = min(candidates, key=lambda c: c[0])
            heap = ready[current]
            runs.append((current, []))
        u = heapq.heappop(heap)
        runs[-1][1].append(u)
        emitted += 1
        for s in succ[u]:
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(ready.setdefault(labels[s], []), s)
    return runs
