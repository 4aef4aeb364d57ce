from __future__ import annotations

import gc
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest
from _factories import MakeEnv

import aioep


def pytest_configure(config: pytest.Config) -> None:
    # The strict CUDA emulator (tests/cuda_emulator) prints why it aborts, one MISUSE line, to
    # stderr; pytest captures fd 2 during each test and an abort loses that capture, so give it
    # a copy of the real stderr taken now, before capturing starts ("pid:fd": this process only).
    os.environ["CUEMU_STDERR_FD"] = f"{os.getpid()}:{os.dup(2)}"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs under asyncio and under trio."""
    return str(request.param)


def pytest_collection_finish(session: pytest.Session) -> None:
    # Everything alive now (imported modules: numpy, onnx, onnxruntime, the test modules) lives
    # for the whole run: freeze it, so the collection before each test scans only what tests
    # made since (a full collection of the imported libraries took ~50 ms a test).
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _collect_garbage() -> None:
    # Buffers free themselves when dropped; collect cycles so one test's leftovers
    # never show up as "live buffers" in the next.
    gc.collect()


@pytest.fixture
async def make_env() -> AsyncIterator[MakeEnv]:
    """Open an environment with the sim registered; it closes after the test's locals are gone."""
    from aioep_sim import SimFactory  # only the tests that use this fixture need the sim

    envs: list[aioep.Environment] = []

    async def make(**options: Any) -> aioep.Environment:
        env = await aioep.Environment(autoload=False).__aenter__()
        envs.append(env)
        env.register_library("sim", SimFactory, options or None)
        return env

    yield make
    gc.collect()
    for env in reversed(envs):
        await env.aclose()
