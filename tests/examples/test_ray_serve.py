"""examples/ray_serve_app.py on a local Ray instance: 2 replicas behind Ray's HTTP proxy, 100
requests over httpx, every output checked against onnxruntime, then a clean shutdown, with
warnings as errors (deprecations aside) in the driver and the replicas.

It skips unless ``ray[serve]`` is installed (``pip install -e ".[ray]"``), which the README's
test command does not install; CI installs it and runs ``pytest -m ray`` once, on the newest
Python. Ray's start-up, deployment, the requests and shutdown take ~20 s on 2 cores.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ray_serve_app.py"
STARTUP_S = 150  # Ray, Serve's controller and proxy, 2 replicas each opening an environment
SHUTDOWN_S = 60
REQUESTS = 100
STRICT_WARNINGS = "error,ignore::DeprecationWarning,ignore::PendingDeprecationWarning"


def _missing() -> str | None:
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        return "ray[serve] is not installed (pip install 'aioep[ray]')"
    for module in ("httpx", "onnx", "onnxruntime"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    if not any(e.name == "sim" for e in importlib.metadata.entry_points(group="aioep.backends")):
        return "the sim backend is not installed (pip install -e backends/sim)"
    return None


# CI sets AIOEP_REQUIRE_RAY=1 where it installed aioep[ray]: a missing piece fails there.
REQUIRED = os.environ.get("AIOEP_REQUIRE_RAY") == "1"
pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(_missing() is not None and not REQUIRED, reason=str(_missing())),
]


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ray_serve_app", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports no Ray: main() does
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class _Server:
    """The example as a subprocess in its own session; its output collected by a thread."""

    def __init__(self, port: int, temp_dir: Path) -> None:
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-u",
                str(EXAMPLE),
                *("--port", str(port), "--device", "sim", "--temp-dir", str(temp_dir)),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            # Warnings are errors in the driver and in every Ray process it starts (the
            # replicas that run aioep inherit the variable), less deprecations, which Ray's
            # own imports raise (pydantic's, under Ray 2.60): python -W error, as far as Ray
            # allows.
            env={**os.environ, "PYTHONWARNINGS": STRICT_WARNINGS},
            start_new_session=True,  # Ray's processes join this group: killpg reaches all
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("ready:"):
                self.ready.set()
        self.ready.set()  # the server exited: stop waiting

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        """SIGINT (the example shuts Serve and Ray down), then SIGKILL to the group if stuck."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(SHUTDOWN_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            pytest.fail(f"the Ray app did not shut down in {SHUTDOWN_S} s:\n{self.output}")
        finally:
            self._reader.join(10)
            if self.proc.stdout is not None:
                self.proc.stdout.close()

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True


@pytest.fixture
def ray_temp_dir() -> Iterator[Path]:
    """Ray's session directory: short, as its sockets' paths must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="aioep-ray-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_two_replicas_serve_requests_checked_against_onnxruntime(ray_temp_dir: Path) -> None:
    if (missing := _missing()) is not None:
        pytest.fail(f"AIOEP_REQUIRE_RAY=1, but {missing}")
    import httpx
    import onnxruntime as ort

    app = _load_example()
    reference = ort.InferenceSession(
        app.build_model().SerializeToString(), providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(0)
    inputs = [
        rng.standard_normal((int(rng.integers(1, 9)), app.IN_FEATURES)).astype(np.float32)
        for _ in range(REQUESTS)
    ]
    port = _free_port()
    server = _Server(port, ray_temp_dir)
    try:
        server.ready.wait(STARTUP_S)
        assert any(line.startswith("ready:") for line in server.lines), (
            f"not ready in {STARTUP_S} s:\n{server.output}"
        )
        url = f"http://127.0.0.1:{port}/"
        with httpx.Client(timeout=30) as client:

            def infer(x: np.ndarray[Any, Any]) -> httpx.Response:
                return client.post(url, json={"inputs": x.tolist()})

            # 8 at a time, so that Ray's proxy has reason to use both replicas.
            with ThreadPoolExecutor(8) as pool:
                responses = list(pool.map(infer, inputs))
            bad = client.post(url, json={"inputs": [[1.0, 2.0]]})
    finally:
        server.stop()

    for x, response in zip(inputs, responses, strict=True):
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["device"] == "SimExecutionProvider"
        (expected,) = reference.run(None, {"x": x})
        np.testing.assert_allclose(
            np.asarray(body["outputs"], np.float32), expected, rtol=1e-5, atol=1e-5
        )
    assert bad.status_code == 422
    assert "rows of 4 numbers" in bad.json()["error"]
    # Each replica kept one environment (pid:environment) for all the requests it served.
    replicas = Counter(response.json()["replica"] for response in responses)
    assert len(replicas) == 2, replicas
    assert len({r.split(":")[0] for r in replicas}) == 2

    out = server.output
    assert server.proc.returncode == 0, out
    assert "ray shut down" in out
    for replica in replicas:
        assert f"replica {replica}: environment open, serving on SimExecutionProvider" in out
        assert f"replica {replica}: environment closed" in out, out
    assert not server.group_alive(), "Ray processes outlived ray.shutdown()"
