"""Crashes and hangs found by fault probes (issue 25), each fixed and checked under asyncio
and trio: a buffer over a null pointer, an infinite timeout, re-activating a notification a
stream waits on, and a done-callback that raises."""

from __future__ import annotations

import logging

import anyio
import numpy as np
import pytest

pytest.importorskip("aioep_sim")

import aioep
from aioep import InvalidArgument, MemoryType
from aioep._plugin.buffer import HOST_MEMORY_INFO
from aioep.abc import HostNotification

pytestmark = pytest.mark.anyio


async def _sim_env() -> tuple[aioep.Environment, aioep.EpDevice]:
    env = await aioep.Environment(autoload=False).__aenter__()
    (dev, *_) = env.register_library("sim", "aioep_sim:SimFactory")
    return env, dev


async def test_null_pointer_buffer_is_refused_before_any_copy() -> None:
    with pytest.raises(InvalidArgument, match="null"):
        aioep.Buffer(0, 64, HOST_MEMORY_INFO)
    assert aioep.Buffer(0, 0, HOST_MEMORY_INFO).nbytes == 0  # an empty buffer may be null
    async with aioep.Environment(autoload=False) as env:
        empty = aioep.Tensor(aioep.Buffer(0, 0, HOST_MEMORY_INFO), 0, np.float32)
        out = await env.copy_tensors([empty], [np.zeros(0, np.float32)])
        assert out[0].size == 0
        # The environment still copies afterwards.
        dst = np.zeros(3)
        await env.copy_tensors([np.arange(3.0)], [dst])
        assert dst.tolist() == [0.0, 1.0, 2.0]


async def test_infinite_timeout_waits_forever() -> None:
    env, dev = await _sim_env()
    try:
        async with env.create_sync_stream(dev) as stream:
            info = dev.memory_info(MemoryType.DEFAULT)
            t = env.empty(16, np.float32, info)
            future = env.copy_tensors([np.ones(16, np.float32)], [t], stream)
            note = stream.record()
            await anyio.to_thread.run_sync(note.wait, float("inf"))
            assert note.done()
            await anyio.to_thread.run_sync(future.wait, float("inf"))
            for bad in (-1.0, float("nan"), "1", True):
                with pytest.raises(InvalidArgument, match="timeout"):
                    note.wait(bad)  # type: ignore[arg-type]
                with pytest.raises(InvalidArgument, match="timeout"):
                    future.wait(bad)  # type: ignore[arg-type]
            del t, future
    finally:
        await env.aclose()


async def test_reactivating_a_notification_a_stream_waits_on() -> None:
    env, dev = await _sim_env()
    try:
        async with env.create_sync_stream(dev) as s1, env.create_sync_stream(dev) as s2:
            info = dev.memory_info(MemoryType.DEFAULT)
            t = env.empty(4, np.float32, info)
            await env.copy_tensors([np.full(4, 2.0, np.float32)], [t], s1)
            gate = HostNotification()
            s1.wait(aioep.Notification(gate))  # s1 is busy: its marks stay pending
            note = s1.record()
            assert not note.done()
            # A stream waiting on its own mark, then the mark moves: the wait keeps the mark
            # it captured (as cuStreamWaitEvent), so nothing waits for a later point.
            s1.wait(note)
            note.activate()
            s2.wait(note)
            note.activate()
            gate.set()
            out = np.zeros(4, np.float32)
            with anyio.fail_after(30):
                await env.copy_tensors([t], [out], s2)
                await env.copy_tensors([np.ones(4, np.float32)], [t], s1)
                await s1.synchronize()
                await s2.synchronize()
            assert out.tolist() == [2.0] * 4
            with pytest.raises(InvalidArgument, match="SyncStream"):
                note.wait_on_device("s1")  # type: ignore[arg-type]
            del t
    finally:
        await env.aclose()


async def test_a_raising_done_callback_never_stops_the_stream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env, dev = await _sim_env()
    try:
        async with env.create_sync_stream(dev) as stream:
            info = dev.memory_info(MemoryType.DEFAULT)
            t = env.empty(4, np.float32, info)
            calls: list[str] = []

            def bad(_: aioep.CopyFuture) -> None:
                calls.append("bad")
                raise RuntimeError("callback failure")

            def good(_: aioep.CopyFuture) -> None:
                calls.append("good")

            with caplog.at_level(logging.ERROR, logger="aioep"):
                # Hold the stream's worker at a gate, so the copies are pending when the
                # callbacks are added and the worker itself runs them.
                gate = HostNotification()
                stream.wait(aioep.Notification(gate))
                futures = []
                for i in range(3):
                    fut = env.copy_tensors([np.full(4, float(i), np.float32)], [t], stream)
                    assert not fut.done()
                    fut.add_done_callback(bad)
                    fut.add_done_callback(good)
                    futures.append(fut)
                gate.set()
                with anyio.fail_after(30):
                    for fut in futures:
                        await fut
                    await stream.synchronize()
                out = np.zeros(4, np.float32)
                with anyio.fail_after(30):
                    await env.copy_tensors([t], [out], stream)  # the worker still runs
            assert out.tolist() == [2.0] * 4
            assert calls == ["bad", "good"] * 3
            logged = [r for r in caplog.records if "done-callback" in r.getMessage()]
            assert len(logged) == 3
            assert all("RuntimeError: callback failure" in r.getMessage() for r in logged)
            with pytest.raises(InvalidArgument, match="callable"):
                fut.add_done_callback(3)  # type: ignore[arg-type]
            del t, fut, futures
    finally:
        await env.aclose()
