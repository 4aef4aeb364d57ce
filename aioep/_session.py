"""Inference sessions: a model partitioned across EPs, run with awaitable, stream-ordered
copies between the partitions.

A run walks the partitions in order. Before a partition runs, each input that is not
in the partition's memory is copied there through the environment's data transfers,
on the stream of the device side of the copy; a stream that reads a value made on
another stream first waits for it on the device. EP partitions are enqueued on the
session's stream for their device; the CPU fallback (onnxruntime's CPU execution
provider over the sub-models nobody claimed) runs in a worker thread once its
inputs are on the host.
"""

from __future__ import annotations

import contextlib
import enum
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
import numpy as np
import numpy.typing as npt
from anyio.abc import AsyncResource

from ._device import EpDevice
from ._ep import CompiledNode, Ep, FusedGroup
from ._errors import ClosedError, DeviceError, EpError, InvalidArgument, NotImplementedByEp
from ._graph import GraphView, ValueInfo
from ._host import HOST_EP_NAME
from ._notification import Notification
from ._ort_compat import ir_version_for_ort
from ._partition import CPU_EP_NAME, Partition, assignment_of, partition_graph
from ._stream import SyncStream
from ._tensor import HOST_MEMORY_INFO, Tensor
from ._types import DeviceType, MemoryDevice, MemoryInfo
from ._wake import wait_for

if TYPE_CHECKING:
    from ._environment import Environment

__all__ = ["Session", "create_session"]

_OPTION_KEYS = ("ep_options", "intra_op_num_threads", "inter_op_num_threads")
_LOCATIONS = ("device", "host")
_T = TypeVar("_T")


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


@dataclass
class _Value:
    """A value of one run: the tensor, and where its producer's work stands.

    Values that are not tensors (sequences, optionals, maps) have ``tensor=None`` and
    live on the host, in ``host`` (an absent optional is ``host=None``).
    """

    tensor: Tensor | None
    ready: Notification | None = None  # None: complete
    stream: SyncStream | None = None
    host: Any = None


@dataclass
class _Step:
    """One partition, ready to run."""

    partition: Partition
    memory: MemoryInfo
    stream: SyncStream | None
    constants: Mapping[str, Tensor]
    inputs: tuple[str, ...] = ()  # the values gathered for it, in call order
    compiled: CompiledNode | None = None
    ort_session: Any = None
    ort_outputs: tuple[str, ...] = ()


