"""The card's own usage: a FastAPI app whose lifespan holds ``async with aioep.Environment()``
and whose request handlers ``await aioep.copy_tensors(...)`` (issue 25). The lifespan runs in
its own task, as servers run it, so handlers do not inherit its context: the module-level
functions find the one open environment. Driven over ASGI (httpx) and under uvicorn."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

fastapi = pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("aioep_sim")

APP_SOURCE = textwrap.dedent(
    """
    from contextlib import asynccontextmanager

    import numpy as np
    from fastapi import FastAPI

    import aioep


    @asynccontextmanager
    async def lifespan(app):
        async with aioep.Environment(autoload=False) as env:
            env.register_library("sim", "aioep_sim:SimFactory")
            yield


    app = FastAPI(lifespan=lifespan)


    @app.post("/roundtrip")
    async def roundtrip(values: list[float]) -> dict:
        env = aioep.current_environment()
        sim = env.ep_devices(ep_name="SimExecutionProvider")[0]
        device = env.empty(len(values), np.float32, sim.memory_info(aioep.MemoryType.DEFAULT))
        await aioep.copy_tensors([np.asarray(values, np.float32) * 2], [device])
        out = np.empty(len(values), np.float32)
        await aioep.copy_tensors([device], [out])
        return {"values": out.tolist(), "device": str(device.device)}
    """
)


def _load_app(tmp_path: Path) -> Any:
    path = tmp_path / "aioep_asgi_app.py"
    path.write_text(APP_SOURCE)
    namespace: dict[str, Any] = {"__name__": "aioep_asgi_app"}
    exec(compile(APP_SOURCE, str(path), "exec"), namespace)
    return namespace["app"]


@asynccontextmanager
async def _lifespan_in_own_task(app: Any) -> AsyncIterator[None]:
    """Run the ASGI lifespan protocol in a separate task, as uvicorn does."""
    to_app_send, to_app_recv = anyio.create_memory_object_stream[dict[str, Any]](4)
    from_app_send, from_app_recv = anyio.create_memory_object_stream[dict[str, Any]](4)

    async def receive() -> dict[str, Any]:
        return await to_app_recv.receive()

    async def send(message: MutableMapping[str, Any]) -> None:
        await from_app_send.send(dict(message))

    async with (
        to_app_send,
        to_app_recv,
        from_app_send,
        from_app_recv,
        anyio.create_task_group() as tg,
    ):
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        tg.start_soon(app, scope, receive, send)
        await to_app_send.send({"type": "lifespan.startup"})
        message = await from_app_recv.receive()
        assert message["type"] == "lifespan.startup.complete", message
        try:
            yield
        finally:
            await to_app_send.send({"type": "lifespan.shutdown"})
            message = await from_app_recv.receive()
            assert message["type"] == "lifespan.shutdown.complete", message


@pytest.mark.anyio
async def test_fastapi_handlers_copy_over_asgi(tmp_path: Path) -> None:
    import aioep

    app = _load_app(tmp_path)
    async with _lifespan_in_own_task(app):
        # This task never entered the environment: only the lifespan task did.
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:

            async def one(i: int) -> None:
                resp = await client.post("/roundtrip", json=[i, i + 0.5, -1.0])
                assert resp.status_code == 200, resp.text
                assert resp.json()["values"] == [2.0 * i, 2.0 * i + 1.0, -2.0]
                assert resp.json()["device"].startswith("gpu:0x5151:0")

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
    with pytest.raises(aioep.EpError, match="no aioep Environment is open"):
        aioep.current_environment()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_fastapi_handlers_copy_under_uvicorn(tmp_path: Path) -> None:
    pytest.importorskip("uvicorn")
    (tmp_path / "aioep_asgi_app.py").write_text(APP_SOURCE)
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--app-dir",
            str(tmp_path),
            "--port",
            str(port),
            "--log-level",
            "warning",
            "aioep_asgi_app:app",
        ],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/roundtrip"
        deadline = time.monotonic() + 60
        while True:
            try:
                resp = httpx.post(url, json=[1.0, 2.0], timeout=10)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    out = proc.stdout.read() if proc.stdout else ""
                    pytest.fail(f"uvicorn did not start: {out}")
                time.sleep(0.1)
        assert resp.status_code == 200, resp.text
        assert resp.json()["values"] == [2.0, 4.0]
        assert np.allclose(httpx.post(url, json=[3.0], timeout=10).json()["values"], [6.0])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout:
            proc.stdout.close()
