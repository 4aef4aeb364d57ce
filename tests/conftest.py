from __future__ import annotations

import gc

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs under asyncio and under trio."""
    return str(request.param)


@pytest.fixture(autouse=True)
def _collect_garbage() -> None:
    # Buffers free themselves when dropped; collect cycles so one test's leftovers
    # never show up as "live buffers" in the next.
    gc.collect()
