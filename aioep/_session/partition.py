"""Graph partitioning: ask each EP, in priority order, which nodes it claims; validate the
claims; group what nobody claimed into convex subgraphs for the CPU fallback; and order
all partitions so that each runs after the partitions it reads from."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from .._base.errors import InvalidArgument
from .._graph.graph import GraphView, with_assigned
from .._graph.order import grouped_runs
from .._plugin.ep import Ep, IndexedSubGraph, MetaDef

_log = logging.getLogger("aioep")

__all__ = ["CPU_EP_NAME", "Partition", "assignment_of", "partition_graph"]

CPU_EP_NAME = "CPUExecutionProvider"


@dataclass(frozen=True)
class Partition:
    """A group of nodes run by one EP (``ep is None``: the onnxruntime CPU fallback)."""

    ep: Ep | None
    nodes: tuple[int, ...]
    meta_def: MetaDef

    @property
    def ep_name(self) -> str:
        """The EP's name, or ``"CPUExecutionProvider"`` for the fallback."""
        return CPU_EP_NAME if self.ep is None else self.ep.name


class _Reach:
    """Ancestor and descendant sets of every node, as int bitsets (computed on first use:
    only a claim of several nodes needs them)."""

    def __init__(self, graph: GraphView) -> None:
        self._graph = graph
        self.anc: list[int] = []
        self.desc: list[int] = []

    def _compute(self) -> None:
        graph = self._graph
        n = len(graph.nodes)
        preds = [graph.predecessors(i) for i in range(n)]
        self.anc = [0] * n
        for i in range(n):  # nodes are in topological order
            bits = 0
            for p in preds[i]:
                bits |= self.anc[p] | (1 << p)
            self.anc[i] = bits
        self.desc = [0] * n
        succ: list[list[int]] = [[] for _ in range(n)]
        for i, ps in enumerate(preds):
            for p in ps:
                succ[p].append(i)
        for i in reversed(range(n)):
            bits = 0
            for s in succ[i]:
                bits |= self.desc[s] | (1 << s)
            self.desc[i] = bits

    def path_nodes_outside(self, group: Sequence[int]) -> list[int]:
        """Nodes outside ``group`` on a path that leaves the group and comes back."""
        if not self.anc and self._graph.nodes:
            self._compute()
        mask = 0
        anc = desc = 0
        for i in group:
            mask |= 1 << i
            anc |= self.anc[i]
            desc |= self.desc[i]
        bad = anc & desc & ~mask
        return [i for i in range(bad.bit_length()) if bad >> i & 1]


def _describe(graph: GraphView, indices: Sequence[int]) -> str:
    parts = []
    for i in list(indices)[:8]:
        node = graph.nodes[i]
        parts.append(f"{i} ({node.op_type}{' ' + repr(node.name) if node.name else ''})")
    more = f" and {len(indices) - 8} more" if len(indices) > 8 else ""
    return ", ".join(parts) + more


def _check_meta_def(graph: GraphView, ep: Ep, group: Sequence[int], meta: MetaDef) -> None:
    where = f"EP {ep.name!r}: fused group {meta.name!r} (nodes {list(group)})"
    if not isinstance(meta, MetaDef):
        raise InvalidArgument(f"{where}: meta_def must be an aioep.MetaDef, got {meta!r}")
    b_in, b_out = graph.boundary(group)
    produced = {o for i in group for o in graph.nodes[i].outputs if o}
    for kind, names in (("inputs", meta.inputs), ("outputs", meta.outputs)):
        if len(set(names)) != len(names):
            raise InvalidArgument(f"{where}: meta_def {kind} {list(names)} repeat a name")
    missing_in = [n for n in b_in if n not in meta.inputs]
    if missing_in:
        raise InvalidArgument(f"{where}: meta_def inputs lack values the group reads: {missing_in}")
    bad_in = [n for n in meta.inputs if n in produced or graph.value_info(n) is None]
    if bad_in:
        raise InvalidArgument(
            f"{where}: meta_def inputs {bad_in} are made inside the group or are not graph values"
        )
    missing_out = [n for n in b_out if n not in meta.outputs]
    if missing_out:
        raise InvalidArgument(
            f"{where}: meta_def outputs lack values read outside the group: {missing_out}"
        )
    bad_out = [n for n in meta.outputs if n not in produced]
    if bad_out:
        raise InvalidArgument(f"{where}: meta_def outputs {bad_out} are not made by the group")


