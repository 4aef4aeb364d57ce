"""Inference sessions: a model partitioned across EPs, run with awaitable, stream-ordered
copies between the partitions.

A session is a plan (`aioep._session.plan`: the partitions in run order, where
values live and cross memories, the compiled EP nodes and the onnxruntime sessions of
the CPU fallback), built once by `create_session`, and a runner
(`aioep._session.run`) that executes the plan for each ``run``.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Mapping
from concurrent.futures import Future
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, overload

import anyio
import anyio.to_thread
from anyio.abc import AsyncResource

from .._base.errors import ClosedError, InvalidArgument
from .._base.types import MemoryDevice
from .._graph.graph import GraphView
from .._plugin.device import EpDevice
from .._plugin.ep import Ep
from .._plugin.stream import SyncStream
from .._plugin.tensor import Tensor
from .io_binding import IOBinding, place_bound_outputs
from .node_arg import NodeArg, node_args, ort_node_args
from .partition import CPU_EP_NAME
from .plan import SessionPlan
from .run import Runner, terminated
from .values import OrtOutput, RunInput, RunOutput, describe_value
from .workers import Workers

if TYPE_CHECKING:
    from onnxruntime import RunOptions

    from .host import SessionHost

__all__ = ["Session"]

_MAPPING_FORM = "run(inputs, stream=None, *, output_location='device')"
_ORT_FORM = "run(output_names, input_feed, run_options=None, *, stream=None)"
_ORT_KEYWORDS = frozenset({"output_names", "input_feed", "run_options"})


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class Session(AsyncResource):
    """A model partitioned across execution providers; create it with
    ``await env.create_session(model, ep_devices=[...])``.

    ``await session.run(inputs)`` returns a dict of output name -> [`Tensor`][aioep.Tensor];
    onnxruntime's form, ``await session.run(output_names, input_feed)``, a list of numpy
    arrays. Runs from many tasks may overlap: each run keeps its own state. ``async with``
    (or [`aclose`][aioep.Session.aclose]) closes the session's streams and releases its EPs.
    """

    __slots__ = (
        "__weakref__",
        "_active",
        "_env",
        "_eps",
        "_idle",
        "_node_args",
        "_plan",
        "_runner",
        "_state",
        "_tracked",
        "_workers",
        "graph",
    )

    _env: SessionHost
    _eps: list[Ep]
    _plan: SessionPlan
    _runner: Runner
    _workers: Workers
    _state: _State
    _active: int
    _idle: anyio.Event | None
    _node_args: tuple[tuple[NodeArg, ...], tuple[NodeArg, ...]] | None
    _tracked: tuple[EpDevice, ...]
    graph: GraphView
    """The model's graph view."""

    def __init__(self) -> None:
        raise TypeError("use 'await env.create_session(model, ep_devices=[...])'")

    @classmethod
    def _create(
        cls, env: SessionHost, graph: GraphView, eps: list[Ep], tracked: tuple[EpDevice, ...]
    ) -> Session:
        self = object.__new__(cls)
        self._env = env
        self.graph = graph
        self._eps = eps
        self._plan = SessionPlan(graph)
        self._workers = Workers()
        self._runner = Runner(env, self._plan, eps, self._workers, self)
        self._state = _State.OPEN
        self._active = 0
        self._idle = None
        self._node_args = None
        self._tracked = tracked  # the devices the environment counts this session against
        return self

    async def _prepare(self, opts: Mapping[str, Any], preload: Future[Any] | None) -> None:
        try:
            await self._plan.build(self._env, self._eps, opts, preload, self._workers)
            self._runner.prepared(opts.get("intra_op_num_threads") == 1)
            direct = self._plan.direct
            if direct is not None:  # onnxruntime runs the whole model: its own NodeArgs
                self._node_args = ort_node_args(direct.ort_session)
            else:  # from shape inference, which can be long: not on the event loop
                graph = self.graph
                self._node_args = await anyio.to_thread.run_sync(
                    lambda: (node_args(graph, graph.inputs), node_args(graph, graph.outputs))
                )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise

    # -- public ----------------------------------------------------------------------------
    @property
    def assignment(self) -> tuple[str, ...]:
        """The EP name per node, in the graph view's node order."""
        return self._plan.assignment

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
        return MappingProxyType(dict(self._plan.streams))

    @property
    def closed(self) -> bool:
        """True after [`aclose`][aioep.Session.aclose]."""
        return self._state is _State.CLOSED

    def get_inputs(self) -> list[NodeArg]:
        """The model inputs (initializers excluded) as onnxruntime's ``get_inputs()`` gives
        them: ``name``, ``type`` (``'tensor(float)'``) and ``shape`` (a symbolic dimension as
        its name, a dimension with neither size nor name as None)."""
        return list(self._io_node_args()[0])

    def get_outputs(self) -> list[NodeArg]:
        """The model outputs as onnxruntime's ``get_outputs()`` gives them; see
        `get_inputs`."""
        return list(self._io_node_args()[1])

    def _io_node_args(self) -> tuple[tuple[NodeArg, ...], tuple[NodeArg, ...]]:
        if self._node_args is None:  # only while create_session prepares the session
            graph = self.graph
            self._node_args = (node_args(graph, graph.inputs), node_args(graph, graph.outputs))
        return self._node_args

    @overload
    async def run(
        self,
        inputs: Mapping[str, RunInput],
        stream: SyncStream | None = None,
        *,
        output_location: Literal["device", "host"] = "device",
    ) -> dict[str, RunOutput]: ...

    @overload
    async def run(
        self,
        output_names: list[str] | tuple[str, ...] | None,
        input_feed: Mapping[str, RunInput],
        run_options: RunOptions | None = None,
        *,
        stream: SyncStream | None = None,
    ) -> list[OrtOutput]: ...

    async def run(self, *args: Any, **kwargs: Any) -> dict[str, RunOutput] | list[OrtOutput]:
        """Run the model: ``run(inputs, stream=None, *, output_location="device")`` returns
        output name -> tensor; onnxruntime's ``run(output_names, input_feed, run_options=None,
        *, stream=None)`` returns a list of numpy arrays.

        The first argument picks the form: a mapping (of input names to values) is aioep's,
        None, a list or a tuple (of output names) is onnxruntime's; anything else, a ``str``
        included, is an `InvalidArgument`. The keywords ``inputs`` /
        ``output_location`` and ``output_names`` / ``input_feed`` / ``run_options`` name the
        forms' parameters too.

        ``inputs`` maps every model input to a host array or a tensor on any device (or
        another library's tensor, taken zero-copy through DLPack or the CUDA Array
        Interface). Outputs stay where the producing EP put them; ``output_location="host"``
        copies them to host memory.

        Values that only the host holds pass through to and from onnxruntime's CPU
        execution provider: string tensors (numpy arrays of ``str``/``bytes`` in; host
        tensors of dtype ``object`` out), sequences (lists of arrays or tensors in; lists
        of host tensors out) and optionals (None, or the value). Without ``stream`` the
        call returns when all the run's work is complete. With ``stream`` (a stream of
        one of the session's EP devices) that EP's work and copies go on it, the inputs
        may still be in flight on it, and the call returns once everything is enqueued:
        the outputs are valid for work enqueued later on ``stream`` (host outputs
        are always complete). Cancelling the call abandons the wait, never
        work already enqueued.

        onnxruntime's form returns the outputs named in ``output_names`` (None or an empty
        list: all of them, in the model's order; a name may repeat), copied to the host as
        ``InferenceSession.run`` gives them: numpy arrays, sequences as lists of arrays, maps
        as dicts, None for an absent optional. It is complete when the call returns, also
        with ``stream``. ``run_options`` is None or an ``onnxruntime.RunOptions``: its
        ``terminate`` flag stops the run before its next step (or inside a step onnxruntime
        runs), and the options go to every call into onnxruntime's CPU execution provider
        (log levels, ``logid``, run config entries, active adapters apply there, not to the
        steps of other EPs); anything else is an `InvalidArgument`.

        Raises:
            InvalidArgument: bad arguments (an unknown input or output name, a value of the
                wrong dtype or shape, arguments that fit neither form).
            EpError: ``run_options.terminate`` is set.
            ClosedError: the session or its environment is closed.
        """
        if not kwargs:  # the common calls first: run(inputs), run(None or [names], input_feed)
            if len(args) == 1 and type(args[0]) is dict:
                return await self._run(args[0], None, "device", None)
            if (
                len(args) == 2
                and type(args[1]) is dict
                and (args[0] is None or type(args[0]) is list)
            ):
                return await self._run_ort(args[0], args[1], None, None)
        if args:
            first = args[0]
            if type(first) is dict or isinstance(first, Mapping):
                ort_form = False
            elif first is None or isinstance(first, (list, tuple)):
                if (
                    len(args) == 1
                    and "input_feed" not in kwargs
                    and not all(isinstance(name, str) for name in first or ())
                ):  # run([array]): inputs in a list, not output names
                    raise InvalidArgument(_bad_first_argument(first))
                ort_form = True
            else:
                raise InvalidArgument(_bad_first_argument(first))
        else:
            ort_form = not _ORT_KEYWORDS.isdisjoint(kwargs)
        if not ort_form:
            try:
                inputs, stream, output_location = _mapping_form(*args, **kwargs)
            except TypeError as exc:
                raise InvalidArgument(f"{exc} (the forms: {_MAPPING_FORM}, {_ORT_FORM})") from None
            return await self._run(inputs, stream, output_location, None)
        try:
            output_names, input_feed, run_options, stream = _ort_form(*args, **kwargs)
        except TypeError as exc:
            raise InvalidArgument(
                f"{exc} (onnxruntime's form, {_ORT_FORM}, since the first argument is None, a "
                f"list or a tuple; the other form: {_MAPPING_FORM})"
            ) from None
        return await self._run_ort(output_names, input_feed, run_options, stream)

    async def _run(
        self,
        inputs: Mapping[str, RunInput],
        stream: SyncStream | None,
        output_location: str,
        into: Mapping[str, Tensor] | None,
    ) -> dict[str, RunOutput]:
        """A run counted as in flight (``aclose`` waits for it)."""
        if self._state is not _State.OPEN:
            raise ClosedError(f"{self!r} is closed (by aclose(), or when its environment closed)")
        self._active += 1
        try:
            return await self._runner.run(inputs, stream, output_location, into)
        finally:
            self._active -= 1
            if self._active == 0 and self._idle is not None:
                self._idle.set()

    async def _run_ort(
        self, output_names: Any, input_feed: Any, run_options: Any, stream: Any
    ) -> list[OrtOutput]:
        """onnxruntime's form of `run`, counted as in flight like `_run`."""
        names = self._selected_outputs(output_names)
        if type(input_feed) is not dict and not isinstance(input_feed, Mapping):
            pairs = isinstance(input_feed, (list, tuple))
            raise InvalidArgument(
                f"run: input_feed must map input names to values, got {describe_value(input_feed)}"
                + ("; for (name, value) pairs, pass dict(pairs)" if pairs else "")
            )
        _check_run_options(run_options)
        if self._state is not _State.OPEN:
            raise ClosedError(f"{self!r} is closed (by aclose(), or when its environment closed)")
        self._active += 1
        try:
            return await self._runner.run_ort_form(input_feed, names, stream, run_options)
        finally:
            self._active -= 1
            if self._active == 0 and self._idle is not None:
                self._idle.set()

    def _selected_outputs(self, output_names: Any) -> tuple[str, ...]:
        """The outputs onnxruntime's form returns (None or empty: all, as onnxruntime)."""
        outputs = self.graph.output_names
        if not output_names:
            return outputs
        for i, name in enumerate(output_names):
            if not isinstance(name, str):
                raise InvalidArgument(
                    f"run: output_names must hold output names (str); output_names[{i}] is "
                    f"{describe_value(name)}"
                )
        unknown = [name for name in output_names if name not in outputs]
        if unknown:
            raise InvalidArgument(
                f"run: unknown output name(s) {unknown}; the model's outputs are {list(outputs)}"
            )
        return tuple(output_names)

    def io_binding(self) -> IOBinding:
        """A new [`IOBinding`][aioep.IOBinding] for this session's inputs and outputs."""
        if self._state is not _State.OPEN:
            raise ClosedError(f"{self!r} is closed")
        readers: dict[str, list[MemoryDevice]] = {}
        for step in self._plan.steps:
            for name in step.inputs:
                readers.setdefault(name, []).append(step.memory.device)
        outputs = {name: self.graph.value_info(name) for name in self.output_names}
        return IOBinding(
            self,
            self._env,
            self._plan.input_specs,
            outputs,
            {name: tuple(devices) for name, devices in readers.items()},
        )

    async def run_with_binding(
        self, binding: IOBinding, stream: SyncStream | None = None
    ) -> dict[str, RunOutput]:
        """Run the model on ``binding``'s inputs and put each bound output where it is bound.

        An output bound to a tensor is written into it (by the EP itself where it can, see
        [`CompiledNode.run_into`][aioep.abc.CompiledNode.run_into], else by a copy); one
        bound to a memory info is put in that memory; unbound outputs stay where the
        producing EP put them. Returns the outputs (also kept as ``binding.get_outputs()``).
        ``stream`` works as in [`run`][aioep.Session.run]: with one, the copies into bound outputs
        are enqueued on it too.
        """
        if not isinstance(binding, IOBinding) or binding._session is not self:
            raise InvalidArgument(
                f"run_with_binding: {binding!r} is not an IOBinding of this session "
                "(make one with session.io_binding())"
            )
        await binding._producers_ready(stream)
        bound = binding._bound_outputs()
        into = {name: t for name, t in bound.items() if isinstance(t, Tensor)}
        for name, t in into.items():
            if t.buffer.freed:  # freed after it was bound: a run must not write into it
                raise InvalidArgument(
                    f"run_with_binding: output {name!r} is bound to {t!r}, which was freed"
                )
        outputs = await self._run(binding._run_inputs(), stream, "device", into)
        results, srcs, dsts = place_bound_outputs(self._env, outputs, bound)
        if srcs:
            future = self._env.copy_tensors(srcs, dsts, stream)
            if stream is None:
                await future
        binding._set_results(results)
        return results

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
            await self._plan.close_streams()
            await self._runner.drain()
            self._runner.close()
            await self._plan.release()
            for ep in self._eps:
                ep.release()
            self._workers.shutdown()
            self._env.track_session(self, self._tracked, open=False)

    async def __aenter__(self) -> Session:
        if self._state is not _State.OPEN:
            raise ClosedError(f"{self!r} is closed")
        return self

    def __repr__(self) -> str:
        eps = sorted(set(self.assignment)) or [CPU_EP_NAME]
        return f"<Session {self._state.value} nodes={len(self.graph.nodes)} eps={eps}>"


