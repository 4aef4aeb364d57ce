"""The emulated CUDA driver (tests/cuda_emulator) behaves like the driver where the backend relies
on it. Tests that are safe on real hardware also run against the real driver where ``cuInit``
finds a GPU (so the double is checked against the original); the rest (bad handles, fault
injection, the emulator's own statistics) run on the emulator only."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from cuda_emulator import Emulator, select_driver

drv = pytest.importorskip("cuda.bindings.driver")
pytest.importorskip("aioep_cuda")

from aioep_cuda._driver import ctx_current, launch_host_func, load_driver  # noqa: E402

DRIVER = select_driver()
pytestmark = pytest.mark.skipif(not DRIVER.available, reason=DRIVER.reason)
emulator_only = pytest.mark.skipif(DRIVER.emulator is None, reason="checks the emulator itself")

R = drv.CUresult
GEQ = 0


@dataclass
class Cuda:
    ctx: Any
    emulator: Emulator | None

    def ok(self, result: Any) -> Any:
        """Unpack a result tuple, asserting success."""
        err, *values = result if isinstance(result, tuple) else (result,)
        assert err == R.CUDA_SUCCESS, err
        return values[0] if len(values) == 1 else tuple(values) if values else None

    def stream(self) -> Any:
        return self.ok(drv.cuStreamCreate(1))

    def hold(self, stream: Any) -> Any:
        """A device word the stream waits on (>= 1) from now; ``release`` lets it go."""
        word = self.ok(drv.cuMemAlloc(4))
        self.ok(drv.cuMemsetD32(word, 0, 1))
        self.ok(drv.cuStreamWaitValue32(stream, word, 1, GEQ))
        return word

    def release(self, word: Any) -> None:
        self.ok(drv.cuMemsetD32(word, 1, 1))


@pytest.fixture
def cuda() -> Iterator[Cuda]:
    """Device 0's primary context, current on this thread (emulator: one device offered)."""
    emulator = DRIVER.emulator
    if emulator is not None:
        emulator.take_violation()
        emulator.set("devices", 1)
    load_driver()
    dev = drv.cuDeviceGet(0)[1]
    err, ctx = drv.cuDevicePrimaryCtxRetain(dev)
    assert err == R.CUDA_SUCCESS
    try:
        with ctx_current(ctx):
            yield Cuda(ctx, emulator)
            assert drv.cuCtxSynchronize()[0] in (
                R.CUDA_SUCCESS,
                R.CUDA_ERROR_ILLEGAL_ADDRESS,  # a test that made a fault on purpose
                R.CUDA_ERROR_CONTEXT_IS_DESTROYED,  # and reset the contexts after it
            )
    finally:
        drv.cuDevicePrimaryCtxRelease(dev)
        if emulator is not None:
            emulator.reset()
            emulator.clear_faults()
            emulator.set("devices", 0)
    if emulator is not None:
        violation = emulator.take_violation()
        assert violation is None, violation


# -- stream order, events, waits (real driver too) -------------------------------------------
def test_a_held_stream_runs_nothing_until_released(cuda: Cuda) -> None:
    s = cuda.stream()
    src = np.arange(1024, dtype=np.uint32)
    out = np.zeros_like(src)
    host_src = cuda.ok(drv.cuMemHostAlloc(src.nbytes, 3))
    host_out = cuda.ok(drv.cuMemHostAlloc(src.nbytes, 3))
    ctypes.memmove(host_src, src.ctypes.data, src.nbytes)
    ctypes.memset(host_out, 0, src.nbytes)
    dev = cuda.ok(drv.cuMemAlloc(src.nbytes))
    word = cuda.hold(s)
    cuda.ok(drv.cuMemcpyAsync(dev, host_src, src.nbytes, s))
    cuda.ok(drv.cuMemcpyAsync(host_out, dev, src.nbytes, s))
    ev = cuda.ok(drv.cuEventCreate(2))
    cuda.ok(drv.cuEventRecord(ev, s))
    assert drv.cuStreamQuery(s)[0] == R.CUDA_ERROR_NOT_READY
    assert drv.cuEventQuery(ev)[0] == R.CUDA_ERROR_NOT_READY
    ctypes.memmove(out.ctypes.data, host_out, out.nbytes)
    assert not out.any()
    cuda.release(word)
    cuda.ok(drv.cuEventSynchronize(ev))
    assert drv.cuStreamQuery(s)[0] == R.CUDA_SUCCESS
    ctypes.memmove(out.ctypes.data, host_out, out.nbytes)
    np.testing.assert_array_equal(out, src)
    for p in (host_src, host_out):
        cuda.ok(drv.cuMemFreeHost(p))
    cuda.ok(drv.cuMemFree(dev))
    cuda.ok(drv.cuMemFree(word))
    cuda.ok(drv.cuEventDestroy(ev))
    cuda.ok(drv.cuStreamDestroy(s))


