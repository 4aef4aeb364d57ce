"""An aioep EP that delegates to onnxruntime with a plugin EP selected.

ORT's plugin EPs run inside ORT, so this EP claims every node no higher-priority
EP took (as convex groups), and compiles each group into an
``onnxruntime.InferenceSession`` over the group's sub-model, created with
``SessionOptions.add_provider_for_devices(ort_ep_devices, provider_options)``.
ORT then partitions the sub-model between the plugin EP and its own CPU EP.

Where the plugin's device has DEFAULT memory that aioep can copy to and from
(``device_io``), the group's inputs and outputs live there: each call binds the
inputs through ORT's IOBinding where they are and keeps the outputs on the device,
as aioep tensors over ORT's own OrtValues (see ``_binding``). Otherwise inputs and
outputs are host arrays and ORT copies inside ``run``. Calls run ORT in a worker
thread; concurrent calls run concurrently (ORT sessions are thread-safe for runs).

The arrays ``InferenceSession.run`` returns do not own their memory: ORT's tensor does,
and a plugin EP may have allocated it (OpenVINO's host outputs come from the plugin's
allocator), so freeing it runs the plugin library's code. Each such output therefore
counts as a live value of the library's registration (see ``_registry``) until its last
view is gone: the library is unregistered from ORT only after that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio.to_thread
import numpy as np

from aioep import ClosedError, InvalidArgument, MemoryInfo, SyncStream, Tensor
from aioep.abc import (
    HOST_MEMORY_INFO,
    CompiledNode,
    Ep,
    FusedGroup,
    GraphView,
    IndexedSubGraph,
    MetaDef,
)

from ._binding import DeviceIO
from ._memory import release_in_background
from ._ort import ort, translate
from ._registry import Registration

__all__ = ["OrtPluginEp"]


def _contiguous(array: Any) -> Any:
    """``array`` in C order, shape kept (``np.ascontiguousarray`` turns 0-d into 1-d)."""
    if array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(array).reshape(array.shape)


class _OrtOutput:
    """The numpy base of one ORT-owned output: holds ORT's array and the registrations of
    the libraries whose code may free it, counted as live values until it is collected."""

    __slots__ = ("__array_interface__", "_array", "_registrations")

    def __init__(self, array: Any, registrations: Sequence[Registration]) -> None:
        for reg in registrations:
            reg.value_created()
        self._registrations = registrations
        self._array = array
        self.__array_interface__ = array.__array_interface__

    def __del__(self) -> None:
        # ORT's buffer goes first: its deleter may be the plugin library's code.
        self._array = None
        for reg in self._registrations:
            reg.value_released()


def _owned_by_aioep(array: Any, registrations: Sequence[Registration]) -> Any:
    """``array`` (C order, shape kept) as memory whose release cannot outlive the library."""
    array = _contiguous(array)
    if array.base is None or not registrations:
        return array
    return np.asarray(_OrtOutput(array, registrations))


def _device_value(graph: GraphView, name: str) -> bool:
    info = graph.value_info(name)
    return info is not None and info.is_device_tensor


class _OrtGroup(CompiledNode):
    """One fused group run by an ORT session with the plugin EP."""

    def __init__(
        self,
        session: Any,
        meta: MetaDef,
        feeds: Sequence[str],
        ep_name: str,
        registrations: Sequence[Registration] = (),
        io: DeviceIO | None = None,
    ) -> None:
        self._session = session
        self._meta = meta
        self._feeds = frozenset(feeds)
        self._ep_name = ep_name
        self._registrations = tuple(registrations)
        self._io = io
        # One library's lock covers the session's device (an EP's devices share a library).
        self._device_lock = registrations[0].device_lock if registrations else threading.RLock()
        order = [o.name for o in session.get_outputs()]
        self._positions = [order.index(name) for name in meta.outputs]
        # Outputs of a fixed shape: only those are bound to a caller's tensor (a dynamic
        # one that came out another size would fail inside ORT, not with aioep's message).
        self._static = {
            name: tuple(shape)
            for name, shape in zip(order, (o.shape for o in session.get_outputs()))
            if all(isinstance(d, int) for d in shape)
        }

    def _run(self, feeds: dict[str, Any]) -> list[Any]:
        try:
            with self._device_lock:
                return list(self._session.run(None, feeds))
        except Exception as exc:
            raise translate(exc, f"{self._ep_name} running {self._meta.name!r}") from exc

    def _run_bound(
        self, inputs: dict[str, Tensor], io: DeviceIO, into: Sequence[Tensor | None]
    ) -> list[Tensor]:
        values, written, error = self._run_with_iobinding(inputs, io, into)
        outputs: list[Tensor] = []
        if error is None:
            try:
                outputs.extend(
                    t if w and t is not None else io.adopt(v)
                    for v, w, t in zip(values, written, into)
                )
            except Exception as exc:  # an output aioep cannot hold
                error = exc
                outputs.clear()
            finally:
                with self._device_lock:
                    values.clear()  # adopted outputs hold their OrtValues themselves
        if error is not None:
            raise error
        return outputs

    def _run_with_iobinding(
        self, inputs: dict[str, Tensor], io: DeviceIO, into: Sequence[Tensor | None]
    ) -> tuple[list[Any], list[bool], BaseException | None]:
        # ORT objects never outlive this call in a frame a traceback keeps: the session, the
        # binding and the host copies bound to it are dropped (under the device lock) before
        # any error is raised, so a kept exception cannot release them after the library is
        # unregistered.
        session = self._session
        if session is None:
            return [], [], ClosedError(f"{self._ep_name}: {self._meta.name!r} was released")
        values: list[Any] = []
        written: list[bool] = []
        keep: list[Any] = []  # host copies bound to the run
        error: BaseException | None = None
        with self._device_lock:
            binding = session.io_binding()
            try:
                keep.extend(io.bind_input(binding, name, t) for name, t in inputs.items())
                for name, dest in zip(self._meta.outputs, into):
                    written.append(io.bind_output(binding, name, dest))
                session.run_with_iobinding(binding)
                values = binding.get_outputs()
            except Exception as exc:
                error = translate(exc, f"{self._ep_name} running {self._meta.name!r}")
                error.__cause__ = None
                error.__suppress_context__ = True
            finally:
                session = binding = None
                keep.clear()
        return values, written, error

    async def __call__(self, inputs: Sequence[Tensor], stream: SyncStream | None) -> list[Tensor]:
        return await self.run_into(inputs, [None] * len(self._meta.outputs), stream)

    async def run_into(
        self,
        inputs: Sequence[Tensor],
        outputs: Sequence[Tensor | None],
        stream: SyncStream | None,
    ) -> list[Tensor]:
        """Run the group; with device I/O, outputs given a tensor of the model's fixed shape
        are written straight into it by ORT."""
        if self._io is not None:
            bound = {n: t for n, t in zip(self._meta.inputs, inputs) if n in self._feeds}
            into = [
                t if t is not None and self._static.get(n) == t.shape else None
                for n, t in zip(self._meta.outputs, outputs)
            ]
            return await anyio.to_thread.run_sync(self._run_bound, bound, self._io, into)
        feeds = {n: t.numpy() for n, t in zip(self._meta.inputs, inputs) if n in self._feeds}
        results = await anyio.to_thread.run_sync(self._run, feeds)
        regs = self._registrations
        return [Tensor.from_numpy(_owned_by_aioep(results[i], regs)) for i in self._positions]

    def release(self) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        # Destroying an ORT session frees its device buffers (which needs the device lock) and
        # joins its thread pool: the releaser thread does it, never the caller (the event
        # loop). The session counts on the registrations until then, so that no library is
        # unregistered from ORT under it.
        held = [session]
        del session

        def drop() -> None:
            held.clear()
            for reg in self._registrations:
                reg.value_released()

        release_in_background(self._device_lock, drop)


class OrtPluginEp(Ep):
    """Runs node groups through onnxruntime with the plugin EP of ``ort_devices`` selected.

    Args:
        name: the aioep EP name (the plugin's EP name).
        ort_devices: the ``onnxruntime`` EP devices to select (``ort.get_ep_devices()`` items).
        options: provider options for ``add_provider_for_devices`` (values become str).
        check: called before sessions are created (e.g. to probe that the device works).
        registrations: the ORT registrations of the plugin libraries behind ``ort_devices``;
            outputs ORT hands back keep them registered while they live.
        device_io: binds inputs and outputs in the plugin device's memory; None keeps
            them on the host.
    """

    def __init__(
        self,
        name: str,
        ort_devices: Sequence[Any],
        options: Mapping[str, Any] | None = None,
        *,
        check: Callable[[], None] | None = None,
        registrations: Sequence[Registration] = (),
        device_io: DeviceIO | None = None,
    ) -> None:
        super().__init__()
        if not ort_devices:
            raise InvalidArgument(f"{name}: no onnxruntime EP devices to select")
        self.name = name
        self.uses_stream = False  # ORT orders its own device work inside session.run
        self.initializers_in_memory = False  # each group's sub-model holds its initializers
        self._ort_devices = list(ort_devices)
        self._provider_options = {str(k): str(v) for k, v in (options or {}).items()}
        self._check = check
        self._registrations = tuple(registrations)
        self.device_io = device_io
        """Device-resident I/O, or None (host arrays in and out)."""

    @property
    def memory_info(self) -> MemoryInfo:
        """The plugin device's memory with device I/O; otherwise host memory (ORT then
        takes host inputs and moves them to the plugin's device itself)."""
        return HOST_MEMORY_INFO if self.device_io is None else self.device_io.memory_info

    def allocate(
        self,
        shape: Sequence[int],
        dtype: Any,
        *,
        stream: SyncStream | None = None,
        memory_info: MemoryInfo | None = None,
    ) -> Tensor:
        """Session I/O in the device's memory is one OrtValue per tensor (bindable by handle)."""
        io = self.device_io
        if io is None or (memory_info is not None and memory_info != io.memory_info):
            return super().allocate(shape, dtype, stream=stream, memory_info=memory_info)
        return io.allocate(tuple(int(d) for d in shape), np.dtype(dtype))

    def get_capability(self, graph: GraphView) -> list[IndexedSubGraph]:
        # Nodes that read or write host-only values (strings, sequences, optionals, values
        # of unknown type) stay with the session's CPU fallback: group inputs and outputs
        # are tensors, and a split there keeps them off the group's boundary. An output
        # nothing reads (Dropout's mask, often of unknown type) never crosses a boundary.
        graph_outputs = set(graph.output_names)

        def crosses(name: str) -> bool:
            return bool(graph.consumers(name)) or name in graph_outputs

        nodes = [
            i
            for i in graph.unassigned_nodes
            if all(_device_value(graph, n) for n in graph.nodes[i].all_inputs if n)
            and all(_device_value(graph, n) for n in graph.nodes[i].outputs if n and crosses(n))
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
            for reg in self._registrations:
                reg.value_created()  # released with the session (_OrtGroup.release)
            try:
                so.add_provider_for_devices(self._ort_devices, self._provider_options)
                session = rt.InferenceSession(model.SerializeToString(), sess_options=so)
            except Exception as exc:
                for reg in self._registrations:
                    reg.value_released()
                raise translate(
                    exc, f"{self.name}: creating the onnxruntime session for {meta.name!r}"
                ) from exc
            feeds = [n for n in meta.inputs if n not in graph.initializers]
            compiled.append(
                _OrtGroup(session, meta, feeds, self.name, self._registrations, self.device_io)
            )
        return compiled
