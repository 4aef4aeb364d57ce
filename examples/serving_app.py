"""aioep serving example: a FastAPI app that serves a real ONNX model on the best device.

Run it (after ``pip install -e ".[examples]" -e backends/sim``, optionally
``-e "backends/ort[webgpu]"`` for the WebGPU plugin EP)::

    uvicorn --app-dir examples serving_app:app --port 8000
    curl -s localhost:8000/healthz
    python -c "import numpy as np, sys; np.save(sys.stdout.buffer, \\
        np.random.rand(1, 3, 224, 224).astype(np.float32))" |
      curl -s --data-binary @- -H 'content-type: application/octet-stream' \\
        localhost:8000/infer/npy -o y.npy

The model is ``light_squeezenet.onnx`` from the onnx wheel's test data (SqueezeNet's
architecture, 224x224 images in, 1000 class scores out) unless ``AIOEP_MODEL`` names
your own ``.onnx`` file (or ``create_app(model_path=...)`` does); any model with one
float32 tensor input works, dynamic dimensions included.

What it shows:

* the app's **lifespan** opens ``async with aioep.Environment()`` once, picks the best
  device (``AIOEP_DEVICE``: ``auto``, ``webgpu``, ``sim`` or ``cpu``; ``auto`` tries the
  WebGPU plugin EP where ``onnxruntime-ep-webgpu`` is installed and its driver works,
  then the first accelerator with streams, e.g. the simulated one or CUDA, then the
  host CPU), creates the model's **session** on it, and closes both at shutdown;
* requests run **concurrently**, at most ``workers`` at once: on a device with streams
  each request borrows one from the environment's pool
  (``async with env.pooled_stream(dev)``, ``workers`` streams shared round-robin),
  uploads its input with ``await env.copy_tensors(..., stream)`` and runs on that
  stream; on a device without streams (WebGPU) the session runs in worker threads,
  the inputs bound on the device by ORT's IOBinding. Outputs stay on the device until
  the response copies them down;
* ``POST /infer`` takes JSON (``{"inputs": nested lists}``) and ``POST /infer/npy`` a
  ``.npy`` body (what a real client sends: no float parsing), both answering with every
  output; a wrong shape or dtype is a 422 that names what the model expects.

Request handlers use the environment object kept in ``app.state``
(``env.copy_tensors``); the module-level ``aioep.copy_tensors`` works there too (it finds
the one open environment, although request tasks do not inherit the lifespan's context).
"""

from __future__ import annotations

import importlib.util
import io
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
from fastapi import FastAPI, HTTPException, Request, Response
from pydantic import BaseModel

import aioep

MAX_INPUT_BYTES = 64 << 20
DEVICES = ("auto", "webgpu", "sim", "cpu")


def default_model_path() -> Path:
    """``AIOEP_MODEL``, else ``light_squeezenet.onnx`` from the onnx wheel's test data."""
    if os.environ.get("AIOEP_MODEL"):
        return Path(os.environ["AIOEP_MODEL"])
    import onnx

    return Path(onnx.__file__).parent / "backend/test/data/light/light_squeezenet.onnx"


@dataclass(frozen=True)
class InputSpec:
    """The model's one tensor input: name, dtype and shape (``None`` for a dynamic dim)."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int | None, ...]

    @classmethod
    def of(cls, model: Any) -> InputSpec:
        """The first graph input that is not an initializer (older models list both)."""
        from onnx import helper

        inits = {i.name for i in model.graph.initializer}
        inputs = [i for i in model.graph.input if i.name not in inits]
        if len(inputs) != 1 or not inputs[0].type.HasField("tensor_type"):
            raise ValueError(f"the example serves models with one tensor input, not {inputs}")
        t = inputs[0].type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
        return cls(inputs[0].name, np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)), dims)

    def check(self, x: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """``x`` as a C-contiguous array of the input's dtype, or an HTTP 422 saying why not."""
        shape = ["?" if d is None else d for d in self.shape]
        if x.ndim != len(self.shape) or any(
            d is not None and d != n for d, n in zip(self.shape, x.shape)
        ):
            raise HTTPException(422, f"input {self.name!r} must have shape {shape}, got {x.shape}")
        if x.dtype != self.dtype and not np.can_cast(x.dtype, self.dtype, "same_kind"):
            raise HTTPException(422, f"input {self.name!r} must be {self.dtype}, got {x.dtype}")
        return np.ascontiguousarray(x, dtype=self.dtype)