def _mapping_form(
    inputs: Any, stream: Any = None, *, output_location: Any = "device"
) -> tuple[Any, Any, Any]:
    return inputs, stream, output_location


def _ort_form(
    output_names: Any, input_feed: Any, run_options: Any = None, *, stream: Any = None
) -> tuple[Any, Any, Any, Any]:
    return output_names, input_feed, run_options, stream


# Python binds run's arguments to one of these; its TypeError then names Session.run.
_mapping_form.__qualname__ = _ort_form.__qualname__ = "Session.run"


def _bad_first_argument(first: object) -> str:
    hint = ""
    if isinstance(first, str):
        hint = f"; for the one output {first!r}, pass a list: run([{first!r}], input_feed)"
    elif isinstance(first, (list, tuple)):
        hint = "; inputs go in a mapping of input names to values"
    return (
        f"run: the first argument must be a mapping of input names to values ({_MAPPING_FORM}), "
        f"or None or a list of output names (onnxruntime's {_ORT_FORM}); "
        f"got {describe_value(first)}" + hint
    )


def _check_run_options(run_options: object) -> None:
    """Accept None or an ``onnxruntime.RunOptions`` (whose ``terminate`` is not set)."""
    if run_options is None:
        return
    ort = sys.modules.get("onnxruntime")  # a RunOptions was made with it: it is imported
    if ort is None or not isinstance(run_options, ort.RunOptions):
        hint = ""
        if isinstance(run_options, SyncStream):
            hint = "; stream is a keyword in this form: run(output_names, input_feed, stream=...)"
        raise InvalidArgument(
            "run: run_options must be None or an onnxruntime.RunOptions, got "
            f"{describe_value(run_options)}{hint}"
        )
    if run_options.terminate:
        raise terminated("before it started")
