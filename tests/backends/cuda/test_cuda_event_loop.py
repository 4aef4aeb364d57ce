"""The CUDA backend knows when it runs on an event loop's thread (where it must not wait for
the device, so a final release goes to a thread of its own), under asyncio and trio — with
every trio version the project declares (``trio.lowlevel.in_trio_run`` is only in newer
ones: with the lowest, the check failed and a release waited on the loop)."""

from __future__ import annotations

import anyio
import anyio.to_thread
import pytest

_device = pytest.importorskip("aioep_cuda._device")

pytestmark = pytest.mark.anyio


async def test_the_loop_thread_is_recognised() -> None:
    assert _device._on_event_loop()


async def test_a_worker_thread_is_not_the_loop() -> None:
    assert not await anyio.to_thread.run_sync(_device._on_event_loop)


def test_outside_any_loop() -> None:
    assert not _device._on_event_loop()
