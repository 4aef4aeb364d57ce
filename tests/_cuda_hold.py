"""Hold a CUDA stream back on the device until the test lets it go, on the real driver and
the emulator alike (importable as ``_cuda_hold``)."""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import aioep

WAIT_VALUE_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ


@contextlib.contextmanager
def hold_stream(stream: aioep.SyncStream) -> Iterator[Callable[[], None]]:
    """Hold ``stream`` back on the device until the returned ``release()`` is called or the
    block ends (see `hold_cu`)."""
    impl = stream.impl
    with hold_cu(impl.device, impl.cu, impl.lock, impl.enqueued) as release:
        yield release


@contextlib.contextmanager
def hold_cu(
    dev: Any, cu: Any, lock: Any = None, enqueued: Callable[[], None] | None = None
) -> Iterator[Callable[[], None]]:
    """Hold the stream ``cu`` of ``dev`` back on the device (``cuStreamWaitValue32`` on a word
    of mapped pinned memory from the device's pool) until ``release()`` writes the word from
    the host. Same on the real driver and the emulator; no driver call that waits, and
    nothing allocated or destroyed outside the backend's pools."""
    from aioep_cuda._driver import check, ctx_current, driver

    drv = driver()
    block = dev.pinned.take(4)
    word = ctypes.c_uint32.from_address(block.ptr)
    word.value = 0
    with contextlib.ExitStack() as stack:
        if lock is not None:
            stack.enter_context(lock)
        with ctx_current(dev.ctx):
            err = drv.cuStreamWaitValue32(cu, block.ptr, 1, WAIT_VALUE_GEQ)[0]
            if err == drv.CUresult.CUDA_ERROR_NOT_SUPPORTED:
                dev.pinned.give(block)
                pytest.skip("this driver has no stream memory operations")
            check(err, "cuStreamWaitValue32")
            passed = dev.events.take()
            check(drv.cuEventRecord(passed, cu), "cuEventRecord")
        if enqueued is not None:
            enqueued()
            enqueued()

    def release() -> None:
        word.value = 1

    try:
        yield release
    finally:
        release()
        # The word goes back to the pool once the stream is past the wait; if it never gets
        # there (the test failed), it stays taken rather than be reused under the wait.
        deadline = time.monotonic() + 10
        while drv.cuEventQuery(passed)[0] == drv.CUresult.CUDA_ERROR_NOT_READY:
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
        else:
            dev.pinned.give(block)
            dev.events.give(passed)
