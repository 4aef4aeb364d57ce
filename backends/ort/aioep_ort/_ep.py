"""An aioep EP that delegates to onnxruntime with a plugin EP selected.

ORT's plugin EPs run inside ORT, so this EP claims every node no higher-priority
EP took (as convex groups), and compiles each group into an
``onnxruntime.InferenceSession`` over the group's sub-model, created with
``SessionOptions.add_provider_for_devices(ort_ep_devices, provider_options)``.
ORT then partitions the sub-model between the plugin EP and its own CPU EP, and
does the plugin's device copies itself. The inputs and outputs of a compiled
group are host tensors (``memory_info`` is host memory), so the session copies
to and from other devices around it; each call runs ORT in a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio.to_thread
import numpy as np

from aioep import InvalidArgument, MemoryInfo, SyncStream, Tensor
from aioep.abc import (
    HOST_MEMORY_INFO,
    CompiledNode,
    Ep,
    FusedGroup,
    GraphView,
    IndexedSubGraph,
    MetaDef,
)

from ._ort import ort, translate

__all__ = ["OrtPluginEp"]


def _contiguous(array: Any) -> Any:
    """``array`` in C order, shape kept (``np.ascontiguousarray`` turns 0-d into 1-d)."""
    if array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(array).reshape(array.shape)


def _device_value(graph: GraphView, name: str) -> bool:
    info = graph.value_info(name)
    return info is not None and info.is_device_tensor


class _OrtGroup(CompiledNode):
    """One fused group run by an ORT session with the plugin EP."""

    def __init__(self, session: Any, meta: MetaDef, feeds: Sequence[str], ep_name: str) -> None:
        self._session = session
        self._meta = meta
        self._feeds = frozenset(feeds)
        self._ep_name = ep_name
        order = [o.name for o in session.get_outputs()]
        self._positions = [order.index(name) for name in meta.outputs]

    def _run(self, feeds: dict[str, Any]) -> list[Any]:
        try:
            return list(self._session.run(None, feeds))
        except Exception as exc:
            raise translate(exc, f"{self._ep_name} running {self._meta.name!r}") from exc

    async def __call__(self, inputs: Sequence[Tensor], stream: SyncStream | None) -> list[Tensor]:
        feeds = {n: t.numpy() for n, t in zip(self._meta.inputs, inputs) if n in self._feeds}
        results = await anyio.to_thread.run_sync(self._run, feeds)
        return [Tensor.from_numpy(_contiguous(results[i])) for i in self._positions]

    def release(self) -> None:
        self._session = None


class OrtPluginEp(Ep):
    """Runs node groups through onnxruntime with the plugin EP of ``ort_devices`` selected.

    Args:
        name: the aioep EP name (the plugin's EP name).
        ort_devices: the ``onnxruntime`` EP devices to select (``ort.get_ep_devices()`` items).
        options: provider options for ``add_provider_for_devices`` (values become str).
        check: called before sessions are created (e.g. to probe that the device works).
    """

    def __init__(
        self,
        name: str,
        ort_devices: Sequence[Any],
        options: Mapping[str, Any] | None = None,
        *,
        check: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        if not ort_devices:
            raise InvalidArgument(f"{name}: no onnxruntime EP devices to select")
        self.name = name
        self.uses_stream = False  # ORT orders its own device work inside session.run
        self._ort_devices = list(ort_devices)
        self._provider_options = {str(k): str(v) for k, v in (options or {}).items()}
        self._check = check

    @property
    def memory_info(self) -> MemoryInfo:
        """Host memory: ORT takes host inputs and moves them to the plugin's device itself."""
        return HOST_MEMORY_INFO

    def get_capability(self, graph: GraphView) -> list[IndexedSubGraph]:
        # Nodes that read or write host-only values (strings, sequences, optionals, values
        # of unknown type) stay with the session's CPU fallback: group inputs and outputs
        # are tensors, and a split there keeps them off the group's boundary.
        nodes = [
            i
            for i in graph.unassigned_nodes
            if all(
                _device_value(graph, n)
                for n in (*graph.nodes[i].all_inputs, *graph.nodes[i].outputs)
                if n
            )
        ]
        claims = []
        for k, group in enumerate(graph.convex_groups(nodes)):
            inputs, outputs = graph.boundary(group)
            claims.append(IndexedSubGraph(group, MetaDef(f"{self.name}_ort_{k}", inputs, outputs)))
        return claims

    def compile(self, fused_groups: Sequence[FusedGroup]) -> list[CompiledNode]:
        if self._check is not None:
            self._check()
        rt = ort()
        compiled: list[CompiledNode] = []
        for group in fused_groups:
            meta, graph = group.meta_def, group.graph
            model = graph.extract_model([n.index for n in group.nodes], meta.inputs, meta.outputs)
            so = rt.SessionOptions()
            so.log_severity_level = 3
            try:
                so.add_provider_for_devices(self._ort_devices, self._provider_options)
                session = rt.InferenceSession(model.SerializeToString(), sess_options=so)
            except Exception as exc:
                raise translate(
                    exc, f"{self.name}: creating the onnxruntime session for {meta.name!r}"
                ) from exc
            feeds = [n for n in meta.inputs if n not in graph.initializers]
            compiled.append(_OrtGroup(session, meta, feeds, self.name))
        return compiled