def test_a_stream_wait_captures_the_event_as_recorded_then(cuda: Cuda) -> None:
    a, b, c = cuda.stream(), cuda.stream(), cuda.stream()
    ev = cuda.ok(drv.cuEventCreate(2))
    done = cuda.ok(drv.cuEventCreate(2))
    word = cuda.hold(a)
    cuda.ok(drv.cuEventRecord(ev, a))
    cuda.ok(drv.cuStreamWaitEvent(b, ev, 0))
    cuda.ok(drv.cuEventRecord(done, b))
    cuda.ok(drv.cuEventRecord(ev, c))  # re-recorded on an idle stream: b still waits for a
    cuda.ok(drv.cuStreamSynchronize(c))
    assert drv.cuEventQuery(ev)[0] == R.CUDA_SUCCESS
    assert drv.cuEventQuery(done)[0] == R.CUDA_ERROR_NOT_READY
    cuda.release(word)
    cuda.ok(drv.cuEventSynchronize(done))
    for e in (ev, done):
        cuda.ok(drv.cuEventDestroy(e))
    cuda.ok(drv.cuMemFree(word))
    for s in (a, b, c):
        cuda.ok(drv.cuStreamDestroy(s))


def test_event_elapsed_time(cuda: Cuda) -> None:
    s = cuda.stream()
    start, end = cuda.ok(drv.cuEventCreate(0)), cuda.ok(drv.cuEventCreate(0))
    untimed = cuda.ok(drv.cuEventCreate(2))
    word = cuda.hold(s)
    cuda.ok(drv.cuEventRecord(start, s))
    cuda.ok(drv.cuEventRecord(untimed, s))
    cuda.ok(drv.cuEventRecord(end, s))
    assert drv.cuEventElapsedTime(start, end)[0] == R.CUDA_ERROR_NOT_READY
    cuda.release(word)
    cuda.ok(drv.cuEventSynchronize(end))
    assert cuda.ok(drv.cuEventElapsedTime(start, end)) >= 0.0
    assert drv.cuEventElapsedTime(start, untimed)[0] == R.CUDA_ERROR_INVALID_HANDLE
    for e in (start, end, untimed):
        cuda.ok(drv.cuEventDestroy(e))
    cuda.ok(drv.cuMemFree(word))
    cuda.ok(drv.cuStreamDestroy(s))


def test_host_functions_run_in_stream_order_on_a_native_thread(cuda: Cuda) -> None:
    from aioep_cuda._wake import Semaphore

    s = cuda.stream()
    sem = Semaphore()
    word = cuda.hold(s)
    for _ in range(3):
        assert launch_host_func(int(s), Semaphore.post_address, sem.address) == 0
    assert sem.value == 0  # nothing before the held point
    cuda.release(word)
    cuda.ok(drv.cuStreamSynchronize(s))
    assert sem.value == 3
    cuda.ok(drv.cuMemFree(word))
    cuda.ok(drv.cuStreamDestroy(s))


def test_pageable_copies_are_synchronous_for_the_host(cuda: Cuda) -> None:
    s = cuda.stream()
    src = np.arange(4096, dtype=np.uint8)
    out = np.zeros_like(src)
    dev = cuda.ok(drv.cuMemAlloc(src.nbytes))
    cuda.ok(drv.cuMemcpyAsync(dev, src.ctypes.data, src.nbytes, s))
    cuda.ok(drv.cuMemcpyAsync(out.ctypes.data, dev, src.nbytes, s))
    np.testing.assert_array_equal(out, src)  # device-to-pageable returned once it landed
    cuda.ok(drv.cuMemFree(dev))
    cuda.ok(drv.cuStreamDestroy(s))


