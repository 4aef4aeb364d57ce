"""Session creation figures: ``await env.create_session(model)`` vs onnxruntime's own.

For each model (default: ``light_densenet121`` from the onnx wheel; ``--all``: every
light model), the time to create a session, against ``onnxruntime.InferenceSession``
on the same model bytes (target: ratio <= 1.5x):

- ``cpu``: aioep with no EP devices (the CPU fallback runs the whole model) vs an
  ``InferenceSession`` on the CPU EP;
- ``sim``: aioep with the sim device (the sim claims Add/Mul/Relu/..., the rest is split
  into onnxruntime CPU parts between them) vs the same ``InferenceSession`` on the CPU EP;
- ``webgpu``: aioep with the WebGPU plugin EP through the ort backend vs an
  ``InferenceSession`` with the same plugin EP selected (only where a WebGPU adapter
  works; set ``ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1`` for a software one).

Rounds interleave the contenders; each figure is the median of ``--rounds`` creations
after one warm-up. Results go to ``benchmarks/results/session_create.json``.

Usage: ``python benchmarks/session_create.py [--all] [--rounds N] [--json PATH]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import onnx
import onnxruntime as ort

import aioep

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "session_create.json"
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def _bytes_for_ort(model: Any) -> bytes:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.ir_version = min(copy.ir_version, 10)  # every supported onnxruntime loads IR 10
    return copy.SerializeToString()


async def _measure(
    env: aioep.Environment, model: Any, devices: list[aioep.EpDevice], baseline: Callable[[], Any]
) -> tuple[float, float, tuple[str, ...]]:
    async def create() -> tuple[str, ...]:
        session = await env.create_session(model, ep_devices=devices)
        assignment = session.assignment
        await session.aclose()
        return assignment

    assignment = await create()  # warm-up (and the assignment, for the record)
    baseline()
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        await create()
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        baseline()
        theirs.append(time.perf_counter() - start)
    return statistics.median(ours), statistics.median(theirs), assignment


ROUNDS = 7


def _webgpu_library() -> str | None:
    if importlib.util.find_spec("onnxruntime_ep_webgpu") is None:
        return None
    if importlib.util.find_spec("aioep_ort") is None:
        return None
    import onnxruntime_ep_webgpu  # type: ignore[import-untyped]

    return str(onnxruntime_ep_webgpu.get_library_path())


async def main(names: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    webgpu = _webgpu_library()
    options: dict[str, Any] = {}
    backends = ["sim"]
    if webgpu is not None:
        backends.append("ort")
        options["ort"] = {"libraries": f"webgpu={webgpu}"}
    async with aioep.Environment(backends=backends, backend_options=options) as env:
        sims = env.ep_devices(ep_name="SimExecutionProvider")[:1]
        gpus = env.ep_devices(ep_name="WebGpuExecutionProvider")[:1]
        for name in names:
            model = onnx.load(LIGHT / f"{name}.onnx")
            data = _bytes_for_ort(model)

            def cpu_baseline(data: bytes = data) -> Any:
                return ort.InferenceSession(data, providers=["CPUExecutionProvider"])

            row: dict[str, Any] = {}
            contenders: list[tuple[str, list[aioep.EpDevice], Callable[[], Any]]] = [
                ("cpu", [], cpu_baseline),
                ("sim", sims, cpu_baseline),
            ]
            if gpus:
                plugin = [d for d in ort.get_ep_devices() if d.ep_name == "WebGpuExecutionProvider"]

                def gpu_baseline(data: bytes = data, plugin: list[Any] = plugin) -> Any:
                    so = ort.SessionOptions()
                    so.add_provider_for_devices(plugin, {})
                    return ort.InferenceSession(data, so)

                contenders.append(("webgpu", gpus, gpu_baseline))
            for label, devices, baseline in contenders:
                if label != "cpu" and not devices:
                    continue
                ours, theirs, assignment = await _measure(env, model, devices, baseline)
                eps = {ep: assignment.count(ep) for ep in sorted(set(assignment))}
                row[label] = {
                    "aioep_s": round(ours, 4),
                    "onnxruntime_s": round(theirs, 4),
                    "ratio": round(ours / theirs, 2),
                    "nodes_per_ep": eps,
                }
                print(
                    f"{name:22s} {label:6s} aioep {ours * 1e3:7.1f} ms   onnxruntime "
                    f"{theirs * 1e3:7.1f} ms   ratio {ours / theirs:4.2f}x   {eps}"
                )
            results[name] = row
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every light model in the onnx wheel")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    ROUNDS = args.rounds
    names = (
        sorted(p.stem for p in LIGHT.glob("light_*.onnx")) if args.all else ["light_densenet121"]
    )
    results = anyio.run(main, names)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "python": sys.version.split()[0],
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "onnxruntime": ort.__version__,
                "onnx": onnx.__version__,
                "aioep": aioep.__version__,
                "rounds": ROUNDS,
                "models": results,
            },
            indent=2,
        )
        + "\n"
    )