async def create_session(
    env: Environment,
    model: str | os.PathLike[str] | Any,
    ep_devices: Sequence[EpDevice] | None = None,
    options: Mapping[str, Any] | None = None,
) -> Session:
    """Load, partition and compile ``model`` for the EPs of ``ep_devices`` (priority order).

    ``ep_devices`` are grouped by factory, in order of first appearance; each group
    gets one EP from ``factory.create_ep``. The host device needs no EP: what no EP
    claims runs on onnxruntime's CPU execution provider. ``options``:
    ``ep_options`` (EP name -> option mapping for ``create_ep``) and
    ``intra_op_num_threads`` / ``inter_op_num_threads`` for the CPU fallback.
    """
    opts = dict(options or {})
    unknown = sorted(set(opts) - set(_OPTION_KEYS))
    if unknown:
        raise InvalidArgument(
            f"create_session: unknown option(s) {unknown}; known: {list(_OPTION_KEYS)}"
        )
    ep_options = opts.get("ep_options") or {}
    if not isinstance(ep_options, Mapping):
        raise InvalidArgument(
            f"create_session: ep_options must map EP names to option mappings, got {ep_options!r}"
        )
    groups: dict[int, list[EpDevice]] = {}
    for dev in ep_devices or ():
        if not isinstance(dev, EpDevice):
            raise InvalidArgument(
                f"create_session: ep_devices must be EpDevice objects, got {dev!r}"
            )
        env._library_of(dev)  # raises for a device of another environment
        if dev.factory.name == HOST_EP_NAME:
            continue  # the host CPU is served by the fallback
        groups.setdefault(id(dev.factory), []).append(dev)

    preload: Future[Any] | None = None
    if not groups:
        # Only the CPU fallback: it will run the whole model, so onnxruntime loads it while
        # the graph view is built (a session then costs about what onnxruntime's own does).
        pool = ThreadPoolExecutor(1, thread_name_prefix="aioep-ort-load")
        preload = pool.submit(_load_whole, model, opts)
        pool.shutdown(wait=False)  # the thread ends after the load; nothing waits for it here
    graph = await anyio.to_thread.run_sync(GraphView.from_model, model)
    eps: list[Ep] = []
    try:
        for devs in groups.values():
            factory = devs[0].factory
            try:
                ep = factory.create_ep(devs, ep_options.get(factory.name))
            except EpError:
                raise
            except Exception as exc:
                raise EpError(
                    f"factory {factory.name!r} failed to create an EP: {type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(ep, Ep):
                raise InvalidArgument(
                    f"factory {factory.name!r}.create_ep returned {ep!r}, not an aioep.Ep"
                )
            ep._bind(env, devs)
            eps.append(ep)
        if len({ep.name for ep in eps}) != len(eps):
            raise InvalidArgument(f"create_session: two EPs share a name: {[e.name for e in eps]}")
        session = Session._create(env, graph, eps)
        env._track_session(session, [d for devs in groups.values() for d in devs], open=True)
        try:
            await session._prepare(opts, preload)
        except BaseException:
            env._track_session(session, [d for devs in groups.values() for d in devs], open=False)
            raise
    except BaseException:
        for ep in eps:
            ep.release()
        raise
    return session


class Session(AsyncResource):
    """A model partitioned across execution providers; create it with
    ``await env.create_session(model, ep_devices=[...])``.

    ``await session.run(inputs)`` returns a dict of output name -> :class:`Tensor`.
    Runs from many tasks may overlap: each run keeps its own state. ``async with``
    (or :meth:`aclose`) closes the session's streams and releases its EPs.
    """

    __slots__ = (
        "__weakref__",
        "_active",
        "_direct",
        "_env",
        "_eps",
        "_executor",
        "_held",
        "_idle",
        "_input_specs",
        "_state",
        "_steps",
        "_streams",
        "assignment",
        "graph",
    )

    _env: Environment
    _direct: _Step | None
    _eps: list[Ep]
    _executor: ThreadPoolExecutor | None
    _held: list[tuple[list[Notification], object]]
    _input_specs: tuple[tuple[str, np.dtype[Any] | None, tuple[Any, ...] | None, ValueInfo], ...]
    _steps: list[_Step]
    _streams: dict[str, SyncStream]
    _state: _State
    _active: int
    _idle: anyio.Event | None
    assignment: tuple[str, ...]
    """The EP name per node, in the graph view's node order."""
    graph: GraphView
    """The model's graph view."""

    def __init__(self) -> None:
        raise TypeError("use 'await env.create_session(model, ep_devices=[...])'")

    @classmethod
    def _create(cls, env: Environment, graph: GraphView, eps: list[Ep]) -> Session:
        self = object.__new__(cls)
        self._env = env
        self.graph = graph
        self._eps = eps
        self._steps = []
        self._streams = {}
        self._state = _State.OPEN
        self._active = 0
        self._idle = None
        self._executor = None
        self._held = []
        self._direct = None
        self._input_specs = tuple((i.name, i.dtype, i.shape, i) for i in graph.inputs)
        self.assignment = ()
        return self

    async def _prepare(self, opts: Mapping[str, Any], preload: Future[Any] | None) -> None:
        env, graph = self._env, self.graph
        loading: Future[None] | None = None
        try:
            # Claims and graph checks can be long on a large model: off the loop.
            partitions = await anyio.to_thread.run_sync(partition_graph, graph, self._eps)
            self.assignment = assignment_of(graph, partitions)
            steps: list[_Step] = []
            by_ep: dict[str, list[_Step]] = {}
            wanted: dict[tuple[str, MemoryDevice], tuple[MemoryInfo, SyncStream | None]] = {}
            for part in partitions:
                if part.ep is None and not part.meta_def.outputs:
                    continue  # dead nodes: nothing reads what they make
                if part.ep is None:
                    feeds = tuple(n for n in part.meta_def.inputs if n not in graph.initializers)
                    steps.append(_Step(part, HOST_MEMORY_INFO, None, {}, feeds))
                    continue
                ep = part.ep
                stream = self._streams.get(ep.name)
                if stream is None and ep.uses_stream and ep.ep_devices[0].factory.is_stream_aware():
                    stream = env.create_sync_stream(ep.ep_devices[0])
                    self._streams[ep.name] = stream
                memory = ep.memory_info
                for name in part.meta_def.inputs:
                    if name in graph.initializers:
                        wanted.setdefault((name, memory.device), (memory, stream))
                step = _Step(part, memory, stream, {}, part.meta_def.inputs)
                steps.append(step)
                by_ep.setdefault(ep.name, []).append(step)
            cpu_steps = [s for s in steps if s.partition.ep is None]
            if cpu_steps:
                # onnxruntime builds the CPU parts while the EPs upload and compile theirs.
                whole = len(cpu_steps) == 1 and len(cpu_steps[0].partition.nodes) == len(
                    graph.nodes
                )
                if whole and preload is not None:
                    with contextlib.suppress(Exception):  # else: load it again, for the error
                        _use_whole(graph, cpu_steps[0], await self._wait(preload))
                if cpu_steps[0].ort_session is None:
                    loading = self._submit(_make_ort_sessions, graph, cpu_steps, opts, whole)
            uploads = await self._upload_initializers(wanted)
            for step in steps:
                if step.partition.ep is not None:
                    device = step.memory.device
                    step.constants = MappingProxyType(
                        {n: uploads[n, device] for n in step.inputs if (n, device) in uploads}
                    )
            for ep in self._eps:
                ep_steps = by_ep.get(ep.name, [])
                if not ep_steps:
                    continue
                fused = [
                    FusedGroup(
                        s.partition.meta_def,
                        tuple(graph.nodes[i] for i in s.partition.nodes),
                        graph,
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
            if loading is not None:
                await self._wait(loading)
            self._steps = steps
            if len(steps) == 1 and steps[0].partition.ep is None:
                self._direct = steps[0]  # the whole graph on the CPU fallback
        except BaseException:
            with anyio.CancelScope(shield=True):
                if loading is not None:
                    with contextlib.suppress(Exception):
                        await self._wait(loading)  # never leave it loading behind our back
                await self.aclose()
            raise

    async def _upload_initializers(
        self, wanted: Mapping[tuple[str, MemoryDevice], tuple[MemoryInfo, SyncStream | None]]
    ) -> dict[tuple[str, MemoryDevice], Tensor]:
        """The initializers EP partitions read, in each EP's memory: read in one worker-thread
        call (external files, conversions), then copied with one batch per device."""
        if not wanted:
            return {}
        names = list(dict.fromkeys(name for name, _ in wanted))
        arrays = dict(
            zip(names, await anyio.to_thread.run_sync(_read_initializers, self.graph, names))
        )
        uploads: dict[tuple[str, MemoryDevice], Tensor] = {}
        batches: dict[tuple[MemoryDevice, SyncStream | None], list[tuple[Any, Tensor]]] = {}
        for (name, device), (memory, stream) in wanted.items():
            array = arrays[name]
            if device.device_type is DeviceType.CPU:
                uploads[name, device] = Tensor.from_numpy(array)
                continue
            dst = self._env.empty(array.shape, array.dtype, memory, stream=stream)
            uploads[name, device] = dst
            batches.setdefault((device, stream), []).append((array, dst))
        for (_, stream), pairs in batches.items():
            await self._env.copy_tensors([a for a, _ in pairs], [d for _, d in pairs], stream)
        return uploads

    # -- public ----------------------------------------------------------------------------
    @property
    def input_names(self) -> tuple[str, ...]:
        """Names of the model inputs (initializers excluded)."""
        return tuple(i.name for i in self.graph.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        """Names of the model outputs."""
        return self.graph.output_names

    @property
    def streams(self) -> Mapping[str, SyncStream]:
        """EP name -> the stream the session created for it (stream-aware EPs only)."""
        return MappingProxyType(dict(self._streams))

    @property
    def closed(self) -> bool:
        """True after :meth:`aclose`."""
        return self._state is _State.CLOSED

    async def run(
        self,
        inputs: Mapping[str, Tensor | npt.ArrayLike],
        stream: SyncStream | None = None,
        *,
        output_location: str = "device",
    ) -> dict[str, Any]:
        """Run the model and return output name -> tensor.

        ``inputs`` maps every model input to a host array or a tensor on any device.
        Outputs stay where the producing EP put them; ``output_location="host"``
        copies them to host memory.

        Values that only the host holds pass through to and from onnxruntime's CPU
        execution provider: string tensors (numpy arrays of ``str``/``bytes`` in; host
        tensors of dtype ``object`` out), sequences (lists of arrays or tensors in; lists
        of host tensors out) and optionals (None, or the value). Without ``stream`` the call returns when all
        the run's work is complete. With ``stream`` (a stream of one of the
        session's EP devices) that EP's work and copies go on it, the inputs may
        still be in flight on it, and the call returns once everything is enqueued:
        the outputs are valid for work enqueued later on ``stream`` (host outputs
        are always complete). Cancelling the call abandons the wait, never
        work already enqueued.
        """
        if self._state is not _State.OPEN:
            raise ClosedError(f"{self!r} is closed")
        if output_location not in _LOCATIONS:
            raise InvalidArgument(
                f"run: output_location must be 'device' or 'host', got {output_location!r}"
            )
        streams = self._streams
        user_ready: Notification | None = None
        if stream is not None:
            if not isinstance(stream, SyncStream):
                raise InvalidArgument(f"run: stream must be an aioep.SyncStream, got {stream!r}")
            owner = next(
                (
                    ep.name
                    for ep in self._eps
                    if stream.ep_device.factory is ep.ep_devices[0].factory
                ),
                None,
            )
            if owner is None:
                raise InvalidArgument(
                    f"run: {stream!r} is not on a device of this session's EPs "
                    f"{[ep.name for ep in self._eps]}"
                )
            streams = {**streams, owner: stream}
            user_ready = stream.record()
        feeds = None
        if self._direct is not None and stream is None:
            feeds = self._host_feeds(inputs)
        values = self._bind_inputs(inputs, user_ready, stream) if feeds is None else {}
        placed: dict[tuple[str, MemoryDevice], _Value] = {}
        self._active += 1
        try:
            if feeds is not None:
                assert self._direct is not None
                return await self._run_direct(self._direct, feeds)
            return await self._run(values, placed, streams, stream, output_location)
        except BaseException:
            # Cancelled or failed midway: kernels and copies may still be queued on the
            # streams; their tensors must outlive them.
            self._hold_until_passed(streams.values(), (values, placed))
            raise
        finally:
            self._active -= 1
            if self._active == 0 and self._idle is not None:
                self._idle.set()

    def _host_feeds(
        self, inputs: Mapping[str, Tensor | npt.ArrayLike]
    ) -> dict[str, npt.NDArray[Any]] | None:
        """Validated host arrays for the direct path, or None to take the general path."""
        specs = self._input_specs
        if not isinstance(inputs, Mapping) or len(inputs) != len(specs):
            return None
        feeds: dict[str, npt.NDArray[Any]] = {}
        for name, want, shape, info in specs:
            given = inputs.get(name)
            if isinstance(given, Tensor) and given.is_host_accessible:
                given = given.numpy()
            if (
                info.kind != "tensor"
                or not isinstance(given, np.ndarray)
                or (want is not None and given.dtype != want)
                or (
                    shape is not None
                    and (
                        len(shape) != given.ndim
                        or any(isinstance(d, int) and d != n for d, n in zip(shape, given.shape))
                    )
                )
            ):
                return None  # the general path raises the precise error
            feeds[name] = given
        return feeds

    async def _run_direct(self, step: _Step, feeds: dict[str, npt.NDArray[Any]]) -> dict[str, Any]:
        """The whole graph on the CPU fallback, inputs on the host: one ORT call."""
        results = await self._in_thread(_run_ort, step.ort_session, feeds)
        return {name: _from_ort(value) for name, value in zip(step.ort_outputs, results)}

    async def _run(
        self,
        values: dict[str, _Value],
        placed: dict[tuple[str, MemoryDevice], _Value],
        streams: Mapping[str, SyncStream],
        user_stream: SyncStream | None,
        output_location: str,
    ) -> dict[str, Any]:
        env = self._env
        tails: dict[SyncStream, Notification] = {}
        for step in self._steps:
            part = step.partition
            target = step.stream
            if part.ep is not None and target is not None:
                target = streams.get(part.ep.name, target)
            args = await self._gather(step, target, values, placed)
            if part.ep is None:
                feeds = {n: _to_ort(v) for n, v in zip(step.inputs, args)}
                results = await self._in_thread(_run_ort, step.ort_session, feeds)
                for name, produced in zip(step.ort_outputs, results):
                    out = _from_ort(produced)
                    values[name] = (
                        _Value(out) if isinstance(out, Tensor) else _Value(None, host=out)
                    )
                continue
            assert step.compiled is not None
            try:
                outs = await step.compiled(args, target)
            except EpError:
                raise
            except Exception as exc:
                raise DeviceError(
                    f"EP {part.ep.name!r} failed running {part.meta_def.name!r}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if len(outs) != len(part.meta_def.outputs) or not all(
                isinstance(t, Tensor) for t in outs
            ):
                raise EpError(
                    f"EP {part.ep.name!r}: {part.meta_def.name!r} returned {len(outs)} value(s); "
                    f"expected {len(part.meta_def.outputs)} aioep.Tensor(s) "
                    f"{list(part.meta_def.outputs)}"
                )
            ready = None
            if target is not None:
                ready = target.record()
                tails[target] = ready
            for name, t in zip(part.meta_def.outputs, outs):
                values[name] = _Value(t, ready, target)

        result: dict[str, Any] = {}
        to_host: list[tuple[str, _Value]] = []
        for name in self.output_names:
            value = values.get(name)
            if value is None:
                raise EpError(f"{self!r}: no partition produced the graph output {name!r}")
            if value.tensor is None:
                result[name] = value.host
            elif output_location == "host" and not value.tensor.is_host_accessible:
                to_host.append((name, value))
            else:
                result[name] = value.tensor
        waits: list[Any] = []
        by_stream: dict[SyncStream | None, list[tuple[str, _Value]]] = {}
        for name, value in to_host:
            by_stream.setdefault(value.stream, []).append((name, value))
        for s, items in by_stream.items():
            srcs = [v.tensor for _, v in items if v.tensor is not None]
            dsts = [np.empty(t.shape, t.dtype) for t in srcs]
            waits.append(env.copy_tensors(srcs, dsts, s))
            for (name, _), dst in zip(items, dsts):
                result[name] = Tensor.from_numpy(dst)
        for fut in waits:
            await fut
        if user_stream is None:
            for note in tails.values():
                await note
        else:
            for s, note in tails.items():
                if s is not user_stream:
                    user_stream.wait(note)
            for name in list(result):
                value = values[name]
                if value.stream is None and value.ready is not None:
                    await value.ready
            if tails:
                # Keep the run's tensors alive until every stream has passed this run's work.
                self._hold_until_passed([user_stream], (values, placed))
        return {name: result[name] for name in self.output_names}

    def _bind_inputs(
        self,
        inputs: Mapping[str, Tensor | npt.ArrayLike],
        ready: Notification | None,
        stream: SyncStream | None,
    ) -> dict[str, _Value]:
        if not isinstance(inputs, Mapping):
            raise InvalidArgument(
                f"run: inputs must map input names to arrays or tensors, got {type(inputs).__name__}"
            )
        specs = self._input_specs
        if len(inputs) != len(specs) or any(spec[0] not in inputs for spec in specs):
            names = [spec[0] for spec in specs]
            unknown = sorted(set(inputs) - set(names))
            if unknown:
                raise InvalidArgument(
                    f"run: unknown input name(s) {unknown}; the model's inputs are {names}"
                )
            missing = [n for n in names if n not in inputs]
            raise InvalidArgument(f"run: missing input {missing[0]!r} (model inputs: {names})")
        values: dict[str, _Value] = {}
        for name, want, shape, info in specs:
            given = inputs[name]
            if info.kind not in ("tensor", "unknown"):
                values[name] = _Value(None, host=_host_input(name, given, info))
                continue
            if isinstance(given, Tensor):
                tensor = given
                value = _Value(tensor, ready, stream if ready is not None else None)
            else:
                array = np.asarray(given)
                if array.dtype.kind in "USO" and (want is None or want.hasobject):
                    tensor = Tensor._of_objects(array.astype(object, copy=False))
                elif want is not None and array.dtype != want:
                    tensor = Tensor.from_numpy(np.empty(0, array.dtype))  # the error below
                else:
                    tensor = Tensor.from_numpy(_contiguous(array))
                value = _Value(tensor)
            if want is not None and tensor.dtype != want:
                raise InvalidArgument(
                    f"run: input {name!r} has dtype {tensor.dtype}, the model expects {want}"
                )
            if shape is not None and (
                len(shape) != len(tensor.shape)
                or any(isinstance(d, int) and d != n for d, n in zip(shape, tensor.shape))
            ):
                raise InvalidArgument(
                    f"run: input {name!r} has shape {tensor.shape}, the model expects {list(shape)}"
                )
            values[name] = value
        return values

    async def _gather(
        self,
        step: _Step,
        target: SyncStream | None,
        values: dict[str, _Value],
        placed: dict[tuple[str, MemoryDevice], _Value],
    ) -> list[Any]:
        """The step's input tensors in its memory, copying (and ordering) what is elsewhere
        (host values that are not tensors, for the CPU fallback, as they are)."""
        device = step.memory.device
        args: list[Any] = []
        copies: dict[SyncStream | None, list[tuple[str, Tensor, Tensor]]] = {}
        for name in step.inputs:
            const = step.constants.get(name)
            if const is not None:
                args.append(const)
                continue
            value = placed.get((name, device)) or values.get(name)
            if value is None:
                raise EpError(f"{self!r}: value {name!r} was not produced before it is read")
            if value.tensor is None:
                if device.device_type is not DeviceType.CPU:
                    raise EpError(
                        f"{self!r}: value {name!r} is not a tensor and cannot move to "
                        f"{step.memory.name!r}"
                    )
                args.append(value.host)
                continue
            t = value.tensor
            if _same_memory(t.device, device):
                await _order(value, target)
                args.append(t)
                continue
            if t.dtype.hasobject:
                raise EpError(
                    f"{self!r}: value {name!r} is a string tensor and cannot move to "
                    f"{step.memory.name!r}"
                )
            # Copy on the device side's stream: the consumer's, else the producer's.
            copy_stream = target if target is not None else value.stream
            if copy_stream is not None and copy_stream is not value.stream and value.ready:
                copy_stream.wait(value.ready)
            elif copy_stream is None and value.ready is not None:
                await value.ready
            if device.device_type is DeviceType.CPU:
                dst = Tensor.from_numpy(np.empty(t.shape, t.dtype))
            else:
                dst = self._env.empty(t.shape, t.dtype, step.memory, stream=target)
            copies.setdefault(copy_stream, []).append((name, t, dst))
            args.append(dst)
        for copy_stream, items in copies.items():
            fut = self._env.copy_tensors(
                [src for _, src, _ in items], [dst for _, _, dst in items], copy_stream
            )
            if copy_stream is not None and copy_stream is target:
                # Ordered on the consumer's own stream; others wait for the copy's notification.
                note: Notification | None = fut.notification
            else:
                await fut
                note = None
            for name, _, dst in items:
                placed[(name, device)] = _Value(dst, note, target if note is not None else None)
        return args

    async def _in_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn`` on the session's worker threads; cancelling abandons only the wait."""
        return await self._wait(self._submit(fn, *args))

    def _submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=min(32, (os.cpu_count() or 1) + 4), thread_name_prefix="aioep-session"
            )
        # The arguments travel in a box the worker empties: the executor's work item outlives
        # the call by a moment on its thread, and must not keep a run's tensors alive then.
        return self._executor.submit(_call_boxed, [(fn, args)])

    @staticmethod
    async def _wait(fut: Future[_T]) -> _T:
        def register(wake: Callable[[], None]) -> bool:
            fut.add_done_callback(lambda _: wake())
            return True

        await wait_for(register, fut.done)
        return fut.result()

    def _hold_until_passed(self, streams: Iterable[SyncStream], keep: object) -> None:
        """Keep ``keep`` (a run's tensors) alive until every stream has passed the work
        enqueued on it so far; released from the backend's thread when it calls back."""
        self._held = [(notes, k) for notes, k in self._held if not all(n.done() for n in notes)]
        notes = [s.record() for s in set(streams) if not s.closed]
        if not notes:
            return
        holder: list[object] = [keep]
        left = [len(notes)]
        lock = threading.Lock()

        def passed() -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    holder.clear()

        for note in notes:
            if not note.impl.add_done_callback(passed):
                # This backend cannot call back: hold until a later run or aclose() sees it done.
                self._held.append((notes, keep))
                return

    # -- lifecycle -------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Wait for runs in flight, then close the session's streams and release its EPs;
        idempotent and shielded from cancellation."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        with anyio.CancelScope(shield=True):
            if self._active:
                self._idle = anyio.Event()
                await self._idle.wait()
            for stream in self._streams.values():
                await stream.aclose()
            self._streams.clear()
            for notes, _ in self._held:
                for note in notes:
                    with contextlib.suppress(Exception):
                        await note
            self._held.clear()
            ort_sessions = []
            for step in self._steps:
                if step.compiled is not None:
                    step.compiled.release()
                ort_sessions.append(step.ort_session)
                step.ort_session = None
            self._steps = []
            # Destroying an onnxruntime session joins its thread pool: not on the event loop.
            await anyio.to_thread.run_sync(ort_sessions.clear)
            for ep in self._eps:
                ep.release()
            if self._executor is not None:
                self._executor.shutdown(wait=False)
                self._executor = None
            self._env._track_session(
                self, [d for ep in self._eps for d in ep.ep_devices], open=False
            )

    async def __aenter__(self) -> Session:
        if self._state is not _State.OPEN:
            raise ClosedError(f"{self!r} is closed")
        return self

    def __repr__(self) -> str:
        eps = sorted(set(self.assignment)) or [CPU_EP_NAME]
        return f"<Session {self._state.value} nodes={len(self.graph.nodes)} eps={eps}>"


def _call_boxed(box: list[tuple[Callable[..., _T], tuple[Any, ...]]]) -> _T:
    fn, args = box.pop()
    return fn(*args)


async def _order(value: _Value, target: SyncStream | None) -> None:
    """Make ``target`` (or the host, for None) see ``value`` complete."""
    if value.ready is None or value.stream is target:
        return
    if target is not None:
        target.wait(value.ready)
    else:
        await value.ready


def _same_memory(a: MemoryDevice, b: MemoryDevice) -> bool:
    # A CPU reader reads any host-accessible memory (host RAM, pinned memory) in place.
    return a == b or (b.device_type is DeviceType.CPU and a.is_host_accessible)


def _contiguous(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``array`` in C order, shape kept (``np.ascontiguousarray`` turns 0-d into 1-d)."""
    if array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(array).reshape(array.shape)


def _from_ort(value: Any) -> Any:
    """An onnxruntime result as a session output: arrays become host tensors (string
    tensors included), sequences lists of them; None (an absent optional) and maps stay."""
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return Tensor._of_objects(value)
        return Tensor.from_numpy(_contiguous(value))
    if isinstance(value, list):
        return [_from_ort(v) for v in value]
    return value


def _to_ort(value: Any) -> Any:
    """A host value as onnxruntime takes it: tensors as arrays, sequences as lists."""
    if isinstance(value, Tensor):
        return value.numpy()
    if isinstance(value, list):
        return [_to_ort(v) for v in value]
    return value


def _host_input(name: str, given: Any, info: ValueInfo) -> Any:
    """A model input that is not a tensor (a sequence, optional or map), kept on the host."""
    if info.kind == "optional" and given is None:
        return None
    if info.kind == "sequence" and not isinstance(given, (list, tuple)):
        raise InvalidArgument(
            f"run: input {name!r} is a sequence; pass a list of arrays, got {type(given).__name__}"
        )
    return _host_data(name, given)


def _host_data(name: str, value: Any) -> Any:
    if isinstance(value, Tensor):
        if not value.is_host_accessible:
            raise InvalidArgument(
                f"run: input {name!r}: {value!r} is in device memory; sequence and optional "
                "inputs are read on the host"
            )
        return value
    if isinstance(value, (list, tuple)):
        return [_host_data(name, v) for v in value]
    if value is None or isinstance(value, dict):
        return value
    array = np.asarray(value)
    if array.dtype.kind in "USO":
        return Tensor._of_objects(array.astype(object, copy=False))
    return Tensor.from_numpy(_contiguous(array))


def _run_ort(session: Any, feeds: dict[str, Any]) -> list[Any]:
    try:
        return list(session.run(None, feeds))
    except Exception as exc:
        raise DeviceError(f"onnxruntime CPU fallback failed: {type(exc).__name__}: {exc}") from exc


def _ort() -> Any:
    try:
        import onnxruntime as ort
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise NotImplementedByEp(
            "the CPU fallback needs onnxruntime: pip install 'aioep[onnx]'"
        ) from exc
    return ort


def _session_options(opts: Mapping[str, Any]) -> Any:
    so = _ort().SessionOptions()
    for key in ("intra_op_num_threads", "inter_op_num_threads"):
        if opts.get(key) is not None:
            setattr(so, key, int(opts[key]))
    return so


def _load_whole(model: Any, opts: Mapping[str, Any]) -> Any:
    """An onnxruntime session for a whole model given as a path or a proto (a copy with a
    capped IR version where the installed onnxruntime needs one); raises on any trouble."""
    ort = _ort()
    if isinstance(model, (str, os.PathLike)):
        source: Any = os.fspath(model)
    else:
        ir_version = ir_version_for_ort(model)
        if ir_version != model.ir_version:
            copy = type(model)()
            copy.CopyFrom(model)
            copy.ir_version = ir_version
            model = copy
        source = model.SerializeToString()
    return ort.InferenceSession(source, _session_options(opts), providers=["CPUExecutionProvider"])


def _use_whole(graph: GraphView, step: _Step, session: Any) -> None:
    outputs = tuple(o.name for o in session.get_outputs())
    if any(o not in outputs for o in step.partition.meta_def.outputs):
        raise EpError("the whole-model session lacks an output")  # load it the usual way
    step.ort_session = session
    step.ort_outputs = outputs
    step.inputs = tuple(i.name for i in graph.inputs)


def _make_ort_sessions(
    graph: GraphView, steps: Sequence[_Step], opts: Mapping[str, Any], whole: bool
) -> None:
    ort = _ort()
    so = _session_options(opts)
    if len(steps) > 1:
        # Each part has its own intra-op thread pool, and a pool spins after its work in
        # case more comes: the next part's pool would compete with it for the cores (and
        # a spinning pool takes ~30 ms to shut down). Parts run one after another: no spin.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if whole and ir_version_for_ort(graph.model) != graph.model.ir_version:
        whole = False  # hand onnxruntime a copy stamped with an IR version it loads

    def load(step: _Step) -> None:
        meta = step.partition.meta_def
        if whole:
            source: Any = (
                os.fspath(graph.model_path)
                if graph.model_path is not None
                else graph.model.SerializeToString()
            )
            step.inputs = tuple(i.name for i in graph.inputs)
        else:
            sub = graph.extract_model(step.partition.nodes, meta.inputs, meta.outputs)
            source = sub.SerializeToString()
        try:
            sess = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise EpError(
                f"onnxruntime could not load the CPU fallback part {meta.name!r} "
                f"(nodes {list(step.partition.nodes)}): {type(exc).__name__}: {exc}"
            ) from exc
        step.ort_session = sess
        step.ort_outputs = tuple(o.name for o in sess.get_outputs())
        missing = [o for o in meta.outputs if o not in step.ort_outputs]
        if missing:
            raise EpError(f"CPU fallback part {meta.name!r} does not produce {missing}")

    if len(steps) == 1:
        load(steps[0])
        return
    # Parts between EP partitions are many small sessions; onnxruntime builds them with the
    # GIL released, so they load side by side.
    workers = min(len(steps), os.cpu_count() or 1, 8)
    with ThreadPoolExecutor(workers, thread_name_prefix="aioep-ort-load") as pool:
        for fut in [pool.submit(load, step) for step in steps]:
            fut.result()


def _read_initializers(graph: GraphView, names: list[str]) -> list[npt.NDArray[Any]]:
    """The data of ``names``, contiguous (runs in a worker thread)."""
    return [_contiguous(graph.initializers[n].numpy()) for n in names]
