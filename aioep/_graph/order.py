"""Node orders: a stable topological order of a model's nodes, and a topological order of
units that keeps runs of one label together (for partitions and fused groups)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Any

from .._base.errors import InvalidArgument

__all__ = ["grouped_runs", "topological_order"]


def topological_order(
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


def grouped_runs(
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
