"""Inference sessions: a model partitioned across EPs, run with awaitable, stream-ordered
copies between the partitions.

A session is a plan (`aioep._session.plan`: the partitions in run order, where
values live and cross memories, the compiled EP nodes and the onnxruntime sessions of
the CPU fallback), built once by `create_session`, and a runner
(`aioep._session.run`) that executes the plan for each ``run``.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy.typing as npt
from anyio.abc import AsyncResource

from .._base.errors import ClosedError, EpError, InvalidArgument
from .._base.progress import wants_bar
from .._base.types import MemoryDevice
from .._base.validate import check_int, check_options
from .._devices.device import EpDevice
from .._devices.host import HOST_EP_NAME
from .._environment.environment import set_session_factory
from .._graph.graph import GraphView
from .._streams.stream import SyncStream
from .._tensors.tensor import Tensor
from .cpu_fallback import load_whole
from .ep import Ep
from .io_binding import IOBinding, place_bound_outputs
from .partition import CPU_EP_NAME
from .plan import SessionPlan
from .run import Runner
from .workers import Workers

if TYPE_CHECKING:
    from .._environment.environment import Environment

__all__ = ["Session", "create_session"]

_OPTION_KEYS = ("ep_options", "intra_op_num_threads", "inter_op_num_threads", "progress")


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


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
    ``ep_options`` (EP name -> option mapping for ``create_ep``),
    ``intra_op_num_threads`` / ``inter_op_num_threads`` for the CPU fallback, and
    ``progress`` (a tqdm bar over the upload, compile and load stages; None, the default:
    when standard error is a terminal).
    """
    opts, ep_options = _checked_options(options)
    groups = _device_groups(env, ep_devices)
    preload: Future[Any] | None = None
    if not groups:
        # Only the CPU fallback: it will run the whole model, so onnxruntime loads it while
        # the graph view is built (a session then costs about what onnxruntime's own does).
        pool = ThreadPoolExecutor(1, thread_name_prefix="aioep-ort-load")
        preload = pool.submit(load_whole, model, opts)
        pool.shutdown(wait=False)  # the thread ends after the load; nothing waits for it here
    graph = await anyio.to_thread.run_sync(GraphView.from_model, model)
    devices = [d for devs in groups for d in devs]
    eps: list[Ep] = []
    try:
        for devs in groups:
            eps.append(_create_ep(env, devs, ep_options))
        if len({ep.name for ep in eps}) != len(eps):
            raise InvalidArgument(f"create_session: two EPs share a name: {[e.name for e in eps]}")
        session = Session._create(env, graph, eps)
        env._track_session(session, devices, open=True)
        try:
            await session._prepare(opts, preload)
        except BaseException:
            env._track_session(session, devices, open=False)
            raise
    except BaseException:
        for ep in eps:
            ep.release()
        raise
    return session


def _checked_options(
    options: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], Mapping[str, Any]]:
    """The session options, and the ``ep_options`` among them."""
    opts = check_options("create_session", "options", options)
    unknown = sorted(set(opts) - set(_OPTION_KEYS))
    if unknown:
        raise InvalidArgument(
            f"create_session: unknown option(s) {unknown}; known: {list(_OPTION_KEYS)}"
        )
    for key in ("intra_op_num_threads", "inter_op_num_threads"):
        if key in opts:
            opts[key] = check_int("create_session", key, opts[key], maximum=1 << 16)
    opts["progress"] = wants_bar(opts.get("progress"), "create_session")
    ep_options = opts.get("ep_options") or {}
    if not isinstance(ep_options, Mapping):
        raise InvalidArgument(
            f"create_session: ep_options must map EP names to option mappings, got {ep_options!r}"
        )
    ep_options = {
        name: check_options("create_session", f"ep_options[{name!r}]", value)
        for name, value in check_options("create_session", "ep_options", ep_options).items()
    }
    return opts, ep_options


def _device_groups(env: Environment, ep_devices: Sequence[EpDevice] | None) -> list[list[EpDevice]]:
    """``ep_devices`` grouped by factory, in order of first appearance (the host's left
    out: the CPU fallback serves it)."""
    groups: dict[int, list[EpDevice]] = {}
    for dev in ep_devices or ():
        if not isinstance(dev, EpDevice):
            raise InvalidArgument(
                f"create_session: ep_devices must be EpDevice objects, got {dev!r}"
            )
        env._library_of(dev)  # raises for a device of another environment
        if dev.factory.name == HOST_EP_NAME:
            continue
        groups.setdefault(id(dev.factory), []).append(dev)
    return list(groups.values())


def _create_ep(env: Environment, devs: list[EpDevice], ep_options: Mapping[str, Any]) -> Ep:
    """The EP that the factory of ``devs`` makes for them, bound to ``env``."""
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
    return ep


class Session(AsyncResource):
    """A model partitioned across execution providers; create it with
    ``await env.create_session(model, ep_devices=[...])``.

    ``await session.run(inputs)`` returns a dict of output name -> [`Tensor`][aioep.Tensor].
    Runs from many tasks may overlap: each run keeps its own state. ``async with``
    (or [`aclose`][aioep.Session.aclose]) closes the session's streams and releases its EPs.
    """

    __slots__ = (
        "__weakref__",
        "_active",
        "_env",
        "_eps",
        "_idle",
        "_plan",
        "_runner",
        "_state",
        "_workers",
        "graph",
    )

    _env: Environment
    _eps: list[Ep]
    _plan: SessionPlan
    _runner: Runner
    _workers: Workers
    _state: _State
    _active: int
    _idle: anyio.Event | None
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
        self._plan = SessionPlan(graph)
        self._workers = Workers()
        self._runner = Runner(env, self._plan, eps, self._workers, self)
        self._state = _State.OPEN
        self._active = 0
        self._idle = None
        return self

    async def _prepare(self, opts: Mapping[str, Any], preload: Future[Any] | None) -> None:
        try:
            await self._plan.build(self._env, self._eps, opts, preload, self._workers)
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

    async def run(
        self,
        inputs: Mapping[str, Tensor | npt.ArrayLike],
        stream: SyncStream | None = None,
        *,
        output_location: str = "device",
    ) -> dict[str, Any]:
        """Run the model and return output name -> tensor.

        ``inputs`` maps every model input to a host array or a tensor on any device (or
        another library's tensor, taken zero-copy through DLPack or the CUDA Array
        Interface).
        Outputs stay where the producing EP put them; ``output_location="host"``
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
        """
        return await self._run(inputs, stream, output_location, None)

    async def _run(
        self,
        inputs: Mapping[str, Tensor | npt.ArrayLike],
        stream: SyncStream | None,
        output_location: str,
        into: Mapping[str, Tensor] | None,
    ) -> dict[str, Any]:
        """A run counted as in flight (``aclose`` waits for it)."""
        if self._state is not _State.OPEN:
            raise ClosedError(f"{self!r} is closed")
        self._active += 1
        try:
            return await self._runner.run(inputs, stream, output_location, into)
        finally:
            self._active -= 1
            if self._active == 0 and self._idle is not None:
                self._idle.set()

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
    ) -> dict[str, Any]:
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
            await self._plan.release()
            for ep in self._eps:
                ep.release()
            self._workers.shutdown()
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


set_session_factory(create_session)
