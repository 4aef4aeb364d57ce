"""The execution-provider interface a backend implements (ORT's ``OrtEp``): claim nodes of a
graph (``get_capability``) and compile the claimed groups into callables (``compile``).

The contract, in the order a session uses it:

1. ``factory.create_ep(ep_devices, options)`` makes one `Ep` per session;
   the session then binds it to the environment and devices (`Ep.environment`,
   `Ep.ep_devices`).
2. ``ep.get_capability(graph)`` returns `IndexedSubGraph` claims: node
   indices of the `GraphView`, plus a `MetaDef` for a fused group (a
   single node may come without one). Nodes a higher-priority EP already took are
   marked (``graph.assigned_ep(i)``) and must not be claimed again.
3. ``ep.compile(groups)`` gets one `FusedGroup` per accepted claim and returns
   one `CompiledNode` per group, in the same order.
4. Per run, the session calls ``await compiled(inputs, stream)``: ``inputs`` follow
   ``meta_def.inputs`` and live in `Ep.memory_info` (the session copied them
   there and, for initializers, uploaded them once); the call returns one tensor per
   ``meta_def.outputs``, allocated by the EP with `Ep.allocate` (the
   environment's shared allocator for the EP's device memory). With a stream, the
   call may return as soon as the work is *enqueued* on it: the outputs are valid
   for work enqueued later on that stream. With ``stream=None`` the work must be
   complete when the call returns. A run with pre-bound outputs calls
   ``compiled.run_into(inputs, outputs, stream)`` instead, so that an EP that can write
   into the caller's tensors does (the default runs the node; the session then copies).
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy.typing as npt

from .._base.errors import ClosedError, InvalidArgument
from .._base.types import MemoryInfo, MemoryType
from .device import StreamMaker
from .tensor import Tensor

if TYPE_CHECKING:
    from .._base.types import DeviceType
    from .._graph.graph import GraphView, Node
    from .allocator import Allocator
    from .device import EpDevice
    from .stream import SyncStream
    from .transfer import TensorLike

__all__ = [
    "CompiledNode",
    "Ep",
    "EpEnvironment",
    "FusedGroup",
    "IndexedSubGraph",
    "MetaDef",
    "bind_ep",
]


class EpEnvironment(StreamMaker, Protocol):
    """What an EP may use of the environment of its session (`Ep.environment`): the
    `aioep.Environment` satisfies it."""

    def ep_devices(
        self, device_type: DeviceType | None = None, ep_name: str | None = None
    ) -> list[EpDevice]:
        """EP devices in registration order, optionally filtered by type and EP name."""
        ...

    def get_shared_allocator(self, memory_info: MemoryInfo) -> Allocator | None:
        """The shared allocator for that memory, or None."""
        ...

    def empty(
        self,
        shape: Sequence[int] | int,
        dtype: npt.DTypeLike,
        memory_info: MemoryInfo | None = None,
        *,
        stream: SyncStream | None = None,
    ) -> Tensor:
        """An uninitialised tensor from the shared allocator of ``memory_info``."""
        ...

    def copy_tensors(
        self,
        src: Sequence[TensorLike],
        dst: Sequence[TensorLike],
        stream: SyncStream | None = None,
        *,
        allow_reshape: bool = False,
    ) -> Awaitable[list[Tensor]]:
        """Copy each ``src[i]`` into ``dst[i]``; await the result for the destinations."""
        ...


@dataclass(frozen=True)
class MetaDef:
    """The interface of a fused group: its name and the values it reads and makes.

    ``inputs`` must name every value the group reads from outside (graph inputs,
    initializers, other nodes' outputs); ``outputs`` every value it makes that is read
    outside or is a graph output (more may be listed).
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    domain: str = "aioep.fused"
    attributes: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))


@dataclass(frozen=True)
class IndexedSubGraph:
    """A claim: node indices of the graph view, and a meta-def when they form a fused group."""

    nodes: tuple[int, ...]
    meta_def: MetaDef | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))


@dataclass(frozen=True)
class FusedGroup:
    """An accepted claim, as [`Ep.compile`][aioep.abc.Ep.compile] receives it: the meta-def
    (generated for a single node claimed without one), the nodes in topological order, and the
    graph."""

    meta_def: MetaDef
    nodes: tuple[Node, ...]
    graph: GraphView = field(repr=False)


