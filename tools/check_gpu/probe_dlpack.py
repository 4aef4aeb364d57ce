"""``python -m check_gpu.probe_dlpack``: exchange a CUDA tensor with CuPy and PyTorch.

An aioep tensor on the first GPU, filled from numpy, goes to each installed library through
DLPack (``from_dlpack``) and, for CuPy, the CUDA array interface: the library's array must
share the tensor's memory (zero-copy) and hold its values. One JSON line: per library,
``status`` (``ok``, ``mismatch``, ``failed``, ``not installed``, ``installed without CUDA``)
and what was checked. It needs the real driver: their CUDA runtimes do not run on the
emulator.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from typing import Any

import numpy as np

import aioep

__all__ = ["exchange", "main"]


def _with(name: str, lib: Any, t: aioep.Tensor, data: np.ndarray[Any, Any]) -> dict[str, Any]:
    """Import ``t`` into the library ``lib`` and check what it sees."""
    entry: dict[str, Any] = {"version": getattr(lib, "__version__", None)}
    try:
        if name == "cupy":
            x = lib.from_dlpack(t)
            ptr, values = x.data.ptr, x.get()
            y = lib.asarray(t)  # the CUDA array interface
            entry["cai_zero_copy"] = y.data.ptr == t.data_ptr
            del y
        else:
            if not lib.cuda.is_available():
                return {"status": "installed without CUDA", **entry}
            x = lib.from_dlpack(t)
            ptr, values = x.data_ptr(), x.cpu().numpy()
        entry["zero_copy"] = ptr == t.data_ptr
        entry["values_equal"] = bool(np.array_equal(values, data))
        ok = entry["zero_copy"] and entry["values_equal"]
        entry["status"] = "ok" if ok else "mismatch"
        del x
    except Exception as exc:
        entry["status"] = "failed"
        entry["error"] = f"{type(exc).__name__}: {exc}"
    return entry


async def exchange() -> dict[str, Any]:
    """Each library's result (see the module docstring)."""
    out: dict[str, Any] = {}
    async with aioep.Environment(backends=["cuda"]) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        data = np.arange(1 << 20, dtype=np.float32)
        t = env.empty(data.shape, data.dtype, gpu.memory_info(aioep.MemoryType.DEFAULT))
        await env.copy_tensors([data], [t])
        for name in ("cupy", "torch"):
            try:
                lib = importlib.import_module(name)
            except ImportError:
                out[name] = {"status": "not installed"}
                continue
            out[name] = _with(name, lib, t, data)
        del t
    return out


def main() -> None:
    """Print `exchange`'s answer as one JSON line."""
    print(json.dumps(asyncio.run(exchange())))


if __name__ == "__main__":
    main()
