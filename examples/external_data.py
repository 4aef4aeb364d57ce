"""Load a model's weights from external data files straight to a (simulated) device.

Builds a small model whose initializers live in a separate ``weights.bin``,
then loads them onto the first sim device with a progress bar: the bytes go
from the file to device memory without the whole model ever sitting in host
memory. Needs the sim backend (``pip install -e backends/sim``) and ``onnx``.

    python examples/external_data.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import anyio
import numpy as np
import onnx
from onnx import helper, numpy_helper

import aioep


def build_model(directory: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    weights = {
        "embed": rng.standard_normal((4096, 512)).astype(np.float32),
        "proj": rng.standard_normal((512, 512)).astype(np.float16),
        "bias": np.zeros(512, np.float32),
    }
    graph = helper.make_graph(
        [], "demo", [], [], [numpy_helper.from_array(a, n) for n, a in weights.items()]
    )
    path = directory / "model.onnx"
    onnx.save(
        helper.make_model(graph),
        str(path),
        save_as_external_data=True,
        location="weights.bin",
        size_threshold=1024,
    )
    return path, weights


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path, weights = build_model(Path(tmp))
        async with aioep.Environment(backends=["sim"]) as env:
            device = env.ep_devices(ep_name="SimExecutionProvider")[0]
            tensors = await env.load_initializers(path, device, progress=True, chunk_bytes=1 << 20)
            for name, tensor in tensors.items():
                back = env.empty(tensor.shape, tensor.dtype)  # host copy to check the bytes
                await env.copy_tensors([tensor], [back])
                ok = np.array_equal(back.numpy(), weights[name])
                print(f"{name:6} {tensor!r} matches: {ok}")


if __name__ == "__main__":
    anyio.run(main)
