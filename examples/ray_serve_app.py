"""aioep on Ray Serve: one environment per replica, requests through Ray's HTTP proxy.

Run it (after ``pip install -e ".[ray,onnx]" -e backends/sim``)::

    python examples/ray_serve_app.py                    # 2 replicas, 127.0.0.1:8000
    curl -s 127.0.0.1:8000/ -H 'content-type: application/json' \\
         -d '{"inputs": [[1, 2, 3, 4], [-1, 0, 1, 2]]}'

Ctrl-C shuts Serve and Ray down.

What it shows:

* a Ray Serve **deployment** (``AioepModel``) with 2 replicas; each replica is its
  own process, so each opens **one** ``aioep.Environment`` for its lifetime: in
  its ``async __init__`` (replica start) and closed in its ``async __del__``
  (replica stop), on the replica's event loop;
* each replica picks its device: CUDA when Ray gave it a GPU
  (``ray.get_gpu_ids()``), else a WebGPU plugin EP where one is installed, else
  the simulated accelerator, else the host CPU (``--device`` forces one), and
  creates the model's session there once;
* every request is ``await session.run(...)`` on that replica's session;
  Ray's HTTP proxy spreads the requests over the replicas.

Nothing aioep makes crosses a process boundary: tensors, streams, sessions and
the environment live in the replica that made them; requests and responses
carry plain lists (see docs/guides/scale-out.md).

The model is a two-layer MLP (Gemm -> Relu -> Gemm) built in memory with ``onnx``.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

import aioep

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import JSONResponse

IN_FEATURES, HIDDEN, OUT_FEATURES = 4, 16, 3
MAX_ROWS = 1024
_rng = np.random.default_rng(7)
W1 = _rng.standard_normal((IN_FEATURES, HIDDEN)).astype(np.float32)
B1 = _rng.standard_normal(HIDDEN).astype(np.float32)
W2 = _rng.standard_normal((HIDDEN, OUT_FEATURES)).astype(np.float32)
B2 = _rng.standard_normal(OUT_FEATURES).astype(np.float32)

# EP names for --device, in the order "auto" tries them (CUDA only with a GPU from Ray).
DEVICES = {
    "cuda": "CUDAExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
    "sim": "SimExecutionProvider",
    "cpu": "host",
}
BACKENDS = {"cuda": ["cuda"], "webgpu": ["ort"], "sim": ["sim"], "cpu": []}


def build_model() -> Any:
    """The MLP as an in-memory ONNX model (input ``x`` [n, 4], output ``y`` [n, 3])."""
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


def pick_device(env: aioep.Environment, wanted: str, gpu_ids: list[Any]) -> aioep.EpDevice:
    """The device this replica serves on: ``wanted`` (a key of DEVICES), or the first
    available of CUDA (only when Ray assigned a GPU), WebGPU, sim, host CPU."""
    order = [wanted] if wanted != "auto" else [*(["cuda"] if gpu_ids else []), "webgpu", "sim"]
    by_ep = {}
    for dev in env.ep_devices():
        by_ep.setdefault(dev.ep_name, dev)
    for key in order:
        if DEVICES[key] in by_ep:
            return by_ep[DEVICES[key]]
    if wanted not in ("auto", "cpu"):
        raise aioep.DeviceError(
            f"--device {wanted}: no {DEVICES[wanted]} device in this replica "
            f"(load errors: {env.load_errors})"
        )
    return env.ep_devices(device_type=aioep.DeviceType.CPU)[0]


class AioepModel:
    """One replica: an aioep environment and a session on its device, for its lifetime.

    A plain class; `main` makes it a Serve deployment (``serve.deployment(AioepModel)``),
    after setting the environment variables Ray reads when it is imported.
    """

    async def __init__(self, device: str = "auto") -> None:
        import ray

        self._stack = AsyncExitStack()
        backends = None if device == "auto" else BACKENDS[device]
        self.env = await self._stack.enter_async_context(aioep.Environment(backends=backends))
        self.device = pick_device(self.env, device, ray.get_gpu_ids())
        self.session = await self.env.create_session(build_model(), ep_devices=[self.device])
        self._stack.push_async_callback(self.session.aclose)
        self.replica = f"{os.getpid()}:{id(self.env):x}"
        print(f"replica {self.replica}: environment open, serving on {self.device.ep_name}")

    async def __call__(self, request: Request) -> JSONResponse:
        from starlette.responses import JSONResponse

        try:
            body = await request.json()
            x = _as_input(body["inputs"])
        except (ValueError, KeyError, TypeError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)
        outputs = await self.session.run({"x": x}, output_location="host")
        return JSONResponse(
            {
                "outputs": outputs["y"].numpy().tolist(),
                "device": self.device.ep_name,
                "replica": self.replica,
            }
        )

    async def __del__(self) -> None:
        # Serve calls this once when the replica stops: close the session, then the
        # environment (streams, allocators, backends), on the replica's own loop.
        await self._stack.aclose()
        print(f"replica {self.replica}: environment closed")


def _as_input(rows: Any) -> npt.NDArray[np.float32]:
    x = np.asarray(rows, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != IN_FEATURES or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"inputs must be 1..{MAX_ROWS} rows of {IN_FEATURES} numbers each")
    return np.ascontiguousarray(x)


def main(argv: list[str] | None = None) -> int:
    """Start a local Ray instance on 127.0.0.1, deploy the app, serve until Ctrl-C / SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of Ray's proxy")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--device", choices=["auto", *DEVICES], default="auto")
    parser.add_argument("--num-cpus", type=float, default=2)
    parser.add_argument("--temp-dir", help="Ray's session and log directory (default /tmp/ray)")
    args = parser.parse_args(argv)

    # A local, single-node instance that talks to nobody else: no usage statistics, no
    # dashboard, and every server on the loopback interface (Ray binds its servers to the
    # node's address; this switch makes that 127.0.0.1, as Ray does on macOS/Windows).
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import serve

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(
        num_cpus=args.num_cpus,
        include_dashboard=False,
        object_store_memory=80 * 2**20,
        _node_ip_address="127.0.0.1",
        _temp_dir=args.temp_dir,
        configure_logging=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        deployment = serve.deployment(
            AioepModel,
            num_replicas=args.replicas,
            # Half a CPU each: the replicas fit beside Serve's controller and proxy.
            ray_actor_options={"num_cpus": 0.5},
            max_ongoing_requests=32,
        )
        app = deployment.bind(args.device)
        serve.run(app, name="aioep", route_prefix="/")
        print(f"ready: http://127.0.0.1:{args.port}/ ({args.replicas} replicas)", flush=True)
        stop.wait()
        serve.shutdown()
    finally:
        ray.shutdown()
    print("ray shut down", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
