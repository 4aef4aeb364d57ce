"""Plain onnxruntime on its CPU EP: the baseline that session tests compare aioep against."""

from __future__ import annotations

from typing import Any

import onnx
import onnxruntime as ort

BASELINE_IR_VERSION = 10
"""onnx stamps new models with its newest IR version (14 with onnx 1.23), which older
onnxruntime releases refuse; every onnxruntime aioep supports (>= 1.23) loads IR 10."""


def ort_baseline(model: Any, sess_options: Any = None) -> Any:
    """An ``onnxruntime.InferenceSession`` on the CPU EP for ``model``, IR version capped so
    that the installed onnxruntime loads it (aioep caps it the same way on its own)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.ir_version = min(copy.ir_version, BASELINE_IR_VERSION)
    return ort.InferenceSession(
        copy.SerializeToString(), sess_options, providers=["CPUExecutionProvider"]
    )


def ort_plugin_baseline(model: Any, ep_name: str) -> Any:
    """An ``onnxruntime.InferenceSession`` with the plugin EP ``ep_name`` selected, without
    aioep (its library registered with onnxruntime by an aioep environment opened first):
    tells the EP's own numerics (OpenVINO computes in bf16 on processors that have it) from
    aioep's."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.ir_version = min(copy.ir_version, BASELINE_IR_VERSION)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    devices = [d for d in ort.get_ep_devices() if d.ep_name == ep_name]
    assert devices, f"onnxruntime lists no {ep_name} device"
    so.add_provider_for_devices(devices, {})
    return ort.InferenceSession(copy.SerializeToString(), so)
