"""The runnable examples: quickstart, pipeline and external data as scripts, the serving app
in-process (httpx + ASGITransport, lifespan run by asgi-lifespan) and under a real uvicorn
server. Every script and the server run with ``python -W error``: correct code gets no warning."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SIM_INSTALLED = any(
    e.name == "sim" for e in importlib.metadata.entry_points(group="aioep.backends")
)
needs_sim = pytest.mark.skipif(not SIM_INSTALLED, reason="the sim backend is not installed")

pytestmark = pytest.mark.anyio


def _run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``python -W error *args`` from the repository root."""
    return subprocess.run(
        [sys.executable, "-W", "error", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@needs_sim
def test_quickstart_round_trip_is_bit_exact() -> None:
    # Under -W error: its device tensor, still named by a local when `async with` ends,
    # is ordinary scoping, not a warning.
    proc = _run_script("examples/quickstart.py")
    assert proc.returncode == 0, proc.stderr
    assert "SimExecutionProvider" in proc.stdout
    assert "round trips are bit-exact" in proc.stdout
    # Each device once, told apart by its id (the sim offers two alike but for it).
    listing = proc.stdout.split("EP devices:\n", 1)[1].splitlines()
    devices = list(itertools.takewhile(lambda line: line.startswith("  "), listing))
    assert devices, proc.stdout
    assert len(set(devices)) == len(devices), devices
    ids = [re.search(r" id (\d+) ", line) for line in devices]
    assert all(ids), devices
    sim = [m.group(1) for m, line in zip(ids, devices) if m and "SimExecutionProvider" in line]
    assert sim == sorted(set(sim), key=int), devices
    assert "Warning" not in proc.stderr


@needs_sim
def test_external_data_loads_the_weights_onto_the_device() -> None:
    pytest.importorskip("onnx")
    proc = _run_script("examples/external_data.py")
    assert proc.returncode == 0, proc.stderr
    for name in ("embed", "proj", "bias"):
        assert re.search(rf"^{name} +<Tensor .* on 'Sim'> matches: True$", proc.stdout, re.M)


@needs_sim
def test_pipeline_overlaps_and_verifies() -> None:
    proc = _run_script(
        "examples/pipeline.py", "--batches", "4", "--mib", "1", "--bandwidth-gbps", "0.25"
    )
    assert proc.returncode == 0, proc.stderr
    assert "every batch verified" in proc.stdout
    times = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^\s+(serial|overlapped)\s+([\d.]+) ms", proc.stdout, re.M)
    }
    # The sim's copy engines sleep for the modeled transfer time, so this holds under load.
    assert times["overlapped"] < times["serial"], proc.stdout


# -- serving app, in-process ------------------------------------------------------------------


def _load_serving_app() -> ModuleType:
    pytest.importorskip("fastapi")
    spec = importlib.util.spec_from_file_location("serving_app", EXAMPLES / "serving_app.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["serving_app"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def serving_app() -> ModuleType:
    return _load_serving_app()


@pytest.fixture(scope="module")
def squeezenet(serving_app: ModuleType) -> tuple[Any, Any]:
    """The served model's input spec and onnxruntime's CPU session for it (the oracle)."""
    import onnx
    from _baseline import ort_baseline

    model = onnx.load(str(serving_app.default_model_path()))
    return serving_app.InputSpec.of(model), ort_baseline(model)


def _image(seed: int) -> Any:
    return np.random.default_rng(seed).random((1, 3, 224, 224), dtype=np.float32)


@pytest.fixture
async def client(serving_app: ModuleType) -> AsyncIterator[Any]:
    import httpx
    from asgi_lifespan import LifespanManager

    backends = ["sim"] if SIM_INSTALLED else []
    app = serving_app.create_app(
        workers=2,
        device="sim" if SIM_INSTALLED else "cpu",
        backends=backends,
        backend_options={"sim": {"latency_us": 10}},
    )
    async with LifespanManager(app, startup_timeout=120) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            yield c


async def test_serving_app_health_and_devices(client: Any) -> None:
    health = (await client.get("/healthz")).json()
    assert health["status"] == "ok"
    assert health["model"] == "light_squeezenet.onnx"
    assert health["input"]["shape"] == [1, 3, 224, 224]
    if SIM_INSTALLED:
        assert health["device"] == "SimExecutionProvider"
        assert "SimExecutionProvider" in health["placement"]
        assert health["streams"] == 2  # the environment's pool: stream_pool_size=workers
        assert health["requests_running"] == 0
    devices = (await client.get("/devices")).json()
    assert devices[0]["type"] == "CPU"


async def test_serving_app_serves_squeezenet_like_onnxruntime(
    client: Any, squeezenet: tuple[Any, Any]
) -> None:
    import io

    spec, oracle = squeezenet
    x = _image(0)
    (expected,) = oracle.run(None, {spec.name: x})
    resp = await client.post("/infer", json={"inputs": x.tolist()})
    assert resp.status_code == 200, resp.text
    (got,) = resp.json()["outputs"].values()
    np.testing.assert_allclose(np.array(got, np.float32), expected, rtol=1e-4, atol=1e-5)
    buf = io.BytesIO()
    np.save(buf, x)
    resp = await client.post("/infer/npy", content=buf.getvalue())
    assert resp.status_code == 200, resp.text
    y = np.load(io.BytesIO(resp.content))
    assert resp.headers["x-output-name"] == oracle.get_outputs()[0].name
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)


async def test_serving_app_concurrent_requests_share_the_stream_pool(
    client: Any, squeezenet: tuple[Any, Any]
) -> None:
    import io

    import anyio

    spec, oracle = squeezenet
    results: dict[int, Any] = {}

    async def one(i: int) -> None:
        buf = io.BytesIO()
        np.save(buf, _image(i))
        resp = await client.post("/infer/npy", content=buf.getvalue())
        assert resp.status_code == 200, resp.text
        results[i] = np.load(io.BytesIO(resp.content))

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i)
    for i in range(6):
        (expected,) = oracle.run(None, {spec.name: _image(i)})
        np.testing.assert_allclose(results[i], expected, rtol=1e-4, atol=1e-5)
    health = (await client.get("/healthz")).json()
    assert health["requests_running"] == 0  # every request gave its slot (and stream) back