class InferRequest(BaseModel):
    """``POST /infer`` body: the input tensor as nested lists."""

    inputs: list[Any]


@dataclass
class Engine:
    """What the lifespan sets up and every request uses (``app.state.engine``)."""

    env: aioep.Environment
    device: aioep.EpDevice
    session: aioep.Session
    spec: InputSpec
    model: str
    streams: bool
    """The device has streams (``env.pooled_stream`` lends them); not so on WebGPU or the CPU."""
    limit: anyio.CapacityLimiter
    """At most ``workers`` requests run the session at once."""

    async def infer(self, x: npt.NDArray[Any]) -> dict[str, npt.NDArray[Any]]:
        """Run the model on ``x`` (host) and return every output as a host array."""
        async with self.limit:
            if not self.streams:
                outputs = await self.session.run({self.spec.name: x})
                return await self._download(outputs, None)
            # A stream of the environment's pool, shared with other requests (their work
            # runs in order with ours; a device error reaches only the request it hit).
            # Leaving the block gives it back, even on error or cancellation.
            async with self.env.pooled_stream(self.device) as stream:
                memory = self.device.memory_info(aioep.MemoryType.DEFAULT)
                assert memory is not None
                on_device = self.env.empty(x.shape, x.dtype, memory, stream=stream)
                await self.env.copy_tensors([x], [on_device], stream)  # upload
                outputs = await self.session.run({self.spec.name: on_device}, stream=stream)
                return await self._download(outputs, stream)

    async def _download(
        self, outputs: Mapping[str, Any], stream: aioep.SyncStream | None
    ) -> dict[str, npt.NDArray[Any]]:
        tensors = {n: t for n, t in outputs.items() if isinstance(t, aioep.Tensor)}
        hosts = {n: np.empty(t.shape, t.dtype) for n, t in tensors.items()}
        # Outputs on the device are valid for work enqueued later on `stream`: download there.
        await self.env.copy_tensors(list(tensors.values()), list(hosts.values()), stream)
        return hosts