def test_pinned_memory_flags_and_pointer_attributes(cuda: Cuda) -> None:
    a = drv.CUpointer_attribute
    p = cuda.ok(drv.cuMemHostAlloc(8192, 3))  # portable | devicemap
    assert cuda.ok(drv.cuMemHostGetFlags(p)) & 3 == 3
    assert cuda.ok(drv.cuPointerGetAttribute(a.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p)) == 1
    assert int(cuda.ok(drv.cuMemHostGetDevicePointer(p, 0))) == p  # unified addressing
    d = cuda.ok(drv.cuMemAlloc(256))
    assert cuda.ok(drv.cuPointerGetAttribute(a.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, d)) == 2
    assert cuda.ok(drv.cuPointerGetAttribute(a.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, d)) == 0
    pageable = np.zeros(4096, dtype=np.uint8)
    err = drv.cuPointerGetAttribute(a.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, pageable.ctypes.data)[0]
    assert err == R.CUDA_ERROR_INVALID_VALUE
    page = 4096
    raw = np.zeros(3 * page, dtype=np.uint8)
    aligned = raw.ctypes.data + (-raw.ctypes.data) % page
    cuda.ok(drv.cuMemHostRegister(aligned, page, 0))
    assert cuda.ok(drv.cuPointerGetAttribute(a.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, aligned)) == 1
    assert drv.cuMemHostRegister(aligned, page, 0)[0] == R.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    cuda.ok(drv.cuMemHostUnregister(aligned))
    assert drv.cuMemHostUnregister(aligned)[0] == R.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
    cuda.ok(drv.cuMemFreeHost(p))
    cuda.ok(drv.cuMemFree(d))


def test_out_of_memory(cuda: Cuda) -> None:
    free, total = cuda.ok(drv.cuMemGetInfo())
    assert 0 < free <= total
    assert drv.cuMemAlloc(total * 4)[0] == R.CUDA_ERROR_OUT_OF_MEMORY
    d = cuda.ok(drv.cuMemAlloc(1024))
    cuda.ok(drv.cuMemFree(d))


# -- the emulator only ----------------------------------------------------------------------
@emulator_only
def test_stale_handles_are_recorded_misuses_when_not_aborting(cuda: Cuda) -> None:
    """With ``abort_on_misuse`` 0 a stale handle or freed pointer fails the call and is
    recorded as a violation naming the call; handle values are never reused, so a stale one
    is caught however many objects were made since."""
    assert cuda.emulator is not None
    emu = cuda.emulator
    emu.set("abort_on_misuse", 0)
    s = cuda.stream()
    ev = cuda.ok(drv.cuEventCreate(2))
    d = cuda.ok(drv.cuMemAlloc(64))
    cuda.ok(drv.cuEventDestroy(ev))
    cuda.ok(drv.cuStreamDestroy(s))
    misuses = emu.get("misuses")
    assert drv.cuStreamQuery(s)[0] == R.CUDA_ERROR_INVALID_HANDLE
    assert "cuStreamQuery: stream" in str(emu.take_violation())
    assert drv.cuEventQuery(ev)[0] == R.CUDA_ERROR_INVALID_HANDLE
    assert "destroyed by cuEventDestroy" in str(emu.take_violation())
    assert drv.cuStreamDestroy(s)[0] == R.CUDA_ERROR_INVALID_HANDLE
    assert emu.get("misuses") == misuses + 3
    # a value that was never a handle is an ordinary error, not a misuse
    assert drv.cuStreamQuery(drv.CUstream(0x1234_5678))[0] == R.CUDA_ERROR_INVALID_HANDLE
    assert emu.get("misuses") == misuses + 3
    cuda.ok(drv.cuMemFree(d))
    t = cuda.stream()
    host = np.zeros(64, dtype=np.uint8)
    assert drv.cuMemcpyAsync(host.ctypes.data, d, 64, t)[0] == R.CUDA_ERROR_INVALID_VALUE
    assert "freed by cuMemFree" in str(emu.take_violation())
    assert int(t) != int(s)  # never reused
    cuda.ok(drv.cuStreamDestroy(t))
    emu.take_violation()


