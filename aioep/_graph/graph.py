"""A read-only view of an ONNX model graph for execution providers (ORT's ``OrtGraph`` /
``GraphViewer``), built on the ``onnx`` package.

EPs look at a `GraphView` in ``get_capability``: nodes in topological order
(`Node`: index, op type, domain, inputs, outputs, attributes), value types
and shapes (`ValueInfo`, from ONNX shape inference), and initializers
(`Initializer`; external data is read only when asked).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .._base.errors import InvalidArgument, NoSuchFile, NotImplementedByEp
from .inference import GraphValues
from .order import grouped_runs, topological_order
from .ort_compat import ir_version_for_ort
from .types import (
    _GRAPH_ATTRIBUTE_TYPES,
    Initializer,
    Node,
    ValueInfo,
    _Attributes,
    _new_node,
    _onnx,
    _value_info,
)

if TYPE_CHECKING:
    from onnx import ModelProto

__all__ = ["GraphView", "Initializer", "Node", "ValueInfo", "with_assigned"]


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


class GraphView:
    """A read-only view of a model's main graph; build it with
    [`from_model`][aioep.abc.GraphView.from_model].

    Attributes: ``nodes`` (topological order), ``inputs`` and ``outputs``
    ([`ValueInfo`][aioep.abc.ValueInfo], graph inputs that are initializers excluded),
    ``initializers`` (name -> [`Initializer`][aioep.abc.Initializer]), ``opsets`` (domain ->
    version).
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
        "external_data_dir",
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
    _values: GraphValues
    external_data_dir: Path | None
    """The folder external initializer data is read from: the model file's, the one given
    with a model's bytes or proto, or None."""
    initializers: Mapping[str, Initializer]
    inputs: tuple[ValueInfo, ...]
    model_path: Path | None
    nodes: tuple[Node, ...]
    opsets: Mapping[str, int]

    def __init__(self) -> None:
        raise TypeError("use GraphView.from_model(path_or_model_proto) to create a GraphView")

    @classmethod
    def from_model(
        cls,
        model: str | os.PathLike[str] | bytes | ModelProto,
        *,
        external_data_dir: str | os.PathLike[str] | None = None,
    ) -> GraphView:
        """View an ONNX model given as a path, its serialized ``bytes`` or an ``onnx.ModelProto``.

        External initializer data is not loaded. A model file's external data lies in its
        folder; a model given as bytes or a proto has none, unless ``external_data_dir``
        names it (for such models only: as onnxruntime's
        ``session.model_external_initializers_file_folder_path``).

        Raises:
            NoSuchFile: the model file or ``external_data_dir`` does not exist.
            InvalidArgument: ``model`` is not a model, its graph is not a DAG, an initializer
                is malformed (unknown element type, negative dimension), or
                ``external_data_dir`` was given with a path.
        """
        onnx = _onnx()
        path: Path | None = None
        if isinstance(model, (str, os.PathLike)):
            path = Path(os.fspath(model))
            if not path.is_file():
                raise NoSuchFile(f"ONNX model file {str(path)!r} does not exist")
            if external_data_dir is not None:
                raise InvalidArgument(
                    f"external_data_dir is for a model given as bytes or a ModelProto; the "
                    f"external data of the model file {str(path)!r} lies in its own folder"
                )
            try:
                proto = onnx.load(os.fspath(path), load_external_data=False)
            except Exception as exc:
                raise InvalidArgument(
                    f"{str(path)!r} is not a readable ONNX model: {type(exc).__name__}: {exc}"
                ) from exc
        elif isinstance(model, bytes):
            proto = onnx.ModelProto()
            try:
                proto.ParseFromString(model)
            except Exception as exc:  # protobuf's DecodeError
                raise InvalidArgument(
                    f"the {len(model)} bytes given are not a serialized ONNX model: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        elif isinstance(model, onnx.ModelProto):
            proto = model
        else:
            raise InvalidArgument(
                "expected an ONNX model path, its bytes or an onnx.ModelProto, "
                f"got {type(model).__name__}"
            )
        folder = None if path is None else path.parent
        if external_data_dir is not None:
            folder = Path(os.fspath(external_data_dir))
            if not folder.is_dir():
                raise NoSuchFile(f"external_data_dir {str(folder)!r} is not a folder")
        self = object.__new__(cls)
        self.model_path = path
        self.external_data_dir = folder
        self._model = proto
        self._assigned = MappingProxyType({})
        self._build(onnx, proto, folder)
        return self

    def _build(self, onnx: Any, model: Any, base_dir: Path | None) -> None:
        graph = model.graph
        self.opsets = MappingProxyType({o.domain: int(o.version) for o in model.opset_import})
        self.initializers = MappingProxyType(
            {t.name: Initializer(t, base_dir) for t in graph.initializer}
        )
        self._values = GraphValues(model, self.initializers)
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
        order = topological_order(
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
        """The graph outputs' [`ValueInfo`][aioep.abc.ValueInfo] (shapes from inference)."""
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
        runs = grouped_runs([self.predecessors(i) for i in range(len(self.nodes))], labels)
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
        onnxruntime). Defaults to the group's [`boundary`][aioep.abc.GraphView.boundary];
        initializers the group reads become initializers of the sub-model (external data loaded).

        The sub-model keeps the source model's opsets and IR version, the latter capped to
        the newest the installed onnxruntime loads.

        Raises:
            InvalidArgument: the model needs an opset or IR version newer than the
                installed onnxruntime supports.
        """
        return extract_model(self, indices, inputs, outputs, load_external_data=load_external_data)

    def __repr__(self) -> str:
        where = f" {str(self.model_path)!r}" if self.model_path is not None else ""
        return f"<GraphView{where} nodes={len(self.nodes)} inputs={len(self.inputs)} outputs={len(self.outputs)}>"


def with_assigned(graph: GraphView, assigned: Mapping[int, str]) -> GraphView:
    """A view of ``graph`` whose nodes in ``assigned`` are taken (node index -> EP name): what
    the partitioner shows the next EP."""
    view = object.__new__(GraphView)
    for name in GraphView.__slots__:
        object.__setattr__(view, name, getattr(graph, name))
    view._assigned = MappingProxyType(dict(assigned))
    return view


def extract_model(
    graph: GraphView,
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


def _value_info_proto(graph: GraphView, helper: Any, name: str) -> Any:
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
