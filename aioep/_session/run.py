"""The runner: executes a session's plan for each ``run``.

A run walks the steps in order. Before a step runs, each input that is not in the step's
memory is copied there through the environment's data transfers, on the stream of the
device side of the copy; a stream that reads a value made on another stream first waits
for it on the device. EP steps are enqueued on the session's stream for their device (or
the caller's); CPU steps run on the session's worker threads once their inputs are on
the host.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .._base.errors import DeviceError, EpError, InvalidArgument
from .._base.types import DeviceType, MemoryDevice
from .._memory.foreign import import_feeds
from .._plugin.stream import SyncStream
from .._plugin.tensor import Tensor
from .cpu_fallback import host_output, run_ort, to_ort
from .direct import DirectRuns
from .values import (
    HostArray,
    MapValue,
    OrtOutput,
    RunInput,
    RunOutput,
    RunValue,
    bind_inputs,
    describe_value,
    host_feeds,
    same_memory,
)

if TYPE_CHECKING:
    from .._plugin.ep import Ep
    from .._plugin.notification import Notification
    from .host import SessionHost
    from .plan import PlanStep, SessionPlan
    from .workers import Workers

__all__ = [
    "Runner",
    "terminated",
]

_LOCATIONS = ("device", "host")


class Runner:
    """Runs a session's plan; runs from many tasks may overlap, each keeps its own state."""

    __slots__ = ("_held", "_owner", "direct_runs", "env", "eps", "plan", "workers")

    def __init__(
        self,
        env: SessionHost,
        plan: SessionPlan,
        eps: Sequence[Ep],
        workers: Workers,
        owner: object,
    ) -> None:
        self.env = env
        self.plan = plan
        self.eps = eps
        self.workers = workers
        self._held: list[tuple[list[Notification], object]] = []
        # The session, named in error messages; weakly, so the session is freed when dropped.
        self._owner = weakref.ref(owner)
        self.direct_runs = DirectRuns(env, workers)

    def prepared(self, single_threaded: bool) -> None:
        """The plan is built: work out how direct runs are fed and timed."""
        self.direct_runs.prepare(self.plan, single_threaded)

    def close(self) -> None:
        """The session is closing: the inline budget forgets its kinds."""
        self.direct_runs.close()

    @property
    def owner(self) -> object:
        """The session this runner runs for (None once it is gone)."""
        return self._owner()

    async def run(
        self,
        inputs: Mapping[str, RunInput],
        stream: SyncStream | None,
        output_location: str,
        into: Mapping[str, Tensor] | None = None,
    ) -> dict[str, RunOutput]:
        """One run of the plan; see `Session.run`. ``into``: graph
        outputs the producing EP may write straight into (pre-bound outputs)."""
        if output_location not in _LOCATIONS:
            raise InvalidArgument(
                "run: output_location must be 'device' or 'host', got "
                f"{describe_value(output_location)}"
            )
        direct = self.plan.direct
        if direct is not None and stream is None:
            # onnxruntime runs the whole model: host arrays go to it as they are.
            feeds = self.direct_runs.feeds(inputs)
            if feeds is not None:
                results = await self.direct_runs.run(direct, feeds, None, None)
                return _by_name(direct.ort_outputs, results)
        streams, user_ready = self._streams_for(stream)
        inputs = await import_feeds(self.env.importers, inputs, stream)
        if direct is not None and stream is None:
            feeds = host_feeds(self.plan.input_specs, inputs)
            if feeds is not None:
                results = await self.direct_runs.run(direct, feeds, None, None)
                return _by_name(direct.ort_outputs, results)
        return await self._execute(inputs, streams, user_ready, stream, output_location, into)

    async def run_ort_form(
        self,
        inputs: Mapping[str, RunInput],
        names: Sequence[str],
        stream: SyncStream | None,
        run_options: Any,
    ) -> list[OrtOutput]:
        """One run in onnxruntime's form: the outputs ``names`` (graph outputs) on the host,
        as ``InferenceSession.run`` gives them; ``run_options`` an ``onnxruntime.RunOptions``
        or None."""
        direct = self.plan.direct
        if direct is not None and stream is None:
            feeds = self.direct_runs.feeds(inputs)
            if feeds is not None:  # onnxruntime's own answer, as it is
                return await self.direct_runs.run(direct, feeds, list(names), run_options)
        streams, user_ready = self._streams_for(stream)
        inputs = await import_feeds(self.env.importers, inputs, stream)
        if direct is not None and stream is None:
            feeds = host_feeds(self.plan.input_specs, inputs)
            if feeds is not None:
                return await self.direct_runs.run(direct, feeds, list(names), run_options)
        outputs = await self._execute(
            inputs, streams, user_ready, stream, "host", None, run_options
        )
        return [_on_host(outputs[name]) for name in names]

    async def _execute(
        self,
        inputs: Mapping[str, Any],
        streams: Mapping[str, SyncStream],
        user_ready: Notification | None,
        stream: SyncStream | None,
        output_location: str,
        into: Mapping[str, Tensor] | None,
        run_options: Any = None,
    ) -> dict[str, RunOutput]:
        """Run every step of the plan on ``inputs`` (imported already)."""
        run = _Run(
            self,
            bind_inputs(self.plan.input_specs, inputs, user_ready, stream, self.env.scope),
            streams,
            into,
            run_options,
        )
        try:
            return await run.execute(stream, output_location)
        except BaseException:
            # Cancelled or failed midway: kernels and copies may still be queued on the
            # streams; their tensors must outlive them.
            self.hold_until_passed(streams.values(), (run.values, run.placed))
            raise

    def _streams_for(
        self, stream: SyncStream | None
    ) -> tuple[Mapping[str, SyncStream], Notification | None]:
        """EP name -> the stream its work goes on in this run (the caller's ``stream`` for
        its EP), and a notification of the caller's work enqueued so far."""
        if stream is None:
            return self.plan.streams, None
        if not isinstance(stream, SyncStream):
            raise InvalidArgument(
                f"run: stream must be an aioep.SyncStream, got {describe_value(stream)}"
            )
        owner = next(
            (ep.name for ep in self.eps if stream.ep_device.factory is ep.ep_devices[0].factory),
            None,
        )
        if owner is None:
            raise InvalidArgument(
                f"run: {stream!r} is not on a device of this session's EPs "
                f"{[ep.name for ep in self.eps]}"
            )
        return {**self.plan.streams, owner: stream}, stream.record()

    def hold_until_passed(self, streams: Iterable[SyncStream], keep: object) -> None:
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
                # This backend cannot call back: hold until a later run or drain() sees it done.
                self._held.append((notes, keep))
                return

    async def drain(self) -> None:
        """Wait until the streams have passed the work of every run still held."""
        for notes, _ in self._held:
            for note in notes:
                with contextlib.suppress(Exception):
                    await note
        self._held.clear()