async def test_serving_app_rejects_bad_input(client: Any) -> None:
    import io

    resp = await client.post("/infer", json={"inputs": [[1, 2, 3]]})
    assert resp.status_code == 422
    assert "must have shape [1, 3, 224, 224]" in resp.text
    resp = await client.post("/infer", json={"inputs": [[1, 2], [3]]})
    assert resp.status_code == 422
    resp = await client.post("/infer", json={"inputs": "nope"})
    assert resp.status_code == 422
    resp = await client.post("/infer/npy", content=b"not an npy file")
    assert resp.status_code == 422
    assert ".npy" in resp.text
    buf = io.BytesIO()
    np.save(buf, np.zeros((1, 3, 224, 224), np.complex64))
    resp = await client.post("/infer/npy", content=buf.getvalue())
    assert resp.status_code == 422
    assert "must be float32" in resp.text


async def test_serving_app_on_the_webgpu_plugin_ep(
    serving_app: ModuleType, squeezenet: tuple[Any, Any]
) -> None:
    """``auto`` picks the WebGPU plugin EP where its driver works: the model runs there,
    inputs and outputs bound on the device, and answers as onnxruntime's CPU EP does."""
    import io

    import anyio
    import httpx
    from asgi_lifespan import LifespanManager

    if importlib.util.find_spec("onnxruntime_ep_webgpu") is None:
        pytest.skip("onnxruntime-ep-webgpu is not installed")
    app = serving_app.create_app(workers=2, device="auto", backends=[])
    spec, oracle = squeezenet
    try:
        manager = await LifespanManager(app, startup_timeout=300).__aenter__()
    except RuntimeError as exc:
        pytest.skip(f"the WebGPU plugin EP is not usable here: {exc}")
    try:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            health = (await c.get("/healthz")).json()
            if health["device"] != "WebGpuExecutionProvider":
                pytest.skip(f"auto chose {health['device']}: WebGPU has no usable adapter")
            assert "WebGpuExecutionProvider" in health["placement"]
            assert health["streams"] == 0  # ORT's WebGPU EP has no sync streams

            async def one(seed: int) -> None:
                buf = io.BytesIO()
                np.save(buf, _image(seed))
                resp = await c.post("/infer/npy", content=buf.getvalue())
                assert resp.status_code == 200, resp.text
                (expected,) = oracle.run(None, {spec.name: _image(seed)})
                np.testing.assert_allclose(
                    np.load(io.BytesIO(resp.content)), expected, rtol=1e-3, atol=1e-4
                )

            with anyio.fail_after(300):
                async with anyio.create_task_group() as tg:
                    for seed in range(3):
                        tg.start_soon(one, seed)
    finally:
        await manager.__aexit__(None, None, None)


