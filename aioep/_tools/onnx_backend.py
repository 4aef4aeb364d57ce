"""ONNX's backend interface (``onnx.backend.base.Backend``) over aioep sessions.

ONNX defines a small synchronous interface (``prepare``, ``run_model``, ``run_node``,
``supports_device``) and a conformance runner built on it,
``onnx.backend.test.BackendTest``. `AioepBackend` implements that interface
with `Session` objects, so the runner tests aioep exactly as it tests
onnxruntime. The interface is blocking: each call runs aioep's async API to
completion on a short-lived event loop in the calling thread, which is right for a
test runner and wrong for a server (use ``await env.create_session(...)`` and
``await session.run(...)`` there). Calling it from inside a running event loop is
refused.

Each backend class owns one `Environment`, opened on first use and
closed by `AioepBackend.close` (or at interpreter exit).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import anyio
import numpy as np
import numpy.typing as npt

from .._base.errors import ClosedError, EpError, InvalidArgument, NotImplementedByEp
from .._environment.environment import Environment
from .._plugin.device import EpDevice
from .._plugin.tensor import Tensor
from .._session.session import Session

try:
    import onnx
    from onnx.backend.base import Backend, BackendRep, namedtupledict
except ImportError as exc:  # pragma: no cover - depends on the install
    raise NotImplementedByEp(
        "aioep.onnx_backend needs the 'onnx' package: pip install 'aioep[onnx]'"
    ) from exc

__all__ = ["AioepBackend", "AioepBackendRep", "DeviceChoice"]

DeviceChoice = Sequence[str] | Callable[[Environment], Sequence[EpDevice]] | None
"""Which EP devices a session gets: EP names (every device of each, in that order), a
function of the environment that returns `EpDevice` objects, or None for
none (the CPU fallback runs everything)."""

SIM_EP_NAME = "SimExecutionProvider"
_TOLERANCE_KEYS = frozenset({"rtol", "atol"})  # what ONNX's runner passes through **kwargs


def _default_devices(env: Environment) -> list[EpDevice]:
    """The sim device where the sim backend is installed, else none (CPU fallback only)."""
    return env.ep_devices(ep_name=SIM_EP_NAME)[:1]


def _run_sync(fn: Callable[..., Any], *args: Any) -> Any:
    """Run the async function ``fn(*args)`` to completion on a fresh event loop."""
    library = _running_loop()
    if library is not None:
        raise EpError(
            "aioep.onnx_backend blocks until the work is done and cannot run inside an event "
            f"loop ({library}); in async code use 'await env.create_session(...)' and "
            "'await session.run(...)'"
        )
    return anyio.run(fn, *args)


def _running_loop() -> str | None:
    """The async library running in this thread, if any."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return "asyncio"
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            pass
        else:
            return "trio"
    return None


