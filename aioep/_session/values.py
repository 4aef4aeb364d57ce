"""The values of a session run: what a run holds for each graph value, and the model inputs
checked against the graph and bound as such values."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import numpy.typing as npt

from .._base.errors import InvalidArgument
from .._base.protocols import SupportsCudaArrayInterface, SupportsDLPack
from .._base.types import DeviceType, MemoryDevice
from .._base.validate import describe
from .._graph.types import ValueInfo
from .._plugin.ownership import Scope, check_owner
from .._plugin.tensor import Tensor, object_tensor

if TYPE_CHECKING:
    from .._graph.graph import GraphView
    from .._plugin.notification import Notification
    from .._plugin.stream import SyncStream

__all__ = [
    "HostArray",
    "InputSpec",
    "MapValue",
    "OrtOutput",
    "RunInput",
    "RunOutput",
    "RunValue",
    "bind_inputs",
    "check_type",
    "contiguous",
    "describe_value",
    "host_feeds",
    "input_specs",
    "same_memory",
]

RunInput = (
    Tensor
    | npt.ArrayLike
    | SupportsDLPack
    | SupportsCudaArrayInterface
    | Sequence[Tensor | npt.ArrayLike]
    | None
)
"""A value for a model input: a tensor, an array(-like), another library's tensor, a list of
them for a sequence input, or None for an absent optional input."""

if TYPE_CHECKING:
    # Any element type, said without Any (numpy's scalar types are generic in their Python
    # item type; not subscriptable at run time).
    HostArray: TypeAlias = np.ndarray[tuple[int, ...], np.dtype[np.generic[object]]]
else:
    HostArray = np.ndarray
"""A numpy array of any element type (an output of onnxruntime's ``run`` form)."""

MapValue = dict[int | str, int | float | str]
"""A map output, as onnxruntime gives it (``ZipMap``'s class -> probability, for one)."""

RunOutput = Tensor | list[Tensor] | list[MapValue] | MapValue | None
"""A model output from ``Session.run(inputs)``: a tensor, a sequence (a list of host tensors,
or of maps), a map, or None for an absent optional."""

OrtOutput = HostArray | list[HostArray] | list[MapValue] | MapValue | None
"""A model output from ``Session.run(output_names, input_feed)``: as ``RunOutput``, with numpy
arrays for tensors (as onnxruntime's ``InferenceSession.run``)."""

InputSpec = tuple[str, np.dtype[Any] | None, tuple[Any, ...] | None, ValueInfo]
"""A model input as a run checks it: name, dtype, shape and the full `ValueInfo`."""


@dataclass
class RunValue:
    """A value of one run: the tensor, and where its producer's work stands.

    Values that are not tensors (sequences, optionals, maps) have ``tensor=None`` and
    live on the host, in ``host`` (an absent optional is ``host=None``).
    """

    tensor: Tensor | None
    ready: Notification | None = None  # None: complete
    stream: SyncStream | None = None
    host: Any = None


def describe_value(value: object) -> str:
    """A short description of a run's argument for an error message: an array as its dtype and
    shape, a mapping by its keys, a list by its length (never an array's data)."""
    if isinstance(value, np.ndarray):
        return f"ndarray {value.dtype}{list(value.shape)}"
    if isinstance(value, Mapping):
        keys = [k if isinstance(k, str) else type(k).__name__ for k in list(value)[:8]]
        return f"{type(value).__name__} with keys {keys}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)} item(s)"
    return describe(value)


def input_specs(graph: GraphView) -> tuple[InputSpec, ...]:
    """The graph's inputs as runs check them."""
    return tuple((i.name, i.dtype, i.shape, i) for i in graph.inputs)


def same_memory(a: MemoryDevice, b: MemoryDevice) -> bool:
    """True when a reader in ``b`` reads a value in ``a`` without a copy."""
    # A CPU reader reads any host-accessible memory (host RAM, pinned memory) in place.
    return a == b or (b.device_type is DeviceType.CPU and a.is_host_accessible)


def contiguous(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``array`` in C order, shape kept (``np.ascontiguousarray`` turns 0-d into 1-d)."""
    if array.flags.c_contiguous:
        return array
    return np.ascontiguousarray(array).reshape(array.shape)


def host_feeds(
    specs: tuple[InputSpec, ...], inputs: Mapping[str, RunInput]
) -> dict[str, npt.NDArray[Any]] | None:
    """``inputs`` as host arrays when every one is a host tensor of the expected dtype and
    shape (onnxruntime takes them as they are), else None: `bind_inputs` then binds
    them or raises the precise error."""
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
            return None
        feeds[name] = given
    return feeds


def bind_inputs(
    specs: tuple[InputSpec, ...],
    inputs: Mapping[str, RunInput],
    ready: Notification | None,
    stream: SyncStream | None,
    scope: Scope | None = None,
) -> dict[str, RunValue]:
    """The model inputs as run values, checked against the graph's inputs; tensors given
    with a caller's ``stream`` are ready once ``ready`` (recorded on it) is.

    Raises:
        InvalidArgument: an input is missing or unknown, has the wrong dtype or shape, was
            freed, or is device memory of another environment (``scope`` is the session's).
        ClosedError: an input is device memory of a closed environment.
    """
    if not isinstance(inputs, Mapping):
        raise InvalidArgument(
            f"run: inputs must map input names to arrays or tensors, got {type(inputs).__name__}"
        )
    if len(inputs) != len(specs) or any(spec[0] not in inputs for spec in specs):
        names = [spec[0] for spec in specs]
        unknown = sorted(set(inputs) - set(names), key=str)
        if unknown:
            raise InvalidArgument(
                f"run: unknown input name(s) {unknown}; the model's inputs are {names}"
            )
        # As onnxruntime: an input of optional type may be left out (it is None).
        missing = [s[0] for s in specs if s[0] not in inputs and s[3].kind != "optional"]
        if missing:
            raise InvalidArgument(f"run: missing input {missing[0]!r} (model inputs: {names})")
    values: dict[str, RunValue] = {}
    for name, want, shape, info in specs:
        given = inputs.get(name)
        if info.kind not in ("tensor", "unknown"):
            values[name] = RunValue(None, host=_host_input(name, given, info))
            continue
        if isinstance(given, Tensor):
            tensor = given
            if tensor.buffer.freed:
                raise InvalidArgument(f"run: input {name!r}: {tensor.buffer!r} was freed")
            if scope is not None and tensor.buffer.allocator is not None:
                check_owner(tensor, scope, f"run: input {name!r}")
            value = RunValue(tensor, ready, stream if ready is not None else None)
        else:
            tensor = _host_tensor(given, want)
            value = RunValue(tensor)
        check_type(f"run: input {name!r}", tensor, want, shape)
        values[name] = value
    return values


def check_type(
    what: str, tensor: Tensor, want: np.dtype[Any] | None, shape: tuple[Any, ...] | None
) -> None:
    """Raise `InvalidArgument` naming ``what`` unless ``tensor`` has the model's
    dtype ``want`` and fits its ``shape`` (symbolic dims match any size; None: unknown)."""
    if want is not None and tensor.dtype != want:
        raise InvalidArgument(f"{what} has dtype {tensor.dtype}, the model expects {want}")
    if shape is not None and (
        len(shape) != len(tensor.shape)
        or any(isinstance(d, int) and d != n for d, n in zip(shape, tensor.shape))
    ):
        raise InvalidArgument(f"{what} has shape {tensor.shape}, the model expects {list(shape)}")


def _host_tensor(given: Any, want: np.dtype[Any] | None) -> Tensor:
    """A host tensor of the array-like ``given`` (an empty one of its dtype when that is not
    ``want``: the caller reports the dtype)."""
    array = np.asarray(given)
    if array.dtype.kind in "USO" and (want is None or want.hasobject):
        return object_tensor(array.astype(object, copy=False))
    if want is not None and array.dtype != want:
        return Tensor.from_numpy(np.empty(0, array.dtype))
    return Tensor.from_numpy(contiguous(array))


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
        if value.buffer.freed:
            raise InvalidArgument(f"run: input {name!r}: {value.buffer!r} was freed")
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
        return object_tensor(array.astype(object, copy=False))
    return Tensor.from_numpy(contiguous(array))