# -- serving app under uvicorn ----------------------------------------------------------------


@pytest.fixture
def uvicorn_server() -> Iterator[tuple[str, list[str], subprocess.Popen[str]]]:
    """Start ``uvicorn serving_app:app`` on 127.0.0.1 with a free port; stop it afterwards."""
    pytest.importorskip("uvicorn")
    env = {
        **os.environ,
        "AIOEP_SIM_LATENCY_US": "10",
        "AIOEP_DEVICE": "sim" if SIM_INSTALLED else "cpu",
        "PYTHONUNBUFFERED": "1",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-W",
            "error",
            "-m",
            "uvicorn",
            "--app-dir",
            str(EXAMPLES),
            "serving_app:app",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    ready = threading.Event()
    url: list[str] = []

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url.append(m.group(1))
                ready.set()
        ready.set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        if not ready.wait(60) or not url:
            pytest.fail("uvicorn did not start:\n" + "".join(log))
        yield url[0], log, proc
    finally:
        _stop(proc)
        thread.join(10)
        if proc.stdout is not None:
            proc.stdout.close()


def _stop(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # graceful: runs the lifespan's shutdown
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_serving_app_under_uvicorn(
    uvicorn_server: tuple[str, list[str], subprocess.Popen[str]], squeezenet: tuple[Any, Any]
) -> None:
    import io

    import anyio
    import httpx

    base, log, _ = uvicorn_server
    spec, oracle = squeezenet
    x = _image(3)
    (expected,) = oracle.run(None, {spec.name: x})
    buf = io.BytesIO()
    np.save(buf, x)
    with anyio.fail_after(60):
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            assert (await c.get("/healthz")).json()["status"] == "ok"
            for _ in range(3):
                resp = await c.post("/infer/npy", content=buf.getvalue())
                assert resp.status_code == 200, resp.text
                y = np.load(io.BytesIO(resp.content))
                np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)
    assert any("Application startup complete" in line for line in log)


def test_uvicorn_shuts_down_cleanly(
    uvicorn_server: tuple[str, list[str], subprocess.Popen[str]],
) -> None:
    import httpx

    base, log, proc = uvicorn_server
    assert httpx.get(f"{base}/healthz", timeout=30).status_code == 200
    assert _stop(proc) == 0
    deadline = time.monotonic() + 10
    while not any("Application shutdown complete" in line for line in log):
        assert time.monotonic() < deadline, "".join(log)
        time.sleep(0.05)  # the reader thread is draining the exited server's output
    assert not any("Traceback" in line for line in log), "".join(log)


def test_serving_app_module_exposes_app(serving_app: ModuleType) -> None:
    from fastapi import FastAPI

    assert isinstance(serving_app.app, FastAPI)


# -- docs --------------------------------------------------------------------------------------


def test_docs_reference_only_importable_modules() -> None:
    """A ``::: name`` block naming a missing module breaks ``mkdocs build --strict``."""
    names = re.findall(
        r"^::: ([\w.]+)",
        "".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))),
        re.M,
    )
    assert "aioep" in names
    for name in names:
        module, _, attr = name, "", ""
        while True:
            try:
                mod = importlib.import_module(module)
                break
            except ModuleNotFoundError:
                module, _, tail = module.rpartition(".")
                attr = f"{tail}.{attr}".strip(".")
                assert module, f"docs refer to {name!r}, which does not exist"
        for part in filter(None, attr.split(".")):
            mod = getattr(mod, part)


def test_docs_nav_names_existing_pages() -> None:
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert nav
    missing = [page for page in nav if not (ROOT / "docs" / page).is_file()]
    assert not missing


@pytest.mark.slow
def test_docs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "index.html").is_file()
