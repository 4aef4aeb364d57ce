"""A buffer's release: exactly once, whether by free() or by the last reference going,
from any number of threads; a failing release is reported, never raised; a buffer whose
constructor failed and the interpreter's exit stay quiet."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

import aioep
from aioep._environment.host import HostAllocator
from aioep._memory.arena import ArenaAllocator
from aioep._plugin.buffer import HOST_MEMORY_INFO


class _Counter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_dropping_a_buffer_releases_it_once() -> None:
    release = _Counter()
    buf = aioep.Buffer(0x1000, 64, HOST_MEMORY_INFO, release=release)
    assert not buf.freed
    del buf
    assert release.calls == 1


def test_free_then_drop_releases_once() -> None:
    release = _Counter()
    buf = aioep.Buffer(0x1000, 64, HOST_MEMORY_INFO, release=release)
    buf.free()
    buf.free()
    assert buf.freed
    assert release.calls == 1
    del buf
    assert release.calls == 1


def test_a_pinned_buffer_refuses_free_and_is_released_after() -> None:
    release = _Counter()
    buf = aioep.Buffer(0x1000, 64, HOST_MEMORY_INFO, release=release)
    buf._pin()
    with pytest.raises(aioep.InUseError):
        buf.free()
    assert release.calls == 0
    assert not buf.freed
    buf._unpin()
    buf.free()
    assert release.calls == 1


def _free_together(buffers: list[aioep.Buffer], threads: int = 8) -> None:
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            start.wait()
            for buf in buffers:
                buf.free()
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so the frees really race
    try:
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors


def test_threads_freeing_one_buffer_release_it_once() -> None:
    counters = [_Counter() for _ in range(200)]
    buffers = [aioep.Buffer(0x1000, 64, HOST_MEMORY_INFO, release=c) for c in counters]
    _free_together(buffers)
    assert [c.calls for c in counters] == [1] * len(counters)


def test_threads_freeing_one_arena_buffer_give_its_chunk_back_once() -> None:
    arena = ArenaAllocator(HostAllocator())
    buffers = [arena.alloc(4096) for _ in range(12)]
    ptrs = {b.ptr for b in buffers}
    _free_together(buffers)
    stats = arena.stats()
    assert stats["LiveBuffers"] == 0
    assert stats["InUse"] == 0
    assert stats["InUseRequested"] == 0
    # Each chunk came back once: handing out as many buffers again gives each once.
    again = [arena.alloc(4096) for _ in range(12)]
    assert len({b.ptr for b in again}) == 12
    assert {b.ptr for b in again} == ptrs
    del again
    arena.close()


def test_an_arena_buffer_released_twice_in_a_race_comes_back_once() -> None:
    """Two threads past the released check at once both hand the buffer to the arena;
    the arena takes its chunk back once (the window, replayed deterministically)."""
    arena = ArenaAllocator(HostAllocator())
    buf = arena.alloc(4096)
    ptr = buf.ptr
    buf.free()
    buf._released = False  # the second thread read the flag before the first set it
    buf.free()
    assert arena.live_buffers == 0
    assert arena.stats()["InUse"] == 0
    first, second = arena.alloc(4096), arena.alloc(4096)
    assert first.ptr == ptr
    assert second.ptr != ptr  # not handed out twice
    del first, second
    arena.close()


def test_a_failing_release_is_reported_as_unraisable_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reported: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)

    def broken() -> None:
        raise RuntimeError("the device is gone")

    buf = aioep.Buffer(0x1000, 64, HOST_MEMORY_INFO, release=broken)
    del buf  # nothing raised here
    assert len(reported) == 1
    assert isinstance(reported[0].exc_value, RuntimeError)
    with pytest.raises(RuntimeError, match="the device is gone"):
        aioep.Buffer(0x1000, 64, HOST_MEMORY_INFO, release=broken).free()  # free() raises


def test_a_buffer_whose_constructor_failed_releases_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reported: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    release = _Counter()
    with pytest.raises(aioep.InvalidArgument, match="null"):
        aioep.Buffer(0, 64, HOST_MEMORY_INFO, release=release)
    with pytest.raises(aioep.InvalidArgument, match="MemoryInfo"):
        aioep.Buffer(0x1000, 64, "Cpu", release=release)  # type: ignore[arg-type]
    assert reported == []
    assert release.calls == 0


def test_exiting_with_live_buffers_is_quiet() -> None:
    """Buffers alive at interpreter exit (module globals, an arena's and a plain
    allocator's, one whose release would fail then) are not released into a half
    torn-down interpreter: no traceback."""
    script = textwrap.dedent(
        """
        import sys

        import aioep
        from aioep._environment.host import HostAllocator
        from aioep._memory.arena import ArenaAllocator
        from aioep._plugin.buffer import HOST_MEMORY_INFO

        def release(finalizing=sys.is_finalizing):  # a backend torn down at exit
            if finalizing():
                raise RuntimeError("released into a finalizing interpreter")

        plain = aioep.Buffer(0x1000, 64, HOST_MEMORY_INFO, release=release)

        env = aioep.Environment(autoload=False).open()
        host = env.ep_devices(ep_name="host")[0]
        arena = env.create_shared_allocator(
            host, aioep.MemoryType.DEFAULT, aioep.AllocatorType.ARENA
        )
        kept = [env.empty(64, "uint8"), env.empty(64, "uint8", arena.memory_info)]
        loose = ArenaAllocator(HostAllocator()).alloc(4096)
        cycle = [HostAllocator().alloc(128)]
        cycle.append(cycle)
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert done.stderr == ""