@emulator_only
def test_work_that_reaches_freed_memory_faults_and_is_reported(cuda: Cuda) -> None:
    assert cuda.emulator is not None
    s, t = cuda.stream(), cuda.stream()
    d = cuda.ok(drv.cuMemAllocAsync(4096, s))
    host = cuda.ok(drv.cuMemHostAlloc(4096, 0))
    word = cuda.hold(t)
    cuda.ok(drv.cuMemcpyAsync(d, host, 4096, t))  # t reaches it only after the free below
    cuda.ok(drv.cuMemFreeAsync(d, s))
    cuda.ok(drv.cuStreamSynchronize(s))
    # the release may already see the fault (it is sticky for the whole context)
    assert drv.cuMemsetD32(word, 1, 1)[0] in (R.CUDA_SUCCESS, R.CUDA_ERROR_ILLEGAL_ADDRESS)
    assert drv.cuStreamSynchronize(t)[0] == R.CUDA_ERROR_ILLEGAL_ADDRESS
    violation = cuda.emulator.take_violation()
    assert violation is not None
    assert "not allocated" in violation
    cuda.emulator.reset_contexts()  # the only way back from a sticky error
    with pytest.raises(AssertionError):  # (the context handle is stale now)
        cuda.ok(drv.cuStreamCreate(1))


@emulator_only
def test_use_before_a_stream_ordered_allocation_is_reported(cuda: Cuda) -> None:
    assert cuda.emulator is not None
    a, b = cuda.stream(), cuda.stream()
    word = cuda.hold(a)
    d = cuda.ok(drv.cuMemAllocAsync(256, a))  # allocated when a gets here
    cuda.ok(drv.cuMemsetD32Async(d, 7, 64, b))  # b does not wait for a
    cuda.ok(drv.cuStreamSynchronize(b))
    violation = cuda.emulator.take_violation()
    assert violation is not None
    assert "before stream" in violation
    cuda.release(word)
    cuda.ok(drv.cuMemFreeAsync(d, a))
    cuda.ok(drv.cuStreamSynchronize(a))
    cuda.ok(drv.cuMemFree(word))
    for s in (a, b):
        cuda.ok(drv.cuStreamDestroy(s))


@emulator_only
def test_fault_injection_and_configuration(cuda: Cuda) -> None:
    assert cuda.emulator is not None
    emu = cuda.emulator
    emu.fail_call("cuMemAlloc", after=1, times=2, code=2)
    d1 = cuda.ok(drv.cuMemAlloc(64))  # the first call goes through
    assert drv.cuMemAlloc(64)[0] == R.CUDA_ERROR_OUT_OF_MEMORY
    assert drv.cuMemAlloc(64)[0] == R.CUDA_ERROR_OUT_OF_MEMORY
    d2 = cuda.ok(drv.cuMemAlloc(64))
    emu.set("memory_limit", emu.get("device_used") + 1000)
    assert drv.cuMemAlloc(2000)[0] == R.CUDA_ERROR_OUT_OF_MEMORY
    assert int(cuda.ok(drv.cuDeviceTotalMem(0))) == emu.get("memory_limit")
    emu.set("stream_mem_ops", 0)
    s = cuda.stream()
    assert drv.cuStreamWaitValue32(s, d1, 1, GEQ)[0] == R.CUDA_ERROR_NOT_SUPPORTED
    emu.reset()
    for d in (d1, d2):
        cuda.ok(drv.cuMemFree(d))
    cuda.ok(drv.cuStreamDestroy(s))
    with pytest.raises(KeyError):
        emu.set("no_such_setting", 1)


@emulator_only
def test_functions_it_does_not_emulate_are_not_found(cuda: Cuda) -> None:
    with pytest.raises(Exception, match="not found"):
        drv.cuGraphCreate(0)


@emulator_only
def test_streams_and_host_functions_are_native_threads(cuda: Cuda) -> None:
    assert cuda.emulator is not None
    before = set(threading.enumerate())
    live = cuda.emulator.get("threads_live")
    streams = [cuda.stream() for _ in range(4)]
    assert cuda.emulator.get("threads_live") >= live + 4
    assert set(threading.enumerate()) == before  # not Python threads: they never take the GIL
    for s in streams:
        cuda.ok(drv.cuStreamDestroy(s))
