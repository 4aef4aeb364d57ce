"""The CPU fallback: onnxruntime's CPU execution provider over the parts of a model that no
EP claimed, loaded when a session is created and called from its worker threads."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._base.errors import DeviceError, EpError, import_optional
from .._graph.onnx_models import whole_model_source
from .._graph.ort_compat import ir_version_for_ort
from .._plugin.tensor import Tensor, checked_host_tensor, object_tensor
from .values import contiguous

if TYPE_CHECKING:
    from .._graph.graph import GraphView
    from .._plugin.ep import MetaDef

__all__ = [
    "CpuStep",
    "from_ort",
    "host_output",
    "load_parts",
    "load_whole",
    "run_ort",
    "to_ort",
    "use_whole",
]


class CpuPart(Protocol):
    """The nodes of a CPU step and their interface (a session plan's partition)."""

    @property
    def nodes(self) -> tuple[int, ...]: ...
    @property
    def meta_def(self) -> MetaDef: ...


class CpuStep(Protocol):
    """What loading gives an onnxruntime session to: a step of the session plan
    (``aioep._session.plan.PlanStep``) that the CPU fallback runs."""

    inputs: tuple[str, ...]
    ort_session: Any
    ort_outputs: tuple[str, ...]

    @property
    def partition(self) -> CpuPart: ...


def _ort() -> Any:
    return import_optional("onnxruntime", "the CPU fallback")


def _session_options(opts: Mapping[str, Any]) -> Any:
    so = _ort().SessionOptions()
    for key in ("intra_op_num_threads", "inter_op_num_threads"):
        if opts.get(key) is not None:
            setattr(so, key, int(opts[key]))
    folder = opts.get("external_data_dir")
    if folder is not None:  # where a model given as bytes or a proto keeps its external data
        so.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", os.fspath(folder)
        )
    return so


def load_whole(model: Any, opts: Mapping[str, Any]) -> Any:
    """An onnxruntime session for a whole model given as a path or a proto; raises on any
    trouble."""
    return _ort().InferenceSession(
        whole_model_source(model), _session_options(opts), providers=["CPUExecutionProvider"]
    )


def use_whole(graph: GraphView, step: CpuStep, session: Any) -> None:
    """Make ``session`` (from `load_whole`) run ``step``, the whole graph.

    Raises:
        EpError: the session lacks one of the step's outputs.
    """
    outputs = tuple(o.name for o in session.get_outputs())
    if any(o not in outputs for o in step.partition.meta_def.outputs):
        raise EpError("the whole-model session lacks an output")
    step.ort_session = session
    step.ort_outputs = outputs
    step.inputs = tuple(i.name for i in graph.inputs)


def load_parts(
    graph: GraphView, steps: Sequence[CpuStep], opts: Mapping[str, Any], whole: bool
) -> None:
    """Give every CPU step its onnxruntime session (``whole``: the one step is the whole
    graph, loaded from the model itself); runs in a worker thread.

    Raises:
        EpError: onnxruntime could not load a part, or a part lacks an output.
    """
    so = _session_options(opts)
    if len(steps) > 1:
        # Each part has its own intra-op thread pool, and a pool spins after its work in
        # case more comes: the next part's pool would compete with it for the cores (and
        # a spinning pool takes ~30 ms to shut down). Parts run one after another: no spin.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if whole and ir_version_for_ort(graph.model) != graph.model.ir_version:
        whole = False  # hand onnxruntime a copy stamped with an IR version it loads
    if len(steps) == 1:
        _load_part(graph, steps[0], so, whole)
        return
    # Parts between EP partitions are many small sessions; onnxruntime builds them with the
    # GIL released, so they load side by side.
    workers = min(len(steps), os.cpu_count() or 1, 8)
    with ThreadPoolExecutor(workers, thread_name_prefix="aioep-ort-load") as pool:
        for fut in [pool.submit(_load_part, graph, step, so, whole) for step in steps]:
            fut.result()


def _load_part(graph: GraphView, step: CpuStep, so: Any, whole: bool) -> None:
    meta = step.partition.meta_def
    if whole:
        source = whole_model_source(graph.model_path or graph.model)
        step.inputs = tuple(i.name for i in graph.inputs)
    else:
        sub = graph.extract_model(step.partition.nodes, meta.inputs, meta.outputs)
        source = sub.SerializeToString()
    try:
        sess = _ort().InferenceSession(source, so, providers=["CPUExecutionProvider"])
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


def run_ort(
    session: Any, feeds: dict[str, Any], names: list[str] | None = None, run_options: Any = None
) -> list[Any]:
    """``session.run(names, feeds, run_options)``, its errors as `DeviceError` (a run
    stopped by ``run_options.terminate`` as `EpError`)."""
    try:
        return list(session.run(names, feeds, run_options))
    except Exception as exc:
        if run_options is not None and run_options.terminate:
            raise EpError(
                "run: run_options.terminate is set: onnxruntime stopped the run "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        raise DeviceError(f"onnxruntime CPU fallback failed: {type(exc).__name__}: {exc}") from exc


def from_ort(value: Any) -> Any:
    """An onnxruntime result as a session output: arrays become host tensors (string
    tensors included), sequences lists of them; None (an absent optional) and maps stay."""
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return object_tensor(value)
        return Tensor.from_numpy(contiguous(value))
    if isinstance(value, list):
        return [from_ort(v) for v in value]
    return value


def host_output(value: Any) -> Any:
    """`from_ort`, with the common case first: onnxruntime's tensor outputs are new,
    C-contiguous numpy arrays of plain values, wrapped as they are (no check repeated)."""
    if type(value) is np.ndarray:
        flags = value.flags
        if flags.c_contiguous and not value.dtype.hasobject:
            return checked_host_tensor(value, readonly=not flags.writeable)
    return from_ort(value)


def to_ort(value: Any) -> Any:
    """A host value as onnxruntime takes it: tensors as arrays, sequences as lists."""
    if isinstance(value, Tensor):
        return value.numpy()
    if isinstance(value, list):
        return [to_ort(v) for v in value]
    return value
