"""A session's plan, decided once when the session is created: the partitions in run order
(one step each), where each step's inputs must be and on which stream its work goes, the
initializers uploaded to each EP's memory, the values that cross memories between steps,
and what runs each step (an EP's compiled node, or an onnxruntime session on the CPU)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy.typing as npt

from .._base.errors import InvalidArgument
from .._base.progress import ProgressBar
from .._base.types import DeviceType, MemoryDevice, MemoryInfo
from .._plugin.buffer import HOST_MEMORY_INFO
from .._plugin.ep import CompiledNode, Ep, FusedGroup
from .._plugin.tensor import Tensor
from .cpu_fallback import load_parts, use_whole
from .partition import Partition, assignment_of, partition_graph
from .values import InputSpec, contiguous, input_specs, same_memory
from .workers import Workers, wait_future

if TYPE_CHECKING:
    from .._graph.graph import GraphView
    from .._plugin.stream import SyncStream
    from .host import SessionHost

__all__ = ["CopyPoint", "PlanStep", "SessionPlan"]

# (initializer name, device) -> the memory and stream an upload there goes to
_Uploads = dict[tuple[str, MemoryDevice], tuple[MemoryInfo, "SyncStream | None"]]


@dataclass(eq=False)
class PlanStep:
    """One partition as a run executes it.

    ``inputs`` are the values gathered for it, in call order; those in ``constants`` (an
    EP step's initializers) are already in its memory. ``compiled`` runs an EP step,
    ``ort_session`` a CPU step (whose results are ``ort_outputs``, in order).
    """

    partition: Partition
    memory: MemoryInfo
    stream: SyncStream | None
    inputs: tuple[str, ...]
    constants: Mapping[str, Tensor] = field(default_factory=dict)
    compiled: CompiledNode | None = None
    ort_session: Any = None
    ort_outputs: tuple[str, ...] = ()

    @property
    def outputs(self) -> tuple[str, ...]:
        """The values the step makes."""
        return self.ort_outputs if self.partition.ep is None else self.partition.meta_def.outputs


@dataclass(frozen=True)
class CopyPoint:
    """A value that step ``step`` reads from another memory: each run copies it from
    ``source`` (where the step that makes it leaves it) to ``target`` before the step runs,
    on the reader's stream, else the maker's (model inputs are placed by the caller and
    copied where they need to be)."""

    value: str
    step: int
    source: MemoryDevice
    target: MemoryDevice


class SessionPlan:
    """What a session runs: its steps in order, the streams it made for its EPs, and the
    facts a run needs about the model's inputs. Built by `build`."""

    __slots__ = ("assignment", "copy_points", "direct", "graph", "input_specs", "steps", "streams")

    assignment: tuple[str, ...]
    copy_points: tuple[CopyPoint, ...]
    direct: PlanStep | None
    graph: GraphView
    input_specs: tuple[InputSpec, ...]
    steps: tuple[PlanStep, ...]
    streams: dict[str, SyncStream]

    def __init__(self, graph: GraphView) -> None:
        self.graph = graph
        self.assignment = ()
        self.copy_points = ()
        self.direct = None  # the whole graph as one CPU step: a run is one onnxruntime call
        self.input_specs = input_specs(graph)
        self.steps = ()
        self.streams = {}

    async def build(
        self,
        env: SessionHost,
        eps: Sequence[Ep],
        opts: Mapping[str, Any],
        preload: Future[Any] | None,
        workers: Workers,
    ) -> None:
        """Partition the graph over ``eps``, lay out the steps, load the CPU parts on
        ``workers`` while the EPs' initializers upload and their groups compile.

        ``preload``, when given, loads the whole model on onnxruntime; a single CPU step
        that is the whole graph uses it. On failure the streams made so far stay in
        `streams` for the caller to close.
        """
        graph = self.graph
        loading: Future[None] | None = None
        bar: ProgressBar | None = None
        steps: list[PlanStep] = []
        try:
            # Claims and graph checks can be long on a large model: off the loop.
            partitions = await anyio.to_thread.run_sync(partition_graph, graph, eps)
            self.assignment = assignment_of(graph, partitions)
            steps, wanted = self._lay_out(env, partitions)
            # onnxruntime builds the CPU parts while the EPs upload and compile theirs.
            loading = await _start_cpu_loading(graph, steps, opts, preload, workers)
            compiling = [ep for ep in eps if any(s.partition.ep is ep for s in steps)]
            stages = bool(wanted) + len(compiling) + (loading is not None)
            bar = ProgressBar(stages, "create_session", opts["progress"], unit="step")
            uploads = await _upload(env, graph, wanted)
            bar.update(bool(wanted), "create_session: initializers uploaded")
            for step in steps:
                if step.partition.ep is not None:
                    device = _initializer_memory(step.partition.ep).device
                    step.constants = MappingProxyType(
                        {n: uploads[n, device] for n in step.inputs if (n, device) in uploads}
                    )
            await _compile(graph, compiling, steps, bar)
            if loading is not None:
                await wait_future(loading)
                bar.update(1, "create_session: CPU parts loaded")
        except BaseException:
            if loading is not None:
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await wait_future(loading)  # never leave it loading behind our back
            for step in steps:  # groups compiled before the failure hold EP resources
                if step.compiled is not None:
                    step.compiled.release()
            raise
        finally:
            if bar is not None:
                bar.close()
        self.steps = tuple(steps)
        if len(steps) == 1 and steps[0].partition.ep is None:
            self.direct = steps[0]
        self.copy_points = _copy_points(steps)

    def _lay_out(
        self, env: SessionHost, partitions: Sequence[Partition]
    ) -> tuple[list[PlanStep], _Uploads]:
        """One step per partition that makes something, a stream per stream-aware EP, and
        the initializers to upload to each EP's memory."""
        graph = self.graph
        steps: list[PlanStep] = []
        wanted: _Uploads = {}
        for part in partitions:
            if part.ep is None and not part.meta_def.outputs:
                continue  # dead nodes: nothing reads what they make
            if part.ep is None:
                feeds = tuple(n for n in part.meta_def.inputs if n not in graph.initializers)
                steps.append(PlanStep(part, HOST_MEMORY_INFO, None, feeds))
                continue
            ep = part.ep
            stream = self.streams.get(ep.name)
            if stream is None and ep.uses_stream and ep.ep_devices[0].factory.is_stream_aware():
                stream = env.create_sync_stream(ep.ep_devices[0])
                self.streams[ep.name] = stream
            memory = ep.memory_info
            home = _initializer_memory(ep)
            for name in part.meta_def.inputs:
                if name in graph.initializers:
                    wanted.setdefault((name, home.device), (home, stream))
            steps.append(PlanStep(part, memory, stream, part.meta_def.inputs))
        return steps, wanted

    async def close_streams(self) -> None:
        """Close the streams made for the EPs (each waits for its work first)."""
        for stream in self.streams.values():
            await stream.aclose()
        self.streams.clear()

    async def release(self) -> None:
        """Release the compiled nodes and destroy the onnxruntime sessions."""
        ort_sessions = []
        for step in self.steps:
            if step.compiled is not None:
                step.compiled.release()
            ort_sessions.append(step.ort_session)
            step.ort_session = None
        self.steps = ()
        self.direct = None
        # Destroying an onnxruntime session joins its thread pool: not on the event loop.
        await anyio.to_thread.run_sync(ort_sessions.clear)


async def _start_cpu_loading(
    graph: GraphView,
    steps: Sequence[PlanStep],
    opts: Mapping[str, Any],
    preload: Future[Any] | None,
    workers: Workers,
) -> Future[None] | None:
    """Start loading the CPU steps' onnxruntime sessions (None: nothing to load)."""
    cpu_steps = [s for s in steps if s.partition.ep is None]
    if not cpu_steps:
        return None
    whole = len(cpu_steps) == 1 and len(cpu_steps[0].partition.nodes) == len(graph.nodes)
    if whole and preload is not None:
        with contextlib.suppress(Exception):  # else: load it again, for the error
            use_whole(graph, cpu_steps[0], await wait_future(preload))
    if cpu_steps[0].ort_session is not None:
        return None
    return workers.submit(load_parts, graph, cpu_steps, opts, whole)


def _initializer_memory(ep: Ep) -> MemoryInfo:
    """Where the session puts the initializers ``ep`` reads (see ``Ep.initializers_in_memory``)."""
    return ep.memory_info if ep.initializers_in_memory else HOST_MEMORY_INFO


async def _upload(
    env: SessionHost, graph: GraphView, wanted: _Uploads
) -> dict[tuple[str, MemoryDevice], Tensor]:
    """The initializers EP steps read, in each EP's memory: read in one worker-thread call
    (external files, conversions), then copied with one batch per device."""
    if not wanted:
        return {}
    names = list(dict.fromkeys(name for name, _ in wanted))
    arrays = dict(zip(names, await anyio.to_thread.run_sync(_read_initializers, graph, names)))
    uploads: dict[tuple[str, MemoryDevice], Tensor] = {}
    batches: dict[tuple[MemoryDevice, SyncStream | None], list[tuple[Any, Tensor]]] = {}
    for (name, device), (memory, stream) in wanted.items():
        array = arrays[name]
        if device.device_type is DeviceType.CPU:
            uploads[name, device] = Tensor.from_numpy(array)
            continue
        dst = env.empty(array.shape, array.dtype, memory, stream=stream)
        uploads[name, device] = dst
        batches.setdefault((device, stream), []).append((array, dst))
    for (_, stream), pairs in batches.items():
        await env.copy_tensors([a for a, _ in pairs], [d for _, d in pairs], stream)
    return uploads


def _read_initializers(graph: GraphView, names: list[str]) -> list[npt.NDArray[Any]]:
    """The data of ``names``, contiguous (runs in a worker thread)."""
    return [contiguous(graph.initializers[n].numpy()) for n in names]


async def _compile(
    graph: GraphView, eps: Sequence[Ep], steps: Sequence[PlanStep], bar: ProgressBar
) -> None:
    """Compile each EP's steps, one ``compile`` call per EP, off the event loop."""
    for ep in eps:
        ep_steps = [s for s in steps if s.partition.ep is ep]
        if not ep_steps:
            continue
        fused = [
            FusedGroup(
                s.partition.meta_def, tuple(graph.nodes[i] for i in s.partition.nodes), graph
            )
            for s in ep_steps
        ]
        compiled = await anyio.to_thread.run_sync(ep.compile, fused)
        if len(compiled) != len(fused):
            raise InvalidArgument(
                f"EP {ep.name!r}: compile returned {len(compiled)} node(s) for "
                f"{len(fused)} group(s)"
            )
        for s, c in zip(ep_steps, compiled):
            if not isinstance(c, CompiledNode):
                raise InvalidArgument(
                    f"EP {ep.name!r}: compile returned {c!r}, not an aioep.CompiledNode"
                )
            s.compiled = c
        bar.update(1, f"create_session: {ep.name} compiled")


def _copy_points(steps: Sequence[PlanStep]) -> tuple[CopyPoint, ...]:
    """The values steps read from another step's memory, in run order."""
    where: dict[str, MemoryDevice] = {}
    points: list[CopyPoint] = []
    for index, step in enumerate(steps):
        device = step.memory.device
        for name in step.inputs:
            source = where.get(name)  # None: a model input or an initializer
            if source is not None and not same_memory(source, device):
                points.append(CopyPoint(name, index, source, device))
        for name in step.outputs:
            where[name] = device
    return tuple(points)
