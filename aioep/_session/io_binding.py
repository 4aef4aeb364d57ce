"""Pre-bound session I/O (ORT's IOBinding, the awaitable way): tensors bound to a session's
inputs and outputs once, checked when bound, and used by every
`Session.run_with_binding`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._base.errors import InvalidArgument
from .._base.protocols import SupportsCudaArrayInterface, SupportsDLPack
from .._base.types import HOST_MEMORY_DEVICE, MemoryDevice, MemoryInfo
from .._memory.foreign import import_value, is_foreign
from .._plugin.notification import Notification
from .._plugin.ownership import check_owner
from .._plugin.tensor import Tensor
from .values import InputSpec, check_type, same_memory

if TYPE_CHECKING:
    from .._graph.graph import ValueInfo
    from .._plugin.stream import SyncStream
    from .._plugin.stream_impl import NotificationImpl
    from .host import SessionHost

__all__ = ["IOBinding", "place_bound_outputs"]


class IOBinding:
    """Inputs and outputs bound to one session, reused across runs.

    Made by [`Session.io_binding`][aioep.Session.io_binding]. Each bind is checked
    at once: an unknown name, a wrong dtype or shape, a freed tensor, a tensor of another
    environment, or memory the session's EPs cannot read (no data transfer reaches them)
    raise [`InvalidArgument`][aioep.InvalidArgument], and the binding is left as it was. A bound
    tensor stays alive while it is bound.
    """

    def __init__(
        self,
        session: object,
        env: SessionHost,
        inputs: tuple[InputSpec, ...],
        outputs: Mapping[str, ValueInfo | None],
        readers: Mapping[str, tuple[MemoryDevice, ...]],
    ) -> None:
        self._env = env
        self._input_specs = {spec[0]: spec for spec in inputs}
        self._output_infos = dict(outputs)
        self._readers = readers
        self._inputs: dict[str, Tensor] = {}
        self._outputs: dict[str, Tensor | MemoryInfo] = {}
        self._results: dict[str, Any] = {}
        # Foreign producers' pending work on bound values (a CUDA Array Interface's stream,
        # a DLPack producer's), waited for by the next run.
        self._producer_work: dict[tuple[str, str], NotificationImpl] = {}
        self._new_work: NotificationImpl | None = None
        self._session = session  # only runs of this session take the binding

    def _commit_work(self, key: tuple[str, str]) -> None:
        """A bind succeeded: its value's producer work (if any) replaces the old value's."""
        work, self._new_work = self._new_work, None
        if work is None:
            self._producer_work.pop(key, None)
        else:
            self._producer_work[key] = work

    # -- inputs ----------------------------------------------------------------------------
    def bind_input(
        self,
        name: str,
        value: Tensor | npt.NDArray[Any] | SupportsDLPack | SupportsCudaArrayInterface,
    ) -> None:
        """Bind ``value`` (a tensor on any device the session can read, a numpy array, or
        another library's tensor: DLPack, CUDA Array Interface) to model input ``name``;
        it replaces what was bound there."""
        spec = self._input_specs.get(name)
        if spec is None:
            raise InvalidArgument(
                f"bind_input: unknown input {name!r}; the model's inputs are "
                f"{list(self._input_specs)}"
            )
        tensor = self._tensor(value, f"bind_input({name!r})", ("input", name))
        _, want, shape, _ = spec
        check_type(f"bind_input({name!r}): {tensor!r}", tensor, want, shape)
        for reader in self._readers.get(name, ()):
            if not same_memory(tensor.device, reader) and not self._can_copy(tensor.device, reader):
                raise InvalidArgument(
                    f"bind_input({name!r}): {tensor!r} is in {tensor.memory_info.name!r}, and no "
                    f"data transfer of this environment copies it to {reader}, where the "
                    "session reads it"
                )
        self._inputs[name] = tensor
        self._commit_work(("input", name))

    @property
    def inputs(self) -> Mapping[str, Tensor]:
        """Input name -> the tensor bound to it."""
        return dict(self._inputs)

    def clear_binding_inputs(self) -> None:
        """Unbind every input."""
        self._inputs.clear()
        self._producer_work = {k: w for k, w in self._producer_work.items() if k[0] != "input"}

    # -- outputs ---------------------------------------------------------------------------
    def bind_output(self, name: str, target: Tensor | MemoryInfo) -> None:
        """Bind model output ``name`` to ``target``: a tensor that each run writes the output
        into (dtype and, where the model fixes it, shape must match), or the memory info
        each run puts the output in (on the device of that memory's shared allocator)."""
        if name not in self._output_infos:
            raise InvalidArgument(
                f"bind_output: unknown output {name!r}; the model's outputs are "
                f"{list(self._output_infos)}"
            )
        where = f"bind_output({name!r})"
        if isinstance(target, MemoryInfo):
            host = target.device == HOST_MEMORY_DEVICE
            if not host and self._env.get_shared_allocator(target) is None:
                raise InvalidArgument(
                    f"{where}: this environment has no allocator for {target.name!r} "
                    f"({target.device})"
                )
            self._outputs[name] = target
            self._producer_work.pop(("output", name), None)
            return
        tensor = self._tensor(target, where, ("output", name))
        if tensor.buffer.readonly:
            raise InvalidArgument(f"{where}: {tensor!r} is read-only")
        info = self._output_infos[name]
        if info is not None:
            check_type(f"{where}: {tensor!r}", tensor, info.dtype, info.shape)
        self._outputs[name] = tensor
        self._commit_work(("output", name))

    @property
    def outputs(self) -> Mapping[str, Tensor | MemoryInfo]:
        """Output name -> the tensor or memory info bound to it."""
        return dict(self._outputs)

    def clear_binding_outputs(self) -> None:
        """Unbind every output."""
        self._outputs.clear()
        self._producer_work = {k: w for k, w in self._producer_work.items() if k[0] != "output"}

    def get_outputs(self) -> dict[str, Any]:
        """The last run's outputs, in the model's output order (bound ones where bound)."""
        return dict(self._results)

    # -- checks ----------------------------------------------------------------------------
    def _tensor(self, value: Any, where: str, key: tuple[str, str]) -> Tensor:
        self._new_work = None
        if is_foreign(value):
            imported, work = import_value(
                self._env.importers, value, where, writable=key[0] == "output"
            )
            if not isinstance(imported, Tensor):
                raise InvalidArgument(
                    f"{where}: {type(value).__name__} is not C-contiguous (strides "
                    f"{imported.strides}); bind a contiguous tensor"
                )
            if imported.buffer.freed:
                raise InvalidArgument(f"{where}: {imported!r} was freed")
            if imported.buffer.allocator is not None:
                # aioep memory that came back wrapped: its environment's rule applies.
                check_owner(imported, self._env.scope, where)
            self._new_work = work
            return imported
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject or not value.flags.c_contiguous:
                raise InvalidArgument(
                    f"{where}: a numpy array must be C-contiguous and hold numbers, got "
                    f"dtype {value.dtype}, strides {value.strides}"
                )
            return Tensor.from_numpy(value)
        if not isinstance(value, Tensor):
            raise InvalidArgument(
                f"{where}: expected an aioep.Tensor or a numpy array, got {type(value).__name__}"
            )
        if value.buffer.freed:
            raise InvalidArgument(f"{where}: {value!r} was freed")
        if value.buffer.allocator is not None:
            check_owner(value, self._env.scope, where)
        return value

    def _can_copy(self, src: MemoryDevice, dst: MemoryDevice) -> bool:
        return self._env.can_copy(src, dst)

    # -- runs ------------------------------------------------------------------------------
    async def _producers_ready(self, stream: SyncStream | None) -> None:
        """Order the run after the foreign producers' work pending when they were bound:
        on ``stream``, on the device, or awaited without blocking the loop."""
        if not self._producer_work:
            return
        work, self._producer_work = list(self._producer_work.values()), {}
        for impl in work:
            if stream is not None:
                stream.wait(Notification(impl))
            else:
                await Notification(impl)

    def _run_inputs(self) -> dict[str, Tensor]:
        missing = [
            n
            for n, spec in self._input_specs.items()
            if n not in self._inputs and spec[3].kind != "optional"  # optional: None, as ORT
        ]
        if missing:
            raise InvalidArgument(f"run_with_binding: input(s) {missing} are not bound")
        return dict(self._inputs)

    def _bound_outputs(self) -> dict[str, Tensor | MemoryInfo]:
        return dict(self._outputs)

    def _set_results(self, results: Mapping[str, Any]) -> None:
        self._results = dict(results)


def place_bound_outputs(
    env: SessionHost, outputs: Mapping[str, Any], bound: Mapping[str, Tensor | MemoryInfo]
) -> tuple[dict[str, Any], list[Tensor], list[Tensor]]:
    """A run's outputs as `Session.run_with_binding` returns them, and the copies
    (sources, destinations) that put the bound ones in place.

    Raises:
        InvalidArgument: an output does not fit the tensor bound to it (a dynamic shape
            came out different).
    """
    results: dict[str, Any] = {}
    srcs: list[Tensor] = []
    dsts: list[Tensor] = []
    for name, value in outputs.items():
        target = bound.get(name)
        if target is None or not isinstance(value, Tensor):
            results[name] = value
            continue
        if isinstance(target, MemoryInfo):
            if value.device == target.device:
                results[name] = value
                continue
            dst = env.empty(value.shape, value.dtype, target)
        else:
            dst = target
            if value is dst:  # the EP wrote straight into it
                results[name] = dst
                continue
            if dst.shape != value.shape or dst.dtype != value.dtype:
                raise InvalidArgument(
                    f"run_with_binding: output {name!r} came out with shape {value.shape} and "
                    f"dtype {value.dtype}; the tensor bound to it is {dst.shape} {dst.dtype}"
                )
        srcs.append(value)
        dsts.append(dst)
        results[name] = dst
    return results, srcs, dsts
