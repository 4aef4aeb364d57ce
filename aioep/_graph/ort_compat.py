"""What the installed onnxruntime can load: its newest ONNX IR version and ``ai.onnx`` opset.

onnx stamps new models with its own newest IR version (14 with onnx 1.23), which an
older onnxruntime refuses even when the model uses nothing newer than what it knows.
Models that aioep hands to onnxruntime (extracted sub-models, the CPU fallback) carry
the source model's IR version capped to the installed onnxruntime's, and a model that
really needs more (an opset or IR feature the runtime predates) is refused with a clear
`InvalidArgument` instead of a loader error deep inside a session build.

The limits are found once per process by loading a one-node model into onnxruntime,
from the newest version onnx knows downwards; onnxruntime has no API that reports them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from .._base.errors import InvalidArgument

__all__ = ["OrtLimits", "check_opsets", "ir_version_for_ort", "ort_limits"]

_DEFAULT_DOMAINS = ("", "ai.onnx")
_OLDEST_IR = 3
_OLDEST_OPSET = 7  # onnxruntime's own floor for ai.onnx


@dataclass(frozen=True)
class OrtLimits:
    """The newest IR version and ``ai.onnx`` opset the installed onnxruntime loads."""

    version: str
    max_ir_version: int
    max_opset: int


def _loads(ort: Any, onnx: Any, ir_version: int, opset: int) -> bool:
    h = onnx.helper
    value = h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    out = h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = h.make_graph([h.make_node("Identity", ["x"], ["y"])], "probe", [value], [out])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = ir_version
    so = ort.SessionOptions()
    so.log_severity_level = 4  # the refusals are expected; keep them out of the log
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception:
        return False
    return True


@functools.cache
def ort_limits() -> OrtLimits | None:
    """The installed onnxruntime's limits, or None without onnx/onnxruntime (or when no
    probe model loads, so nothing is known to cap to)."""
    try:
        import onnx
        import onnxruntime as ort
    except ImportError:
        return None
    # Opset 7 needs IR 3; find the IR first with that old opset, then the opset under it.
    max_ir = next(
        (ir for ir in range(onnx.IR_VERSION, _OLDEST_IR - 1, -1) if _loads(ort, onnx, ir, 7)),
        None,
    )
    if max_ir is None:
        return None
    newest = onnx.defs.onnx_opset_version()
    max_opset = next(
        (op for op in range(newest, _OLDEST_OPSET - 1, -1) if _loads(ort, onnx, max_ir, op)),
        None,
    )
    if max_opset is None:
        return None
    return OrtLimits(str(ort.__version__), max_ir, max_opset)


def check_opsets(model: Any, *, what: str = "the model") -> None:
    """Refuse ``model`` (an ``onnx.ModelProto``) when it imports an ``ai.onnx`` opset newer than
    the installed onnxruntime supports (without onnxruntime: newer than onnx knows), whichever
    EP would run it: no EP can know what such an opset's operators mean.

    Raises:
        InvalidArgument: naming the opset and the newest one supported.
    """
    limits = ort_limits()
    if limits is not None:
        newest, who = limits.max_opset, f"the installed onnxruntime {limits.version}"
    else:
        import onnx

        newest, who = int(onnx.defs.onnx_opset_version()), f"onnx {onnx.__version__}"
    for entry in model.opset_import:
        if entry.domain in _DEFAULT_DOMAINS and entry.version > newest:
            raise InvalidArgument(
                f"{what} imports ai.onnx opset {entry.version}; {who} supports opsets up to "
                f"{newest}: upgrade onnxruntime or convert the model to an older opset"
            )


def ir_version_for_ort(model: Any, *, what: str = "the model") -> int:
    """The IR version to stamp on ``model`` (an ``onnx.ModelProto``) before onnxruntime loads it.

    That is the model's own IR version, capped to the installed onnxruntime's newest.

    Raises:
        InvalidArgument: the model imports an ``ai.onnx`` opset newer than onnxruntime
            supports, or its opsets need an IR version onnxruntime predates.
    """
    own = int(model.ir_version)
    limits = ort_limits()
    if limits is None:
        return own
    import onnx

    check_opsets(model, what=what)
    opsets = list(model.opset_import)
    try:
        needed = int(onnx.helper.find_min_ir_version_for(opsets, ignore_unknown=True))
    except Exception:  # an opset onnx itself does not know: onnxruntime will say more
        needed = 0
    if needed > limits.max_ir_version:
        raise InvalidArgument(
            f"{what} needs ONNX IR version {needed} for its opsets; the installed onnxruntime "
            f"{limits.version} loads IR versions up to {limits.max_ir_version}"
        )
    if own <= 0:  # unset: the oldest version its opsets allow would also do; use the newest
        return limits.max_ir_version
    return min(own, limits.max_ir_version)
