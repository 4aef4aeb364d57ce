"""The WebGPU plugin EP in tests: whether it can run here, a child process to run ORT code
in, and a counter of the ort backend's copies (importable as ``_webgpu``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from functools import cache
from typing import Any

import pytest

PROBE = """
import numpy as np, onnxruntime as ort, onnxruntime_ep_webgpu as w
ort.register_execution_provider_library("probe", w.get_library_path())
dev = next(d for d in ort.get_ep_devices() if d.ep_name == w.get_ep_name())
v = ort.OrtValue.ortvalue_from_shape_and_type((4,), np.uint8,
        memory_info=dev.memory_info(ort.OrtDeviceMemoryType.DEFAULT))
h = np.zeros(4, np.uint8)
ort.copy_tensors([ort.OrtValue.ortvalue_from_numpy(np.arange(4, dtype=np.uint8))], [v], None)
ort.copy_tensors([v], [ort.OrtValue.ortvalue_from_numpy(h)], None)
assert list(h) == [0, 1, 2, 3]
"""


def run_child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    child_env = {**os.environ, "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER": "1", **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env,
    )


@cache
def webgpu_skip_reason() -> str | None:
    if importlib.util.find_spec("onnxruntime_ep_webgpu") is None:
        return "onnxruntime-ep-webgpu is not installed (pip install -e 'backends/ort[webgpu]')"
    # In a child: with no usable adapter the first device allocation aborts the process.
    proc = run_child(PROBE)
    if proc.returncode != 0:
        return (
            f"the WebGPU EP has no usable adapter (probe exit code {proc.returncode}); install "
            "Mesa 25 lavapipe with .ci/install-webgpu.sh"
        )
    return None


class OrtCopies:
    """Counts the onnxruntime.copy_tensors calls the ort backend makes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from aioep_ort import _transfer

        self.calls = 0
        real = _transfer._ort_copy

        def counting(src: list[Any], dst: list[Any], lock: Any) -> None:
            self.calls += 1
            real(src, dst, lock)

        monkeypatch.setattr(_transfer, "_ort_copy", counting)
