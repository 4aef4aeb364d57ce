"""``python -m check_gpu.probe_driver``: print what CUDA driver and GPUs this process sees.

One JSON line: aioep-cuda's `aioep_cuda.describe_driver` (versions, the driver library's
path, every GPU's name, UUID, compute capability and memory) and, where there is a GPU,
``load_error``: why the CUDA backend did not start in an environment (None when it did).
check-gpu runs it in a child of its own, with the environment of the tests (the emulated
driver's, with ``--emulator``).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["main", "probe"]


def probe() -> dict[str, Any]:
    """The driver's description, and whether the CUDA backend starts."""
    try:
        from aioep_cuda import describe_driver
    except ImportError as exc:
        return {"error": f"aioep-cuda is not installed ({exc})"}
    out = describe_driver()
    if out.get("devices"):
        import aioep

        try:
            env = aioep.Environment(backends=["cuda"]).open()
        except Exception as exc:
            out["load_error"] = f"{type(exc).__name__}: {exc}"
        else:
            try:
                out["load_error"] = env.load_errors.get("cuda")
                seen = env.ep_devices(ep_name="CUDAExecutionProvider")
                out["backend_devices"] = len(seen)
            finally:
                env.close()
    return out


def main() -> None:
    """Print `probe`'s answer as one JSON line."""
    print(json.dumps(probe()))


if __name__ == "__main__":
    main()