class _Run:
    """The state of one run: the values made so far, their copies in other memories, and
    the stream each EP's work goes on."""

    __slots__ = ("into", "placed", "run_options", "runner", "streams", "tails", "values")

    def __init__(
        self,
        runner: Runner,
        values: dict[str, RunValue],
        streams: Mapping[str, SyncStream],
        into: Mapping[str, Tensor] | None = None,
        run_options: Any = None,
    ) -> None:
        self.runner = runner
        self.run_options = run_options
        self.values = values
        self.placed: dict[tuple[str, MemoryDevice], RunValue] = {}
        self.streams = streams
        self.tails: dict[SyncStream, Notification] = {}
        self.into = into or {}

    async def execute(
        self, user_stream: SyncStream | None, output_location: str
    ) -> dict[str, RunOutput]:
        """Run every step, then hand the outputs over (see ``Session.run``)."""
        run_options = self.run_options
        for index, step in enumerate(self.runner.plan.steps):
            if run_options is not None and run_options.terminate:
                raise terminated(f"before step {index} of {len(self.runner.plan.steps)}")
            part = step.partition
            target = step.stream
            if part.ep is not None and target is not None:
                target = self.streams.get(part.ep.name, target)
            args = await self._gather(step, target)
            if part.ep is None:
                await self._run_cpu(step, args)
            else:
                await self._run_ep(step, target, args)
        result = await self._outputs(output_location)
        await self._finish(result, user_stream)
        return {name: result[name] for name in self.runner.plan.graph.output_names}

    async def _run_cpu(self, step: PlanStep, args: list[Any]) -> None:
        feeds = {n: to_ort(v) for n, v in zip(step.inputs, args)}
        results = await self.runner.workers.call(
            run_ort, step.ort_session, feeds, None, self.run_options
        )
        for name, produced in zip(step.ort_outputs, results):
            out = host_output(produced)
            self.values[name] = (
                RunValue(out) if isinstance(out, Tensor) else RunValue(None, host=out)
            )

    async def _run_ep(self, step: PlanStep, target: SyncStream | None, args: list[Any]) -> None:
        part = step.partition
        assert part.ep is not None
        assert step.compiled is not None
        device = step.memory.device
        dests = [
            t if t is not None and t.device == device else None
            for t in (self.into.get(n) for n in part.meta_def.outputs)
        ]
        try:
            if any(d is not None for d in dests):
                outs = await step.compiled.run_into(args, dests, target)
            else:
                outs = await step.compiled(args, target)
        except EpError:
            raise
        except Exception as exc:
            raise DeviceError(
                f"EP {part.ep.name!r} failed running {part.meta_def.name!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if len(outs) != len(part.meta_def.outputs) or not all(isinstance(t, Tensor) for t in outs):
            raise EpError(
                f"EP {part.ep.name!r}: {part.meta_def.name!r} returned {len(outs)} value(s); "
                f"expected {len(part.meta_def.outputs)} aioep.Tensor(s) "
                f"{list(part.meta_def.outputs)}"
            )
        ready = None
        if target is not None:
            ready = target.record()
            self.tails[target] = ready
        for name, t in zip(part.meta_def.outputs, outs):
            self.values[name] = RunValue(t, ready, target)

    async def _gather(self, step: PlanStep, target: SyncStream | None) -> list[Any]:
        """The step's input tensors in its memory, copying (and ordering) what is elsewhere
        (host values that are not tensors, for the CPU fallback, as they are)."""
        owner = self.runner.owner
        device = step.memory.device
        args: list[Any] = []
        copies: dict[SyncStream | None, list[tuple[str, Tensor, Tensor]]] = {}
        for name in step.inputs:
            const = step.constants.get(name)
            if const is not None:
                args.append(const)
                continue
            value = self.placed.get((name, device)) or self.values.get(name)
            if value is None:
                raise EpError(f"{owner!r}: value {name!r} was not produced before it is read")
            if value.tensor is None:
                if device.device_type is not DeviceType.CPU:
                    raise EpError(
                        f"{owner!r}: value {name!r} is not a tensor and cannot move to "
                        f"{step.memory.name!r}"
                    )
                args.append(value.host)
                continue
            t = value.tensor
            if same_memory(t.device, device):
                await _order(value, target)
                args.append(t)
                continue
            if t.dtype.hasobject:
                raise EpError(
                    f"{owner!r}: value {name!r} is a string tensor and cannot move to "
                    f"{step.memory.name!r}"
                )
            # Copy on the device side's stream: the consumer's, else the producer's.
            copy_stream = target if target is not None else value.stream
            if copy_stream is not None and copy_stream is not value.stream and value.ready:
                copy_stream.wait(value.ready)
            elif copy_stream is None and value.ready is not None:
                await value.ready
            ep = step.partition.ep
            if device.device_type is DeviceType.CPU:
                dst = Tensor.from_numpy(np.empty(t.shape, t.dtype))
            elif ep is not None:
                dst = ep.allocate(t.shape, t.dtype, stream=target, memory_info=step.memory)
            else:
                dst = self.runner.env.empty(t.shape, t.dtype, step.memory, stream=target)
            copies.setdefault(copy_stream, []).append((name, t, dst))
            args.append(dst)
        await self._copy(copies, device, target)
        return args

    async def _copy(
        self,
        copies: Mapping[SyncStream | None, list[tuple[str, Tensor, Tensor]]],
        device: MemoryDevice,
        target: SyncStream | None,
    ) -> None:
        """Enqueue the gathered copies, one batch per stream, and record where they land."""
        for copy_stream, items in copies.items():
            fut = self.runner.env.copy_tensors(
                [src for _, src, _ in items], [dst for _, _, dst in items], copy_stream
            )
            if copy_stream is not None and copy_stream is target:
                # Ordered on the consumer's own stream; others wait for the copy's notification.
                note: Notification | None = fut.notification
            else:
                await fut
                note = None
            for name, _, dst in items:
                self.placed[(name, device)] = RunValue(
                    dst, note, target if note is not None else None
                )

    async def _outputs(self, output_location: str) -> dict[str, Any]:
        """Output name -> value, copied to the host where asked to (one batch per stream)."""
        result: dict[str, Any] = {}
        to_host: list[tuple[str, RunValue]] = []
        for name in self.runner.plan.graph.output_names:
            value = self.values.get(name)
            if value is None:
                raise EpError(
                    f"{self.runner.owner!r}: no partition produced the graph output {name!r}"
                )
            if value.tensor is None:
                result[name] = value.host
            elif output_location == "host" and not value.tensor.is_host_accessible:
                to_host.append((name, value))
            else:
                result[name] = value.tensor
        waits: list[Any] = []
        by_stream: dict[SyncStream | None, list[tuple[str, RunValue]]] = {}
        for name, value in to_host:
            by_stream.setdefault(value.stream, []).append((name, value))
        for s, items in by_stream.items():
            srcs = [v.tensor for _, v in items if v.tensor is not None]
            dsts = [np.empty(t.shape, t.dtype) for t in srcs]
            waits.append(self.runner.env.copy_tensors(srcs, dsts, s))
            for (name, _), dst in zip(items, dsts):
                result[name] = Tensor.from_numpy(dst)
        for fut in waits:
            await fut
        return result

    async def _finish(self, result: Mapping[str, Any], user_stream: SyncStream | None) -> None:
        """Without ``user_stream``, wait until every stream has passed the run's work; with
        it, order that work before the caller's later work on it."""
        if user_stream is None:
            for note in self.tails.values():
                await note
            return
        for s, note in self.tails.items():
            if s is not user_stream:
                user_stream.wait(note)
        for name in list(result):
            value = self.values[name]
            if value.stream is None and value.ready is not None:
                await value.ready
        if self.tails:
            # Keep the run's tensors alive until every stream has passed this run's work.
            self.runner.hold_until_passed([user_stream], (self.values, self.placed))


def terminated(when: str) -> EpError:
    """The error of a run stopped by its ``RunOptions.terminate`` flag (onnxruntime's FAIL)."""
    return EpError(
        f"run: run_options.terminate is set: the run stopped {when} (onnxruntime: 'Exiting due "
        "to terminate flag being set to true.')"
    )


def _on_host(value: RunOutput) -> OrtOutput:
    """A host output as onnxruntime's ``run`` gives it: numpy arrays for tensors."""
    if isinstance(value, Tensor):
        array: HostArray = value.numpy()
        # Memory from an allocator (an EP's host memory) goes back to it, and a string
        # tensor's view is read-only: the caller gets its own array, as from onnxruntime.
        if value.buffer.allocator is not None or array.dtype.hasobject:
            own: HostArray = array.copy()
            return own
        return array
    if isinstance(value, list):
        # A sequence holds tensors, or maps (which stay as they are).
        items = [_on_host(v) if isinstance(v, Tensor) else v for v in value]
        return cast("list[HostArray] | list[MapValue]", items)
    return value


async def _order(value: RunValue, target: SyncStream | None) -> None:
    """Make ``target`` (or the host, for None) see ``value`` complete."""
    if value.ready is None or value.stream is target:
        return
    if target is not None:
        target.wait(value.ready)
    else:
        await value.ready


def _by_name(names: tuple[str, ...], results: list[Any]) -> dict[str, RunOutput]:
    """A direct run's outputs by name, as host tensors."""
    return {name: host_output(value) for name, value in zip(names, results)}