def _host_only(graph: GraphView, names: Sequence[str]) -> list[str]:
    """The values among ``names`` that cannot live in device memory (strings, sequences,
    optionals, maps, unknown types)."""
    out = []
    for name in names:
        info = graph.value_info(name)
        if info is None or not info.is_device_tensor:
            out.append(name)
    return out


def _dead_nodes(graph: GraphView) -> frozenset[int]:
    """Nodes whose outputs no graph output depends on."""
    live: set[int] = set()
    stack = [p for name in graph.output_names if (p := graph.producer(name)) is not None]
    while stack:
        i = stack.pop()
        if i not in live:
            live.add(i)
            stack.extend(graph.predecessors(i) - live)
    return frozenset(range(len(graph.nodes))) - live


def partition_graph(graph: GraphView, eps: Sequence[Ep]) -> list[Partition]:
    """Assign every node to exactly one EP (or the CPU fallback) and return the partitions
    in an order in which they can run one after another.

    A claim whose inputs or outputs include a value that only the host can hold (a
    string tensor, a sequence, an optional, a map, or a value of unknown type) is left
    to the CPU fallback, whose onnxruntime session handles those values: EP inputs
    and outputs are device tensors. So is a claim of nodes that no graph output
    depends on; CPU parts with no outputs do not run.

    Raises:
        InvalidArgument: an EP's claim names a node that does not exist, is not convex,
            has a meta-def that does not match its nodes, or the claims depend on each
            other in a cycle. A claim that overlaps an earlier one is dropped with a
            logged warning (logger ``aioep``), as onnxruntime does.
    """
    claims = _collect_claims(graph, eps)
    units, runs = _order_units(graph, claims)
    return _make_partitions(graph, claims, units, runs)


@dataclass(frozen=True)
class _Claim:
    """A node group an EP claimed and keeps (checked, sorted)."""

    ep: Ep
    group: tuple[int, ...]
    meta_def: MetaDef | None


def _collect_claims(graph: GraphView, eps: Sequence[Ep]) -> list[_Claim]:
    """Ask each EP in priority order for its node groups; check them and keep those it
    will run."""
    assigned: dict[int, str] = {}
    dead = _dead_nodes(graph)
    reach = _Reach(graph)
    claims: list[_Claim] = []
    for ep in eps:
        for claim in _capability(ep, with_assigned(graph, assigned)):
            if not isinstance(claim, IndexedSubGraph):
                raise InvalidArgument(
                    f"EP {ep.name!r}: get_capability returned {claim!r}, not an IndexedSubGraph"
                )
            group = _checked_group(graph, ep, claim.nodes, assigned, reach)
            if group is None:
                continue
            if claim.meta_def is not None:
                _check_meta_def(graph, ep, group, claim.meta_def)
                interface = (*claim.meta_def.inputs, *claim.meta_def.outputs)
            else:
                b_in, b_out = graph.boundary(group)
                interface = (*b_in, *b_out)
            if _host_only(graph, interface):
                continue  # the nodes stay unclaimed: the fallback (or a later EP) runs them
            if dead.issuperset(group):
                # Nothing reads what the group makes: no EP runs it (a group with no outputs
                # cannot be compiled), and as a CPU part with no outputs it does not run.
                continue
            for i in group:
                assigned[i] = ep.name
            claims.append(_Claim(ep, group, claim.meta_def))
    return claims


def _capability(ep: Ep, view: GraphView) -> Sequence[object]:
    """``ep.get_capability(view)``, checked to be a list (its items are checked one by one)."""
    result = ep.get_capability(view)
    if not isinstance(result, (list, tuple)):
        raise InvalidArgument(
            f"EP {ep.name!r}: get_capability must return a list of IndexedSubGraph, "
            f"got {type(result).__name__}"
        )
    return result


