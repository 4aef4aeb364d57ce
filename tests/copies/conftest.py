"""What the copy tests share: counting the loop wake-ups a copy makes."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest


@pytest.fixture
def wakeups(monkeypatch: pytest.MonkeyPatch, anyio_backend: str) -> list[str]:
    """The names of the threads that schedule a wake-up of the test's loop, one per wake-up
    (``call_soon_threadsafe`` on asyncio, ``TrioToken.run_sync_soon`` on trio)."""
    seen: list[str] = []
    if anyio_backend == "trio":
        import trio

        real = trio.lowlevel.TrioToken.run_sync_soon

        def run_sync_soon(self: Any, *args: Any, **kwargs: Any) -> None:
            seen.append(threading.current_thread().name)
            real(self, *args, **kwargs)

        monkeypatch.setattr(trio.lowlevel.TrioToken, "run_sync_soon", run_sync_soon)
    else:
        real_cst = asyncio.BaseEventLoop.call_soon_threadsafe

        def call_soon_threadsafe(self: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(threading.current_thread().name)
            return real_cst(self, *args, **kwargs)

        monkeypatch.setattr(asyncio.BaseEventLoop, "call_soon_threadsafe", call_soon_threadsafe)
    return seen