def create_app(
    *,
    workers: int = 2,
    device: str | None = None,
    model_path: str | Path | None = None,
    backends: Sequence[str] | None = None,
    backend_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> FastAPI:
    """Build the app: ``workers`` requests on the device at once (and ``workers`` pooled
    streams), on ``device`` (one of
    `DEVICES`; default ``AIOEP_DEVICE`` or ``auto``), serving ``model_path``
    (default `default_model_path`); ``backends`` and ``backend_options`` go to
    `aioep.Environment`."""
    choice = device or os.environ.get("AIOEP_DEVICE", "auto")
    if choice not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {choice!r}")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        import onnx

        path = Path(model_path) if model_path is not None else default_model_path()
        model = await anyio.to_thread.run_sync(onnx.load, str(path))
        spec = InputSpec.of(model)
        async with AsyncExitStack() as stack:
            env = await stack.enter_async_context(
                aioep.Environment(
                    backends=backends,
                    backend_options=backend_options,
                    stream_pool_size=workers,
                )
            )
            dev, session = await _session_on_best_device(env, model, choice)
            stack.push_async_callback(session.aclose)
            streams = dev.device_type is not aioep.DeviceType.CPU and dev.factory.is_stream_aware()
            limit = anyio.CapacityLimiter(workers)
            app.state.engine = Engine(env, dev, session, spec, path.name, streams, limit)
            yield

    app = FastAPI(title="aioep serving example", lifespan=lifespan)

    def engine_of(request: Request) -> Engine:
        engine: Engine = request.app.state.engine
        return engine

    @app.get("/healthz")
    async def healthz(request: Request) -> dict[str, Any]:
        engine = engine_of(request)
        return {
            "status": "ok",
            "model": engine.model,
            "input": {
                "name": engine.spec.name,
                "dtype": str(engine.spec.dtype),
                "shape": ["?" if d is None else d for d in engine.spec.shape],
            },
            "device": engine.device.ep_name,
            "placement": sorted(set(engine.session.assignment)),
            "streams": engine.env.stream_pool_size if engine.streams else 0,
            "requests_running": engine.limit.statistics().borrowed_tokens,
        }

    @app.get("/devices")
    async def devices(request: Request) -> list[dict[str, Any]]:
        env = engine_of(request).env
        return [
            {
                "ep_name": d.ep_name,
                "type": d.hardware.type.name,
                "vendor": d.hardware.vendor,
                "device_id": d.hardware.device_id,
                "memory": [i.name for i in d.memory_infos],
            }
            for d in env.ep_devices()
        ]

    @app.post("/infer")
    async def infer(body: InferRequest, request: Request) -> dict[str, Any]:
        engine = engine_of(request)
        try:
            x = np.asarray(body.inputs, dtype=np.float64)
        except ValueError as exc:
            raise HTTPException(
                422, f"inputs must be a rectangular array of numbers: {exc}"
            ) from exc
        outputs = await engine.infer(engine.spec.check(x))
        return {
            "outputs": {name: y.tolist() for name, y in outputs.items()},
            "device": engine.device.ep_name,
        }

    @app.post("/infer/npy")
    async def infer_npy(request: Request) -> Response:
        engine = engine_of(request)
        body = await request.body()
        if len(body) > MAX_INPUT_BYTES:
            raise HTTPException(413, f"input over {MAX_INPUT_BYTES} bytes")
        try:
            x = np.load(io.BytesIO(body), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise HTTPException(422, f"the body must be one .npy array: {exc}") from exc
        outputs = await engine.infer(engine.spec.check(x))
        name, y = next(iter(outputs.items()))
        out = io.BytesIO()
        np.save(out, y, allow_pickle=False)
        return Response(
            out.getvalue(),
            media_type="application/octet-stream",
            headers={"x-output-name": name, "x-device": engine.device.ep_name},
        )

    return app


async def _session_on_best_device(
    env: aioep.Environment, model: Any, choice: str
) -> tuple[aioep.EpDevice, aioep.Session]:
    """A session for ``model`` on the device ``choice`` names (``auto``: the best one)."""
    if choice in ("auto", "webgpu"):
        try:
            return await _webgpu_session(env, model)
        except (aioep.EpError, ImportError) as exc:
            if choice == "webgpu":
                raise RuntimeError(f"the WebGPU plugin EP is not usable here: {exc}") from exc
    if choice in ("auto", "sim"):
        for dev in env.ep_devices():
            if choice == "sim" and dev.ep_name != "SimExecutionProvider":
                continue
            if dev.device_type is not aioep.DeviceType.CPU and dev.factory.is_stream_aware():
                return dev, await env.create_session(model, ep_devices=[dev])
        if choice == "sim":
            raise RuntimeError("the sim backend is not installed (pip install -e backends/sim)")
    cpu = env.ep_devices(device_type=aioep.DeviceType.CPU)[0]
    return cpu, await env.create_session(model, ep_devices=[])


async def _webgpu_session(
    env: aioep.Environment, model: Any
) -> tuple[aioep.EpDevice, aioep.Session]:
    if importlib.util.find_spec("onnxruntime_ep_webgpu") is None:
        raise ImportError("onnxruntime-ep-webgpu is not installed")
    import onnxruntime_ep_webgpu

    os.environ.setdefault("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER", "1")
    (dev,) = env.register_library("webgpu", onnxruntime_ep_webgpu.get_library_path())
    try:
        return dev, await env.create_session(model, ep_devices=[dev])
    except BaseException:
        env.unregister_library("webgpu")
        raise


def _options_from_environment() -> dict[str, dict[str, float]]:
    # A little simulated bandwidth and latency make the sim behave like a real device.
    return {
        "sim": {
            "bandwidth_gbps": float(os.environ.get("AIOEP_SIM_BANDWIDTH_GBPS", "8")),
            "latency_us": float(os.environ.get("AIOEP_SIM_LATENCY_US", "20")),
        }
    }


app = create_app(backend_options=_options_from_environment())
"""The app uvicorn serves: ``uvicorn --app-dir examples serving_app:app``."""