def _checked_group(
    graph: GraphView,
    ep: Ep,
    nodes: Sequence[int],
    assigned: dict[int, str],
    reach: _Reach,
) -> tuple[int, ...] | None:
    """The claimed ``nodes``, sorted, once they are known, distinct and convex; None (with a
    logged warning) when a node was already claimed."""
    n = len(graph.nodes)
    if not nodes:
        raise InvalidArgument(f"EP {ep.name!r} claimed an empty node group")
    bad = [i for i in nodes if isinstance(i, bool) or not isinstance(i, int)]
    if bad:
        raise InvalidArgument(f"EP {ep.name!r} claimed node indices that are not ints: {bad}")
    missing = sorted({i for i in nodes if not 0 <= i < n})
    if missing:
        raise InvalidArgument(
            f"EP {ep.name!r} claimed node(s) {missing} that do not exist (the graph has {n} nodes)"
        )
    if len(set(nodes)) != len(nodes):
        raise InvalidArgument(f"EP {ep.name!r} claimed node(s) twice in one group: {list(nodes)}")
    taken = sorted(i for i in nodes if i in assigned)
    if taken:
        # As onnxruntime's partitioner: claims are honoured in EP priority order, and a
        # group with a node already assigned cannot take it; the whole group is dropped.
        owners = sorted({assigned[i] for i in taken})
        _log.warning(
            "EP %r claimed node(s) %s that were already claimed by %s; that group (nodes %s) "
            "is dropped and its nodes go to later EPs or the CPU fallback",
            ep.name,
            _describe(graph, taken),
            ", ".join(repr(o) for o in owners),
            sorted(nodes),
        )
        return None
    group = tuple(sorted(nodes))
    if len(group) > 1:
        outside = reach.path_nodes_outside(group)
        if outside:
            raise InvalidArgument(
                f"EP {ep.name!r} claimed a non-convex group (nodes {list(group)}): a path "
                f"leaves it and comes back through node(s) {_describe(graph, outside)}"
            )
    return group


def _order_units(
    graph: GraphView, claims: Sequence[_Claim]
) -> tuple[list[tuple[int, ...]], list[tuple[object, list[int]]]]:
    """The units (each claim, then each unclaimed node on its own) and their runs in a
    topological order that keeps runs of unclaimed nodes long."""
    n = len(graph.nodes)
    unit_of = [-1] * n
    for u, claim in enumerate(claims):
        for i in claim.group:
            unit_of[i] = u
    units: list[tuple[int, ...]] = [c.group for c in claims]
    for i in range(n):
        if unit_of[i] < 0:
            unit_of[i] = len(units)
            units.append((i,))
    labels: list[object] = [u if u < len(claims) else None for u in range(len(units))]
    preds = [{unit_of[p] for i in members for p in graph.predecessors(i)} for members in units]
    try:
        runs = grouped_runs(preds, labels)
    except ValueError as exc:
        stuck = sorted({claims[u].ep.name for u in exc.args[0] if u < len(claims)})
        groups = [list(units[u]) for u in exc.args[0] if u < len(claims)]
        raise InvalidArgument(
            f"the claims of EP(s) {stuck} depend on each other in a cycle (groups {groups}); "
            "no order can run them"
        ) from None
    return units, runs


def _make_partitions(
    graph: GraphView,
    claims: Sequence[_Claim],
    units: Sequence[tuple[int, ...]],
    runs: Sequence[tuple[object, list[int]]],
) -> list[Partition]:
    """One partition per claim and per run of unclaimed nodes, in run order, each with a
    meta-def (the claim's own, or the group's boundary under a numbered name)."""
    partitions: list[Partition] = []
    counters: dict[str, int] = {}

    def numbered(name: str) -> str:
        k = counters.get(name, 0)
        counters[name] = k + 1
        return f"{name}_{k}"

    for label, run in runs:
        if label is None:
            # One onnxruntime session per run of unclaimed nodes, connected or not: the run
            # is consecutive in a topological order, so it is convex, and every session costs
            # its creation (a model with hundreds of independent unclaimed nodes would
            # otherwise build hundreds of sessions).
            part = tuple(sorted(units[u][0] for u in run))
            b_in, b_out = graph.boundary(part)
            partitions.append(Partition(None, part, MetaDef(numbered(CPU_EP_NAME), b_in, b_out)))
            continue
        for u in run:
            claim = claims[u]
            meta = claim.meta_def
            if meta is None:
                b_in, b_out = graph.boundary(claim.group)
                meta = MetaDef(numbered(claim.ep.name), b_in, b_out)
            partitions.append(Partition(claim.ep, claim.group, meta))
    return partitions


def assignment_of(graph: GraphView, partitions: Sequence[Partition]) -> tuple[str, ...]:
    """The EP name per node, in graph-view node order."""
    names = [CPU_EP_NAME] * len(graph.nodes)
    for p in partitions:
        for i in p.nodes:
            names[i] = p.ep_name
    return tuple(names)