class AioepBackendRep(BackendRep):
    """A prepared model: ``run(inputs)`` returns the outputs in graph order.

    ``inputs`` is a sequence of arrays in the order of the model's inputs
    (initializers excluded), a mapping of input name to array, or one array for a
    model with one input. Tensor outputs come back as numpy arrays, sequence outputs
    as lists, absent optional outputs as None.
    """

    def __init__(self, backend: type[AioepBackend], session: Session) -> None:
        self._backend = backend
        self._session: Session | None = session
        self._finalizer = weakref.finalize(self, backend._close_later, session)
        backend._reps.add(self)

    @property
    def session(self) -> Session:
        """The aioep session behind this model."""
        if self._session is None:
            raise ClosedError(f"{self!r} is closed")
        return self._session

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Run the model once (blocking) and return its outputs as a named tuple."""
        unknown = sorted(set(kwargs) - _TOLERANCE_KEYS)
        if unknown:
            raise InvalidArgument(f"AioepBackendRep.run: unknown keyword argument(s) {unknown}")
        session = self.session
        feeds = _feeds(session, inputs)
        outputs = _run_sync(self._backend._run, session, feeds)
        names = session.output_names
        values = [_to_numpy(outputs[name]) for name in names]
        result: tuple[Any, ...] = namedtupledict("Outputs", names)(*values)
        return result

    def close(self) -> None:
        """Close the session now (it is also closed after the object is garbage collected)."""
        if self._session is not None:
            self._finalizer.detach()
            session, self._session = self._session, None
            _run_sync(session.aclose)

    def __repr__(self) -> str:
        return f"<AioepBackendRep {self._session!r}>"


class AioepBackend(Backend):
    """``onnx.backend.base.Backend`` over aioep sessions.

    Configure a backend with [`configure`][aioep.onnx_backend.AioepBackend.configure]; the class
    itself uses the sim device where the sim backend is installed, else only the CPU fallback.
    ``device`` (ONNX's device string) must be ``"CPU"``: the EP devices come from the configuration,
    with onnxruntime's CPU EP running what they do not claim.
    """

    ep_devices: ClassVar[DeviceChoice | str] = "default"
    environment_options: ClassVar[Mapping[str, Any]] = {"backends": ["sim"]}
    session_options: ClassVar[Mapping[str, Any]] = {}

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _envs: ClassVar[dict[type[AioepBackend], Environment]] = {}
    _closing: ClassVar[list[tuple[type[AioepBackend], Session]]] = []
    _reps: ClassVar[weakref.WeakSet[AioepBackendRep]] = weakref.WeakSet()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._reps = weakref.WeakSet()  # each backend class closes its own

    @classmethod
    def configure(
        cls,
        *,
        ep_devices: DeviceChoice | str = "default",
        environment_options: Mapping[str, Any] | None = None,
        session_options: Mapping[str, Any] | None = None,
        name: str = "ConfiguredAioepBackend",
    ) -> type[AioepBackend]:
        """A backend class with its own environment and device choice.

        Args:
            ep_devices: EP names, a function of the environment returning EP devices,
                None for the CPU fallback only, or ``"default"`` (the sim device where
                installed).
            environment_options: keyword arguments for [`Environment`][aioep.Environment]
                (default: only the sim backend is loaded).
            session_options: ``options`` for [`create_session`][aioep.Environment.create_session].
        """
        if isinstance(ep_devices, str) and ep_devices != "default":
            raise InvalidArgument(
                f"ep_devices must be a list of EP names, a function, None or 'default', "
                f"got {ep_devices!r}"
            )
        attrs = {
            "ep_devices": ep_devices,
            "environment_options": dict(
                cls.environment_options if environment_options is None else environment_options
            ),
            "session_options": dict(session_options or {}),
            "__module__": cls.__module__,
        }
        return type(name, (cls,), attrs)

    # -- the environment ---------------------------------------------------------------
    @classmethod
    def environment(cls) -> Environment:
        """This backend's environment (opened on first use)."""
        with cls._lock:
            env = cls._envs.get(cls)
            if env is None:
                env = Environment(**cls.environment_options)
                _run_sync(env.__aenter__)
                cls._envs[cls] = env
            return env

    @classmethod
    def close(cls) -> None:
        """Close this backend's sessions and environment (a later call opens a new one)."""
        for rep in list(cls._reps):
            rep.close()
        cls._drain()
        with cls._lock:
            env = cls._envs.pop(cls, None)
        if env is not None:
            _run_sync(env.aclose)

    @classmethod
    def _close_later(cls, session: Session) -> None:
        # A finalizer: it may run in any thread, even inside an event loop, so only queue.
        with cls._lock:
            cls._closing.append((cls, session))

    @classmethod
    def _drain(cls) -> None:
        with cls._lock:
            mine = [s for owner, s in cls._closing if owner is cls]
            cls._closing[:] = [(o, s) for o, s in cls._closing if o is not cls]
        for session in mine:
            _run_sync(session.aclose)

    @classmethod
    def _select(cls, env: Environment, choice: DeviceChoice | str) -> list[EpDevice]:
        if choice == "default":
            return _default_devices(env)
        if choice is None:
            return []
        if callable(choice):
            devices = list(choice(env))
        elif isinstance(choice, str) or not isinstance(choice, Iterable):
            raise InvalidArgument(
                f"ep_devices must be a list of EP names, a function, None or 'default', "
                f"got {choice!r}"
            )
        else:
            devices = []
            for name in choice:
                found = env.ep_devices(ep_name=name)
                if not found:
                    known = sorted({d.ep_name for d in env.ep_devices()})
                    raise InvalidArgument(
                        f"no EP devices named {name!r} in {env!r} (it offers {known})"
                    )
                devices.extend(found)
        bad = [d for d in devices if not isinstance(d, EpDevice)]
        if bad:
            raise InvalidArgument(f"ep_devices: {bad[0]!r} is not an aioep.EpDevice")
        return devices

    @staticmethod
    async def _run(session: Session, feeds: dict[str, Any]) -> dict[str, Any]:
        return await session.run(feeds, output_location="host")

    # -- onnx.backend.base.Backend -----------------------------------------------------
    @classmethod
    def is_compatible(cls, model: Any, device: str = "CPU", **kwargs: Any) -> bool:
        """True: whatever the EPs do not claim runs on onnxruntime's CPU EP."""
        return cls.supports_device(device)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        """Only ``"CPU"``: the EP devices come from the configuration, not ONNX's string."""
        return device.split(":")[0].upper() == "CPU"

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> AioepBackendRep:
        """Create a session for ``model`` (an ``onnx.ModelProto``, its bytes or a path).

        ``ep_devices`` (a `DeviceChoice`) overrides the configured devices for
        this model; ONNX's runner may also pass ``rtol``/``atol``, which are ignored.

        Raises:
            InvalidArgument: an unknown keyword argument or device.
        """
        if not cls.supports_device(device):
            raise InvalidArgument(f"{cls.__name__}: device {device!r} is not supported; use 'CPU'")
        choice = kwargs.pop("ep_devices", cls.ep_devices)
        unknown = sorted(set(kwargs) - _TOLERANCE_KEYS)
        if unknown:
            raise InvalidArgument(f"{cls.__name__}.prepare: unknown keyword argument(s) {unknown}")
        if isinstance(model, (bytes, bytearray)):
            model = onnx.load_from_string(bytes(model))
        elif not isinstance(model, (str, os.PathLike, onnx.ModelProto)):
            raise InvalidArgument(
                f"{cls.__name__}.prepare: expected an onnx.ModelProto, bytes or a path, "
                f"got {type(model).__name__}"
            )
        cls._drain()
        env = cls.environment()
        devices = cls._select(env, choice)
        session = _run_sync(_create, env, model, devices, dict(cls.session_options))
        return AioepBackendRep(cls, session)

    @classmethod
    def run_model(
        cls, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any
    ) -> tuple[Any, ...]:
        """Prepare ``model``, run it once on ``inputs`` and close the session."""
        rep = cls.prepare(model, device, **kwargs)
        try:
            return rep.run(inputs)
        finally:
            rep.close()

    @classmethod
    def run_node(
        cls,
        node: Any,
        inputs: Any,
        device: str = "CPU",
        outputs_info: Sequence[tuple[Any, tuple[int, ...]]] | None = None,
        **kwargs: Any,
    ) -> tuple[Any, ...]:
        """Run one ``onnx.NodeProto`` on ``inputs`` (arrays in the node's input order).

        ``outputs_info`` (dtype, shape) per output types the outputs where shape
        inference cannot; ``opset_version`` picks the ``ai.onnx`` opset (default:
        the newest the installed onnx and onnxruntime share).
        """
        opset = kwargs.pop("opset_version", None)
        model = _node_model(node, inputs, outputs_info, opset)
        return cls.run_model(model, list(_node_inputs(node, inputs)), device, **kwargs)


async def _create(
    env: Environment, model: Any, devices: list[EpDevice], options: dict[str, Any]
) -> Session:
    session: Session = await env.create_session(model, ep_devices=devices, options=options or None)
    return session


def _feeds(session: Session, inputs: Any) -> dict[str, Any]:
    names = session.input_names
    if isinstance(inputs, Mapping):
        return dict(inputs)
    if isinstance(inputs, (np.ndarray, Tensor)):
        inputs = [inputs]
    if not isinstance(inputs, (list, tuple)):
        raise InvalidArgument(
            f"run: inputs must be a list of arrays, a mapping or one array, got "
            f"{type(inputs).__name__}"
        )
    if len(inputs) != len(names):
        raise InvalidArgument(
            f"run: {len(inputs)} input(s) given, the model takes {len(names)}: {list(names)}"
        )
    return dict(zip(names, inputs))


def _to_numpy(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.numpy()
    if isinstance(value, list):
        return [_to_numpy(v) for v in value]
    return value


def _node_inputs(node: Any, inputs: Any) -> list[Any]:
    values = list(inputs.values()) if isinstance(inputs, Mapping) else list(inputs)
    return values[: len([n for n in node.input if n])]


def _value_info_for(name: str, value: Any) -> Any:
    h = onnx.helper
    if isinstance(value, list):
        if not value:
            raise InvalidArgument(
                f"run_node: input {name!r} is an empty sequence: its type is unknown"
            )
        elem = _value_info_for(name, value[0])
        return h.make_value_info(name, h.make_sequence_type_proto(elem.type))
    array = np.asarray(value)
    elem_type = onnx.helper.np_dtype_to_tensor_dtype(_onnx_dtype(array))
    return h.make_tensor_value_info(name, elem_type, list(array.shape))


def _onnx_dtype(array: npt.NDArray[Any]) -> np.dtype[Any]:
    if array.dtype.kind in "OUS":
        return np.dtype(object)
    return array.dtype


def _node_model(
    node: Any,
    inputs: Any,
    outputs_info: Sequence[tuple[Any, tuple[int, ...]]] | None,
    opset: int | None,
) -> Any:
    from .._graph.ort_compat import ort_limits

    h = onnx.helper
    values = _node_inputs(node, inputs)
    names = [n for n in node.input if n]
    graph_inputs = [_value_info_for(n, v) for n, v in zip(names, values)]
    graph_outputs = []
    for i, out in enumerate(n for n in node.output if n):
        if outputs_info is not None and i < len(outputs_info):
            dtype, shape = outputs_info[i]
            elem = h.np_dtype_to_tensor_dtype(np.dtype(dtype))
            graph_outputs.append(h.make_tensor_value_info(out, elem, list(shape)))
        else:
            graph_outputs.append(h.make_empty_tensor_value_info(out))
    if opset is None:
        limits = ort_limits()
        opset = onnx.defs.onnx_opset_version()
        if limits is not None:
            opset = min(opset, limits.max_opset)
    graph = h.make_graph([node], "aioep_run_node", graph_inputs, graph_outputs)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", int(opset))])


def _close_all() -> None:
    """At interpreter exit: close what the backends still hold, without starting threads."""
    for cls in list(AioepBackend._envs):
        try:
            for rep in list(cls._reps):
                rep.close()
            cls._drain()
            env = AioepBackend._envs.pop(cls)
            env.close()
        except Exception:  # pragma: no cover - best effort at interpreter exit
            pass


atexit.register(_close_all)
