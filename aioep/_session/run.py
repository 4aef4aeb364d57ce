"""The runner: executes a session's plan for each ``run``.

A run walks the steps in order. Before a step runs, each input that is not in the step's
memory is copied there through the environment's data transfers, on the stream of the
device side of the copy; a stream that reads a value made on another stream first waits
for it on the device. EP steps are enqueued on the session's stream for their device (or
the caller's); CPU steps run on the session's worker threads once their inputs are on
the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from threading import get_ident
from time import perf_counter, thread_time
from typing import TYPE_CHECKING, Any, cast

import anyio.lowlevel
import numpy as np

from .._base.errors import DeviceError, EpError, InvalidArgument
from .._base.types import DeviceType, MemoryDevice
from .._interop.foreign import import_feeds
from .._streams.stream import SyncStream
from .._tensors.tensor import Tensor
from .cpu_fallback import host_output, run_ort, to_ort
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
    from .._environment.environment import Environment
    from .._streams.notification import Notification
    from .ep import Ep
    from .plan import PlanStep, SessionPlan
    from .workers import Workers

__all__ = [
    "MAX_SHAPE_KINDS",
    "TRIAL_FACTOR",
    "TRIAL_RUNS",
    "Runner",
    "terminated",
]

_LOCATIONS = ("device", "host")

MAX_SHAPE_KINDS = 64
"""The most input-shape combinations of one session the inline path tracks; runs on
shapes beyond them always go to a worker."""

TRIAL_RUNS = 8
"""Runs of a kind timed on a worker before the kind may run inline (a session's first runs
are slower than the rest: onnxruntime plans its memory on them)."""

TRIAL_FACTOR = 2.0
"""A kind may run inline once the least time of its first `TRIAL_RUNS` runs on a worker
is at most this many times the inline budget: a worker woken for one run computes it
slower than a thread that has just run the model (cold caches; 1.5-5x for a 10 us model on
a 2-core VM), so that time only estimates the inline cost. Every inline run is timed: the
first one over the budget moves the kind off the loop for good (its one overrun)."""


class _ShapeKind:
    """What a session knows of its direct runs on one set of input shapes (kept and read on
    the loop thread only)."""

    __slots__ = ("best", "inline", "timed")

    def __init__(self) -> None:
        self.best = float("inf")  # the least time of a trial run on a worker
        self.timed = 0  # trial runs timed so far
        self.inline: bool | None = None  # undecided while the trial runs


_Check = tuple[str, "np.dtype[Any]", tuple[int, ...] | None, int, tuple[tuple[int, int], ...]]
"""A model input as the fast path checks it: name, dtype, the shape when every dimension is
fixed (else None), the rank, and the fixed dimensions as (index, size)."""


class Runner:
    """Runs a session's plan; runs from many tasks may overlap, each keeps its own state."""

    __slots__ = (
        "_checks",
        "_held",
        "_kinds",
        "_owner",
        "_token",
        "_warm_thread",
        "env",
        "eps",
        "plan",
        "single_threaded",
        "workers",
    )

    def __init__(
        self,
        env: Environment,
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
        self._checks: tuple[_Check, ...] | None = None
        self._token = object()  # this session, in the inline budget's kinds
        self._warm_thread = 0  # the thread that ran this session's last inline run
        self._kinds: dict[tuple[object, tuple[tuple[int, ...], ...]], _ShapeKind] = {}
        self.single_threaded = False
        """True when onnxruntime computes the session's CPU steps on the calling thread
        alone (``intra_op_num_threads=1``): its runs are then timed in that thread's CPU
        time, which a thread preempted by another process does not accrue."""

    def prepared(self, single_threaded: bool) -> None:
        """The plan is built: note whether onnxruntime computes on the calling thread alone
        and work out the checks of the fast path (every input a tensor)."""
        self.single_threaded = single_threaded
        specs = self.plan.input_specs
        if self.plan.direct is None or any(
            info.kind != "tensor" or dtype is None for _, dtype, _, info in specs
        ):
            return
        checks: list[_Check] = []
        for name, dtype, shape, _ in specs:
            assert dtype is not None
            if shape is None:
                return  # any rank: the general checks
            if all(isinstance(d, int) for d in shape):
                checks.append((name, dtype, tuple(shape), len(shape), ()))
            else:
                fixed = tuple((i, d) for i, d in enumerate(shape) if isinstance(d, int))
                checks.append((name, dtype, None, len(shape), fixed))
        self._checks = tuple(checks)

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
            feeds = self._fast_feeds(inputs)
            if feeds is not None:
                results = await self._run_direct(direct, feeds, None, None)
                return _by_name(direct.ort_outputs, results)
        streams, user_ready = self._streams_for(stream)
        inputs = await import_feeds(self.env, inputs, stream)
        if direct is not None and stream is None:
            feeds = host_feeds(self.plan.input_specs, inputs)
            if feeds is not None:
                results = await self._run_direct(direct, feeds, None, None)
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
            feeds = self._fast_feeds(inputs)
            if feeds is not None:  # onnxruntime's own answer, as it is
                return await self._run_direct(direct, feeds, list(names), run_options)
        streams, user_ready = self._streams_for(stream)
        inputs = await import_feeds(self.env, inputs, stream)
        if direct is not None and stream is None:
            feeds = host_feeds(self.plan.input_specs, inputs)
            if feeds is not None:
                return await self._run_direct(direct, feeds, list(names), run_options)
        outputs = await self._execute(
            inputs, streams, user_ready, stream, "host", None, run_options
        )
        return [_on_host(outputs[name]) for name in names]

    def _fast_feeds(self, inputs: Mapping[str, RunInput]) -> dict[str, Any] | None:
        """``inputs`` as onnxruntime's feeds when each is a numpy array of the model's
        dtype and shape (checked once, against what was worked out when the session was
        made); else None, and the general checks decide."""
        checks = self._checks
        if checks is None or type(inputs) is not dict or len(inputs) != len(checks):
            return None
        for name, dtype, shape, ndim, fixed in checks:
            given = inputs.get(name)
            if type(given) is not np.ndarray or given.dtype != dtype:
                return None
            if shape is not None:
                if given.shape != shape:
                    return None
            elif given.ndim != ndim or any(given.shape[i] != n for i, n in fixed):
                return None
        # A copy: the caller may change its mapping while the run waits for a worker.
        return dict(inputs)

    async def _run_direct(
        self,
        step: PlanStep,
        feeds: dict[str, Any],
        names: list[str] | None,
        run_options: Any,
    ) -> list[Any]:
        """The model's one onnxruntime call (CPU EP only), returning onnxruntime's list.

        Runs on a worker, which wakes the loop itself when done, unless the environment's
        inline budget lets this kind (this session, these input shapes) run on the loop
        thread: a kind is timed on a worker for its first `TRIAL_RUNS` runs, may run
        inline when the best of them is within `TRIAL_FACTOR` times the budget, and moves
        off the loop for good at its first inline run over the budget (the session's first
        inline run on a thread is onnxruntime's set-up of that thread: not timed). Runs are
        timed in
        the running thread's CPU time where onnxruntime computes on that thread alone
        (`single_threaded`: a loop thread preempted by another process is not the run's
        overrun), else by the wall clock.
        """
        session = step.ort_session
        budget = self.env.inline_budget
        if budget.budget:
            kind = (self._token, tuple([a.shape for a in feeds.values()]))
            state = self._kinds.get(kind)
            if state is None and len(self._kinds) < MAX_SHAPE_KINDS:
                state = self._kinds[kind] = _ShapeKind()
            if state is not None:
                clock = thread_time if self.single_threaded else perf_counter
                if state.inline:
                    thread = get_ident()
                    if thread != self._warm_thread:
                        # onnxruntime's first run of a session on a thread sets the thread
                        # up (70-330 us on a 2-core VM for a 10 us model): paid once, not
                        # held against the kind.
                        self._warm_thread = thread
                        results = run_ort(session, feeds, names, run_options)
                        await _checkpoint()
                        return results
                    start = clock()
                    try:
                        results = run_ort(session, feeds, names, run_options)
                    finally:
                        seconds = clock() - start
                        budget.ran_inline(kind, 0, seconds)
                        if seconds > budget.budget:
                            state.inline = False  # the one overrun of this kind
                    await _checkpoint()
                    return results
                if state.inline is None:  # on trial
                    results, seconds = await self.workers.call(
                        _timed, clock, session, feeds, names, run_options
                    )
                    state.timed += 1
                    state.best = min(state.best, seconds)
                    if state.inline is None and state.timed >= TRIAL_RUNS:
                        state.inline = state.best <= TRIAL_FACTOR * budget.budget
                    return results
        return await self.workers.call(run_ort, session, feeds, names, run_options)

    def close(self) -> None:
        """The session is closing: the inline budget forgets its kinds."""
        budget = self.env.inline_budget
        for kind in self._kinds:
            budget.forget(kind)
        self._kinds.clear()

    def inline_kinds(self) -> dict[tuple[tuple[int, ...], ...], bool | None]:
        """For diagnostics and tests: per set of input shapes tracked, whether its runs go
        inline (True), to a worker (False), or are on trial (None)."""
        return {shapes: state.inline for (_, shapes), state in self._kinds.items()}

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
            bind_inputs(self.plan.input_specs, inputs, user_ready, stream, self.env._scope),
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


async def _checkpoint() -> None:
    """Let the loop run other tasks once: a run that ran inline still yields, as one that
    hopped does."""
    if asyncio._get_running_loop() is not None:
        await asyncio.sleep(0)
    else:
        await anyio.lowlevel.checkpoint()


def _timed(
    clock: Callable[[], float],
    session: Any,
    feeds: dict[str, Any],
    names: list[str] | None,
    run_options: Any,
) -> tuple[list[Any], float]:
    """`run_ort` on a worker, with the seconds it took by ``clock``."""
    start = clock()
    results = run_ort(session, feeds, names, run_options)
    return results, clock() - start


def _by_name(names: tuple[str, ...], results: list[Any]) -> dict[str, RunOutput]:
    """A direct run's outputs by name, as host tensors."""
    return {name: host_output(value) for name, value in zip(names, results)}
