"""Making a session: ``create_session`` checks the options, the devices and the model,
creates one EP per factory, and has the new `Session` prepare its plan."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from .._base.errors import EpError, InvalidArgument
from .._base.progress import wants_bar
from .._base.types import HOST_EP_NAME
from .._base.validate import check_int, check_options, describe
from .._graph.graph import GraphView
from .._graph.ort_compat import check_opsets
from .._plugin.device import EpDevice
from .._plugin.ep import Ep, bind_ep
from .cpu_fallback import load_whole
from .external_data import check_external_data
from .session import Session

if TYPE_CHECKING:
    from onnx import ModelProto

    from .host import SessionHost

__all__ = ["create_session"]

_OPTION_KEYS = (
    "ep_options",
    "external_data_dir",
    "intra_op_num_threads",
    "inter_op_num_threads",
    "progress",
)


async def create_session(
    env: SessionHost,
    model: str | os.PathLike[str] | bytes | ModelProto,
    ep_devices: Sequence[EpDevice] | None = None,
    options: Mapping[str, Any] | None = None,
) -> Session:
    """Load, partition and compile ``model`` for the EPs of ``ep_devices`` (priority order).

    ``model`` is a path, the model's ``bytes`` or an ``onnx.ModelProto``. ``ep_devices``
    are grouped by factory, in order of first appearance; each group gets one EP from
    ``factory.create_ep``. The host device needs no EP: what no EP claims runs on
    onnxruntime's CPU execution provider. ``options``: ``ep_options`` (EP name -> option
    mapping for ``create_ep``), ``intra_op_num_threads`` / ``inter_op_num_threads`` for the
    CPU fallback, ``external_data_dir`` (the folder of the external data of a model given as
    bytes or a proto, which has none of its own) and ``progress`` (a tqdm bar over the upload,
    compile and load stages; None, the default: when standard error is a terminal).

    The model is checked before anything runs: its ``ai.onnx`` opset (one the installed
    onnxruntime knows), its initializers (element types, dimensions) and every external
    data reference (ORT's rules: inside the model's folder, in range, the file exists).
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
    graph = await anyio.to_thread.run_sync(_checked_view, model, opts.get("external_data_dir"))
    devices = [d for devs in groups for d in devs]
    # The host device too: the environment then closes a session that only the CPU runs.
    tracked = (*devices, *env.ep_devices(ep_name=HOST_EP_NAME))
    eps: list[Ep] = []
    try:
        for devs in groups:
            eps.append(_create_ep(env, devs, ep_options))
        if len({ep.name for ep in eps}) != len(eps):
            raise InvalidArgument(f"create_session: two EPs share a name: {[e.name for e in eps]}")
        session = Session._create(env, graph, eps, tracked)
        env.track_session(session, tracked, open=True)
        try:
            await session._prepare(opts, preload)
        except BaseException:
            env.track_session(session, tracked, open=False)
            raise
    except BaseException:
        for ep in eps:
            ep.release()
        raise
    return session


def _checked_view(model: Any, external_data_dir: str | os.PathLike[str] | None) -> GraphView:
    """The graph view of ``model``, checked as ``create_session`` promises (a worker thread
    runs this: it parses the model and stats files)."""
    graph = GraphView.from_model(model, external_data_dir=external_data_dir)
    check_opsets(graph.model, what="create_session: the model")
    external = [i.proto for i in graph.initializers.values() if i.external]
    if external:
        if graph.external_data_dir is None:
            location = next((e.value for e in external[0].external_data if e.key == "location"), "")
            raise InvalidArgument(
                f"create_session: initializer {external[0].name!r} keeps its data in the "
                f"external file {location!r}, but the model was given as "
                f"{type(model).__name__}, which has no folder to find it in; pass the model's "
                "path, or options={'external_data_dir': <the folder>}"
            )
        check_external_data(external, os.fspath(graph.external_data_dir))
    return graph


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
    folder = opts.get("external_data_dir")
    if folder is not None and not isinstance(folder, (str, os.PathLike)):
        raise InvalidArgument(
            f"create_session: external_data_dir must be a folder path, got {describe(folder)}"
        )
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


def _device_groups(env: SessionHost, ep_devices: Sequence[EpDevice] | None) -> list[list[EpDevice]]:
    """``ep_devices`` grouped by factory, in order of first appearance (the host's left
    out: the CPU fallback serves it)."""
    groups: dict[int, list[EpDevice]] = {}
    for dev in ep_devices or ():
        if not isinstance(dev, EpDevice):
            raise InvalidArgument(
                f"create_session: ep_devices must be EpDevice objects, got {dev!r}"
            )
        env.check_device(dev)  # raises for a device of another environment
        if dev.factory.name == HOST_EP_NAME:
            continue
        groups.setdefault(id(dev.factory), []).append(dev)
    return list(groups.values())


def _create_ep(env: SessionHost, devs: list[EpDevice], ep_options: Mapping[str, Any]) -> Ep:
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
    bind_ep(ep, env.environment, devs)
    return ep
