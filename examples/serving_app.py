"""aioep serving example: a FastAPI app that runs a tiny model on an accelerator.

Run it (after ``pip install -e ".[examples,onnx]" -e backends/sim``)::

    uvicorn --app-dir examples serving_app:app --port 8000
    curl -s localhost:8000/infer -H 'content-type: application/json' \\
         -d '{"inputs": [[1, 2, 3, 4], [-1, 0, 1, 2]]}'

What it shows:

* the app's **lifespan** opens ``async with aioep.Environment()`` once, picks a
  device (the first GPU-type EP device: the simulated accelerator, or CUDA; the
  host CPU when there is none), builds the model's session on it, and makes a
  small **pool of streams**, one per concurrent worker;
* each request borrows a stream from the pool, **uploads** its tensor with
  ``await env.copy_tensors(...)``, **runs** the model on the device with
  ``session.run(..., stream=stream)`` (ordered after the upload on that stream),
  **downloads** the result and returns it as JSON.

Request handlers run in tasks that do not inherit the lifespan's context, so
they use the environment object kept in ``app.state`` (``env.copy_tensors``),
not the context-bound ``aioep.copy_tensors``.

The model is a two-layer MLP (Gemm -> Relu -> Gemm) built in memory with
``onnx``; the sim EP runs all three nodes on the device. Without ``onnx`` the
app still serves, computing the same function with numpy on the host, and says
so in every response (``"compute": "host fallback (numpy)"``).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel

import aioep

IN_FEATURES, HIDDEN, OUT_FEATURES = 4, 8, 2
MAX_ROWS = 1024
_rng = np.random.default_rng(0)
W1 = _rng.standard_normal((IN_FEATURES, HIDDEN)).astype(np.float32)
B1 = _rng.standard_normal(HIDDEN).astype(np.float32)
W2 = _rng.standard_normal((HIDDEN, OUT_FEATURES)).astype(np.float32)
B2 = _rng.standard_normal(OUT_FEATURES).astype(np.float32)


def reference(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """What the model computes, in numpy (the host fallback, and the tests' oracle)."""
    hidden = np.maximum(x @ W1 + B1, np.float32(0))
    return (hidden @ W2 + B2).astype(np.float32)


def build_model() -> Any:
    """The MLP as an in-memory ONNX model (input ``x`` [n, 4], output ``y`` [n, 2])."""
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", IN_FEATURES])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", OUT_FEATURES])
    weights = [
        numpy_helper.from_array(a, name)
        for a, name in ((W1, "w1"), (B1, "b1"), (W2, "w2"), (B2, "b2"))
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]),
        helper.make_node("Relu", ["h"], ["a"]),
        helper.make_node("Gemm", ["a", "w2", "b2"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "mlp", [x], [y], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class InferRequest(BaseModel):
    """``POST /infer`` body: rows of 4 numbers."""

    inputs: list[list[float]]


class StreamPool:
    """A fixed set of streams handed out one per request (waits while all are busy)."""

    def __init__(self, streams: Sequence[aioep.SyncStream]) -> None:
        self.streams = tuple(streams)
        self._send, self._receive = anyio.create_memory_object_stream[aioep.SyncStream](
            len(self.streams)
        )
        for s in self.streams:
            self._send.send_nowait(s)

    @asynccontextmanager
    async def acquire(self) -> AsyncIterator[aioep.SyncStream]:
        """Borrow a stream; it goes back to the pool afterwards, even on error or cancellation.

        A stream is an in-order queue, so work a cancelled request left on it
        simply runs before the next borrower's work.
        """
        stream = await self._receive.receive()
        try:
            yield stream
        finally:
            self._send.send_nowait(stream)

    @property
    def free(self) -> int:
        """Streams not lent out right now."""
        return self._receive.statistics().current_buffer_used

    async def aclose(self) -> None:
        """Close the pool and every stream (after its pending work)."""
        self._send.close()
        self._receive.close()
        for s in self.streams:
            await s.aclose()


@dataclass
class Engine:
    """What the lifespan sets up and every request uses (``app.state.engine``)."""

    env: aioep.Environment
    device: aioep.EpDevice
    memory: aioep.MemoryInfo
    pool: StreamPool
    session: Any  # an aioep session, or None for the host fallback
    compute: str


def create_app(
    *,
    workers: int = 2,
    backends: Sequence[str] | None = None,
    backend_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> FastAPI:
    """Build the app with ``workers`` streams (requests on the device at once); ``backends``
    and ``backend_options`` go to :class:`aioep.Environment`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with aioep.Environment(backends=backends, backend_options=backend_options) as env:
            device = _first_accelerator(env)
            memory = device.memory_info(aioep.MemoryType.DEFAULT)
            assert memory is not None
            session, compute = await _make_session(env, device)
            pool = StreamPool([env.create_sync_stream(device) for _ in range(workers)])
            app.state.engine = Engine(env, device, memory, pool, session, compute)
            try:
                yield
            finally:
                await pool.aclose()
                if session is not None:
                    await session.aclose()

    app = FastAPI(title="aioep serving example", lifespan=lifespan)

    def engine_of(request: Request) -> Engine:
        engine: Engine = request.app.state.engine
        return engine

    @app.get("/healthz")
    async def healthz(request: Request) -> dict[str, Any]:
        engine = engine_of(request)
        return {
            "status": "ok",
            "device": engine.device.ep_name,
            "compute": engine.compute,
            "streams": len(engine.pool.streams),
            "free_streams": engine.pool.free,
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
        x = _as_input(body.inputs)
        env = engine.env
        async with engine.pool.acquire() as stream:
            on_device = env.empty(x.shape, x.dtype, engine.memory, stream=stream)
            await env.copy_tensors([x], [on_device], stream)  # upload
            if engine.session is not None:
                outputs = await engine.session.run({"x": on_device}, stream=stream)
                y = outputs["y"]  # on the device, valid for work enqueued later on `stream`
            else:
                y = on_device  # host fallback: compute after the download, below
            result = np.empty(y.shape, y.dtype)
            await env.copy_tensors([y], [result], stream)  # download
        if engine.session is None:
            result = reference(result)
        return {
            "outputs": result.tolist(),
            "device": engine.device.ep_name,
            "compute": engine.compute,
        }

    return app


def _first_accelerator(env: aioep.Environment) -> aioep.EpDevice:
    """The first non-CPU EP device that can run streams, else the host CPU."""
    for dev in env.ep_devices():
        if dev.device_type is not aioep.DeviceType.CPU and dev.factory.is_stream_aware():
            return dev
    return env.ep_devices(device_type=aioep.DeviceType.CPU)[0]


async def _make_session(env: aioep.Environment, device: aioep.EpDevice) -> tuple[Any, str]:
    try:
        model = build_model()
    except ImportError:
        return None, "host fallback (numpy): onnx is not installed"
    try:
        session = await env.create_session(model, ep_devices=[device])
    except (aioep.EpError, ImportError) as exc:
        return None, f"host fallback (numpy): no session: {exc}"
    placement = ", ".join(sorted(set(session.assignment)))
    return session, f"session on {placement}"


def _as_input(rows: list[list[float]]) -> npt.NDArray[np.float32]:
    if not rows or len(rows) > MAX_ROWS or any(len(r) != IN_FEATURES for r in rows):
        raise HTTPException(
            status_code=422,
            detail=f"inputs must be 1..{MAX_ROWS} rows of {IN_FEATURES} numbers each",
        )
    return np.ascontiguousarray(rows, dtype=np.float32)


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