class CompiledNode(abc.ABC):
    """A compiled group, called once per run; see the module docstring for the contract."""

    @abc.abstractmethod
    async def __call__(
        self, inputs: Sequence[Tensor], stream: SyncStream | None
    ) -> Sequence[Tensor]:
        """Run (or enqueue on ``stream``) the group and return its outputs in meta-def order."""

    async def run_into(
        self,
        inputs: Sequence[Tensor],
        outputs: Sequence[Tensor | None],
        stream: SyncStream | None,
    ) -> Sequence[Tensor]:
        """Like calling the node, with tensors to write some outputs into (``outputs``
        follows ``meta_def.outputs``; None where the EP allocates). An EP that can write
        into them returns those very tensors; the default runs the node and returns its
        own outputs, which the session then copies into the given tensors."""
        return await self(inputs, stream)

    def release(self) -> None:
        """Free what the compiled node holds; called when the session closes."""


class Ep(abc.ABC):
    """An execution provider instance for one session.

    Subclasses set ``name`` (the EP name, e.g. ``"SimExecutionProvider"``) and
    implement [`get_capability`][aioep.abc.Ep.get_capability] and [`compile`][aioep.abc.Ep.compile].
    """

    name: str = ""
    uses_stream: bool = True
    """False for an EP whose compiled nodes run off the loop on their own (they get
    ``stream=None``); the session then creates no stream for it."""
    initializers_in_memory: bool = True
    """False for an EP whose compiled groups hold their initializers themselves (ONNX
    Runtime plugin EPs put them in each group's sub-model): the session then passes the
    initializer inputs as host tensors and uploads nothing to
    [`memory_info`][aioep.abc.Ep.memory_info]."""

    def __init__(self) -> None:
        self._environment: EpEnvironment | None = None
        self._ep_devices: tuple[EpDevice, ...] = ()

    @property
    def environment(self) -> EpEnvironment:
        """The environment of the session that uses this EP."""
        if self._environment is None:
            raise ClosedError(f"{self!r} is not bound to a session yet")
        return self._environment

    @property
    def ep_devices(self) -> tuple[EpDevice, ...]:
        """The EP devices the session gave this EP (the first one runs its work)."""
        return self._ep_devices

    @property
    def memory_info(self) -> MemoryInfo:
        """Where this EP wants its inputs and puts its outputs (default: the first device's
        DEFAULT memory)."""
        if not self._ep_devices:
            raise InvalidArgument(f"{self!r} has no EP devices")
        info = self._ep_devices[0].memory_info(MemoryType.DEFAULT)
        if info is None:
            raise InvalidArgument(f"{self._ep_devices[0]!r} has no DEFAULT memory")
        return info

    def allocate(
        self,
        shape: Sequence[int],
        dtype: npt.DTypeLike,
        *,
        stream: SyncStream | None = None,
        memory_info: MemoryInfo | None = None,
    ) -> Tensor:
        """A tensor in [`memory_info`][aioep.abc.Ep.memory_info]: the EP's outputs, and the
        session's copies of the EP's inputs. By default from the environment's shared allocator; an
        EP whose runtime needs its I/O allocated a particular way overrides this."""
        return self.environment.empty(shape, dtype, memory_info or self.memory_info, stream=stream)

    @abc.abstractmethod
    def get_capability(self, graph: GraphView) -> list[IndexedSubGraph]:
        """The node groups this EP claims (skip nodes where ``graph.assigned_ep(i)`` is set).

        Called in a worker thread (off the event loop) while the session is created.
        """

    @abc.abstractmethod
    def compile(self, fused_groups: Sequence[FusedGroup]) -> list[CompiledNode]:
        """One compiled node per fused group, in the same order.

        Called once per session, in a worker thread (off the event loop).
        """

    def release(self) -> None:
        """Free what the EP holds; called when the session closes."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def bind_ep(ep: Ep, environment: EpEnvironment, ep_devices: Sequence[EpDevice]) -> None:
    """Give ``ep`` the environment and the EP devices of the session that uses it."""
    ep._environment = environment
    ep._ep_devices = tuple(ep_devices)
