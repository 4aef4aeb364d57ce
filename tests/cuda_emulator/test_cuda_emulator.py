"""The emulated CUDA driver (tests/cuda_emulator) behaves like the driver where the backend relies
on it. Tests that are safe on real hardware also run against the real driver where ``cuInit``
finds a GPU (so the double is checked against the original); the rest (bad handles, fault
injection, the emulator's own statistics) run on the emulator only."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from cuda_emulator import Emulator, child_env, select_driver

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
    created = cuda.emulator.get("streams_created")
    streams = [cuda.stream() for _ in range(4)]
    # (threads of earlier tests' destroyed streams may still be ending: no delta of threads_live)
    assert cuda.emulator.get("streams_created") == created + 4
    assert cuda.emulator.get("threads_live") >= 4
    assert set(threading.enumerate()) == before  # not Python threads: they never take the GIL
    for s in streams:
        cuda.ok(drv.cuStreamDestroy(s))


# -- the strict rules (README.md, "Strict rules") ----------------------------------------------
# A misuse aborts the process: those scenarios run in a child process (ctypes on the emulator,
# one device) and the test checks the abort and the one line that names the call.
_PRELUDE = """
import ctypes, threading, time
L = ctypes.CDLL("libcuda.so.1")
V, U, Z = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
L.cuemu_set.argtypes = [ctypes.c_char_p, ctypes.c_longlong]
L.cuemu_get.argtypes = [ctypes.c_char_p]
L.cuemu_get.restype = ctypes.c_longlong
L.cuemu_mark_loop_thread.argtypes = [ctypes.c_long]

def ok(rc, what):
    assert rc == 0, f"{what} failed: {rc}"

def emu_set(key, value):
    assert L.cuemu_set(key.encode(), value) == 0, key

def emu_get(key):
    return L.cuemu_get(key.encode())

def until(predicate, what):
    deadline = time.monotonic() + 20
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)

def retain():
    ctx = V()
    ok(L.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "retain")
    ok(L.cuCtxPushCurrent_v2(ctx), "push")
    return ctx

def release():
    ok(L.cuCtxPopCurrent_v2(None), "pop")
    ok(L.cuDevicePrimaryCtxRelease_v2(0), "release")

def stream():
    s = V()
    ok(L.cuStreamCreate(ctypes.byref(s), 1), "cuStreamCreate")
    return s

def event():
    e = V()
    ok(L.cuEventCreate(ctypes.byref(e), 2), "cuEventCreate")
    return e

def dalloc(n):
    p = U()
    ok(L.cuMemAlloc_v2(ctypes.byref(p), Z(n)), "cuMemAlloc")
    return p.value

def halloc(n, flags=0):
    p = V()
    ok(L.cuMemHostAlloc(ctypes.byref(p), Z(n), flags), "cuMemHostAlloc")
    return p.value

def copy(dst, src, n, s):
    return L.cuMemcpyAsync(U(dst), U(src), Z(n), s)

def hold(s):
    '''Hold stream s on the device until release_word(word): a wait on mapped pinned memory,
    released by a plain host write (no driver call).'''
    word = halloc(4, 3)
    ctypes.memset(word, 0, 4)
    ok(L.cuStreamWaitValue32_v2(s, U(word), 1, 0), "cuStreamWaitValue32")
    return word

def release_word(word):
    ctypes.c_uint32.from_address(word).value = 1

ok(L.cuInit(0), "cuInit")
"""


def _child(body: str) -> subprocess.CompletedProcess[str]:
    assert DRIVER.emulator is not None
    env = child_env(DRIVER.emulator.path)
    env["CUEMU_HOST_WAIT_LIMIT_S"] = "20"
    return subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(body) + "\nprint('SURVIVED')\n"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _assert_aborts(body: str, *fragments: str) -> str:
    """Run ``body`` in a child: it must abort with one MISUSE line containing ``fragments``."""
    done = _child(body)
    said = done.stdout + done.stderr
    assert done.returncode == -signal.SIGABRT, f"exit {done.returncode}:\n{said}"
    assert "SURVIVED" not in done.stdout
    lines = [line for line in done.stderr.splitlines() if "MISUSE" in line]
    assert len(lines) == 1, said
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _assert_survives(body: str) -> None:
    done = _child(body)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SURVIVED" in done.stdout, done.stdout + done.stderr


# Rule 3: a handle or pointer used after it, or its context, was destroyed aborts.
_USE_AFTER_DESTROY = {
    "event": (
        """
        retain(); s = stream(); ev = event()
        ok(L.cuEventDestroy_v2(ev), "cuEventDestroy")
        L.cuEventRecord(ev, s)
        """,
        ("cuEventRecord: event", "destroyed by cuEventDestroy"),
    ),
    "event of a released context, retained again": (  # the crash seen on a real GPU
        """
        old = retain(); ev = event()
        release()
        new = retain()
        assert new.value != old.value  # a new context: new identity
        s = stream(); ok(L.cuEventRecord(event(), s), "a new event works")
        L.cuEventDestroy_v2(ev)  # e.g. from a garbage collection in the next test
        """,
        (
            "cuEventDestroy: event",
            "its context was destroyed by the last cuDevicePrimaryCtxRelease",
        ),
    ),
    "stream": (
        """
        retain(); s = stream()
        ok(L.cuStreamDestroy_v2(s), "cuStreamDestroy")
        for _ in range(100): stream()  # handle values are never reused
        L.cuStreamQuery(s)
        """,
        ("cuStreamQuery: stream", "destroyed by cuStreamDestroy"),
    ),
    "stream of a released context": (
        """
        retain(); s = stream(); release(); retain()
        L.cuLaunchHostFunc(s, ctypes.cast(L.cuemu_identity, V), None)
        """,
        ("cuLaunchHostFunc: stream", "its context was destroyed"),
    ),
    "context": (
        """
        old = retain(); release(); retain()
        L.cuCtxPushCurrent_v2(old)
        """,
        ("cuCtxPushCurrent: context", "destroyed by the last cuDevicePrimaryCtxRelease"),
    ),
    "device memory": (
        """
        retain(); s = stream(); d = dalloc(4096); h = halloc(4096)
        ok(L.cuMemFree_v2(U(d)), "cuMemFree")
        copy(d, h, 4096, s)
        """,
        ("cuMemcpyAsync: device pointer", "freed by cuMemFree"),
    ),
    "device memory freed twice": (
        """
        retain(); d = dalloc(4096)
        ok(L.cuMemFree_v2(U(d)), "cuMemFree")
        L.cuMemFree_v2(U(d))
        """,
        ("cuMemFree: device pointer", "freed by cuMemFree"),
    ),
    "stream-ordered free twice": (
        """
        retain(); s = stream(); word = hold(s); d = dalloc(4096)
        ok(L.cuMemFreeAsync(U(d), s), "cuMemFreeAsync")
        L.cuMemFreeAsync(U(d), s)
        """,
        ("cuMemFreeAsync: device pointer", "freed twice"),
    ),
    "pinned memory": (
        """
        retain(); s = stream(); d = dalloc(4096); h = halloc(4096)
        ok(L.cuMemFreeHost(V(h)), "cuMemFreeHost")
        copy(d, h, 4096, s)
        """,
        ("cuMemcpyAsync: pinned host pointer", "freed by cuMemFreeHost"),
    ),
    "pinned memory of a released context": (
        """
        retain(); h = halloc(4096); release(); retain(); s = stream(); d = dalloc(4096)
        copy(d, h, 4096, s)
        """,
        ("cuMemcpyAsync: pinned host pointer", "its context was destroyed"),
    ),
}


@emulator_only
@pytest.mark.parametrize("case", list(_USE_AFTER_DESTROY))
def test_use_after_destroy_aborts_naming_the_call(case: str) -> None:
    body, fragments = _USE_AFTER_DESTROY[case]
    _assert_aborts(body, *fragments)


@emulator_only
def test_a_destroyed_current_context_is_an_error_not_an_abort() -> None:
    # CUDA documents CUDA_ERROR_CONTEXT_IS_DESTROYED (709) for a current context destroyed.
    _assert_survives(
        """
        retain(); ok(L.cuDevicePrimaryCtxRelease_v2(0), "release")
        s = V(); assert L.cuStreamCreate(ctypes.byref(s), 1) == 709
        """
    )


# Rule 4: host functions must not call the driver.
@emulator_only
def test_a_host_function_that_calls_the_driver_aborts() -> None:
    _assert_aborts(
        """
        retain(); s = stream(); ev = event()
        HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        cb = HOSTFN(lambda _: L.cuEventQuery(ev))
        ok(L.cuLaunchHostFunc(s, cb, None), "cuLaunchHostFunc")
        L.cuStreamSynchronize(s)
        """,
        "cuEventQuery called from a host function",
    )


@emulator_only
def test_a_host_function_calling_the_driver_is_a_recorded_misuse_when_not_aborting(
    cuda: Cuda,
) -> None:
    assert cuda.emulator is not None
    emu = cuda.emulator
    emu.set("abort_on_misuse", 0)
    lib = emu.lib
    s = cuda.stream()
    seen: list[int] = []
    hostfn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(
        lambda _: seen.append(lib.cuStreamQuery(ctypes.c_void_p(int(s))))
    )
    assert lib.cuLaunchHostFunc(ctypes.c_void_p(int(s)), hostfn, None) == 0
    assert lib.cuStreamSynchronize(ctypes.c_void_p(int(s))) == 0  # ctypes: the GIL is let go
    assert seen == [800]  # CUDA_ERROR_NOT_PERMITTED
    violation = emu.take_violation()
    assert violation is not None
    assert "cuStreamQuery called from a host function" in violation
    cuda.ok(drv.cuStreamDestroy(s))


# Rule 1: a context-synchronising call holds the context; other threads' calls wait.
def _until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _mapped_hold(cuda: Cuda, stream: Any) -> tuple[Any, ctypes.c_uint32]:
    """Hold ``stream`` on a mapped pinned word that a plain host write releases (a driver call
    could itself wait behind a synchronising call)."""
    word = cuda.ok(drv.cuMemHostAlloc(4, 3))
    flag = ctypes.c_uint32.from_address(int(word))
    flag.value = 0
    cuda.ok(drv.cuStreamWaitValue32(stream, word, 1, GEQ))
    return word, flag


@emulator_only
@pytest.mark.parametrize("sync_call", ["cuMemFreeHost", "cuMemFree", "cuCtxSynchronize"])
def test_a_synchronising_call_holds_the_context_until_every_stream_is_idle(
    cuda: Cuda, sync_call: str
) -> None:
    assert cuda.emulator is not None
    emu, lib = cuda.emulator, cuda.emulator.lib
    held = cuda.stream()
    word, flag = _mapped_hold(cuda, held)
    victim_host = cuda.ok(drv.cuMemHostAlloc(4096, 0))
    victim_dev = cuda.ok(drv.cuMemAlloc(4096))
    pinned_before, device_before = emu.get("pinned_used"), emu.get("device_used")
    results: dict[str, Any] = {}

    def synchronise() -> None:
        with ctx_current(cuda.ctx):
            if sync_call == "cuMemFreeHost":
                results["sync"] = lib.cuMemFreeHost(ctypes.c_void_p(int(victim_host)))
            elif sync_call == "cuMemFree":
                results["sync"] = lib.cuMemFree_v2(ctypes.c_uint64(int(victim_dev)))
            else:
                results["sync"] = lib.cuCtxSynchronize()

    def create_a_stream() -> None:
        out = ctypes.c_void_p()
        with ctx_current(cuda.ctx):
            results["create"] = lib.cuStreamCreate(ctypes.byref(out), 1)
        # what the synchronising call did is visible once this call got through
        results["used"] = (emu.get("pinned_used"), emu.get("device_used"))
        results["stream"] = out.value

    calls, waits = emu.get("sync_calls"), emu.get("sync_waits")
    first = threading.Thread(target=synchronise)
    first.start()
    _until(lambda: emu.get("sync_calls") > calls and emu.get("host_waiting") >= 1, "the sync")
    second = threading.Thread(target=create_a_stream)
    second.start()
    _until(lambda: emu.get("sync_waiting") == 1, "cuStreamCreate to queue behind it")
    assert first.is_alive()
    assert second.is_alive()
    assert "create" not in results
    flag.value = 1  # the held stream runs: the synchronising call ends, then cuStreamCreate
    first.join(30)
    second.join(30)
    assert results["sync"] == 0
    assert results["create"] == 0
    assert emu.get("sync_waits") == waits + 1
    expected = {
        "cuMemFreeHost": (pinned_before - 4096, device_before),
        "cuMemFree": (pinned_before, device_before - 4096),
        "cuCtxSynchronize": (pinned_before, device_before),
    }[sync_call]
    assert results["used"] == expected
    cuda.ok(drv.cuStreamDestroy(drv.CUstream(results["stream"])))
    cuda.ok(drv.cuStreamDestroy(held))
    if sync_call != "cuMemFreeHost":
        cuda.ok(drv.cuMemFreeHost(victim_host))
    if sync_call != "cuMemFree":
        cuda.ok(drv.cuMemFree(victim_dev))
    cuda.ok(drv.cuMemFreeHost(word))


# Rule 2: a pageable copy larger than the staging limit waits for its stream.
@emulator_only
def test_a_large_pageable_copy_waits_for_its_stream_a_small_one_is_staged(cuda: Cuda) -> None:
    assert cuda.emulator is not None
    emu, lib = cuda.emulator, cuda.emulator.lib
    emu.set("pageable_staging_limit", 64 << 10)
    s = cuda.stream()
    dev = cuda.ok(drv.cuMemAlloc(1 << 20))
    word, flag = _mapped_hold(cuda, s)
    small = np.arange(16 << 10, dtype=np.uint8)
    big = np.random.default_rng(5).integers(0, 256, size=1 << 20, dtype=np.uint8)
    cuda.ok(drv.cuMemcpyAsync(dev, small.ctypes.data, small.nbytes, s))  # staged: at once
    assert drv.cuStreamQuery(s)[0] == R.CUDA_ERROR_NOT_READY
    result: list[int] = []

    def copy_big() -> None:
        with ctx_current(cuda.ctx):
            result.append(
                lib.cuMemcpyAsync(
                    ctypes.c_uint64(int(dev)),
                    ctypes.c_uint64(big.ctypes.data),
                    ctypes.c_size_t(big.nbytes),
                    ctypes.c_void_p(int(s)),
                )
            )

    waiting = emu.get("host_waiting")
    thread = threading.Thread(target=copy_big)
    thread.start()
    _until(lambda: emu.get("host_waiting") == waiting + 1, "the large copy to wait")
    assert thread.is_alive()
    assert not result
    flag.value = 1
    thread.join(30)
    assert result == [0]
    assert drv.cuStreamQuery(s)[0] == R.CUDA_SUCCESS  # it returned once the stream did it
    back = np.zeros_like(big)
    cuda.ok(drv.cuMemcpyAsync(back.ctypes.data, dev, back.nbytes, s))
    np.testing.assert_array_equal(back, big)
    cuda.ok(drv.cuMemFree(dev))
    cuda.ok(drv.cuMemFreeHost(word))
    cuda.ok(drv.cuStreamDestroy(s))


# Rule 5: a marked event-loop thread must never wait in the driver.
_LOOP_WAITS = {
    "cuStreamSynchronize": "L.cuStreamSynchronize(s)",  # even on an idle stream: structural
    "cuEventSynchronize": "ok(L.cuEventRecord(ev, s), 'record'); L.cuEventSynchronize(ev)",
    "cuCtxSynchronize": "L.cuCtxSynchronize()",
    "cuMemFree": "L.cuMemFree_v2(U(d))",
    "cuMemFreeHost": "L.cuMemFreeHost(V(h))",
    "cuMemcpyAsync": "copy(d, big_addr, 8 << 20, s)",  # pageable, above the 4 MiB staging
    "cuMemcpyDtoH": "L.cuMemcpyDtoH_v2(V(h), U(d), Z(4096))",
    "cuDevicePrimaryCtxRelease": "ok(L.cuCtxPopCurrent_v2(None), 'pop'); L.cuDevicePrimaryCtxRelease_v2(0)",
}


@emulator_only
@pytest.mark.parametrize("call", list(_LOOP_WAITS))
def test_a_marked_loop_thread_that_waits_for_the_device_aborts(call: str) -> None:
    _assert_aborts(
        """
        retain(); s = stream(); ev = event(); d = dalloc(8 << 20); h = halloc(4096)
        big = ctypes.create_string_buffer(8 << 20); big_addr = ctypes.addressof(big)
        assert L.cuemu_mark_loop_thread(0) == 0
        """
        + _LOOP_WAITS[call],
        f"{call} called on the marked event-loop thread",
        "waits for the device",
    )


@emulator_only
def test_a_marked_loop_thread_behind_another_threads_synchronising_call_aborts() -> None:
    _assert_aborts(
        """
        emu_set("strict_loop_sync", 0)  # the free itself is allowed here: see the next test
        retain(); ctx = V(); ok(L.cuCtxGetCurrent(ctypes.byref(ctx)), "current")
        s = stream(); other = stream(); ev = event(); victim = halloc(4096); word = hold(s)
        def free():
            ok(L.cuCtxPushCurrent_v2(ctx), "push")
            L.cuMemFreeHost(V(victim))
        threading.Thread(target=free, daemon=True).start()
        until(lambda: emu_get("sync_calls") == 1 and emu_get("host_waiting") == 1, "the free")
        assert L.cuemu_mark_loop_thread(0) == 0
        L.cuEventRecord(ev, other)  # the loop's next call: behind the free
        """,
        "cuEventRecord called on the marked event-loop thread",
        "waits behind cuMemFreeHost",
    )


@emulator_only
def test_a_synchronising_call_with_work_in_flight_while_a_loop_is_marked_aborts() -> None:
    # Deterministic: the hazard is caught whether or not the loop calls in the window.
    _assert_aborts(
        """
        retain(); s = stream(); victim = halloc(4096); word = hold(s)
        assert L.cuemu_mark_loop_thread(0) == 0
        def free():
            retain()
            L.cuMemFreeHost(V(victim))
        t = threading.Thread(target=free); t.start(); t.join()
        """,
        "cuMemFreeHost on thread",
        "while work is in flight and an event-loop thread is marked",
    )


@emulator_only
def test_a_marked_loop_thread_may_enqueue_record_and_query(cuda: Cuda) -> None:
    """Calls that only enqueue, record or look are fine on the loop (none is a misuse), and an
    unmarked thread may wait; with ``abort_on_misuse`` 0 a waiting call is recorded."""
    from aioep_cuda._wake import Semaphore

    assert cuda.emulator is not None
    emu = cuda.emulator
    emu.set("abort_on_misuse", 0)
    emu.set("watch_tid", threading.get_native_id())
    misuses = emu.get("misuses")
    watched = emu.get("watched_blocking")
    with emu.loop_thread():
        s, t = cuda.stream(), cuda.stream()
        ev = cuda.ok(drv.cuEventCreate(2))
        pinned = cuda.ok(drv.cuMemHostAlloc(4096, 0))
        dev = cuda.ok(drv.cuMemAllocAsync(4096, s))
        small = np.ones(4096, dtype=np.uint8)
        cuda.ok(drv.cuMemcpyAsync(dev, small.ctypes.data, 4096, s))  # staged
        cuda.ok(drv.cuMemcpyAsync(dev, pinned, 4096, s))
        cuda.ok(drv.cuMemcpyAsync(pinned, dev, 4096, s))
        plain = cuda.ok(drv.cuMemAlloc(64))
        cuda.ok(drv.cuMemsetD32(plain, 7, 16))  # device memory: asynchronous for the host
        cuda.ok(drv.cuMemsetD32Async(dev, 7, 16, s))
        cuda.ok(drv.cuEventRecord(ev, s))
        cuda.ok(drv.cuStreamWaitEvent(t, ev, 0))
        assert drv.cuEventQuery(ev)[0] in (R.CUDA_SUCCESS, R.CUDA_ERROR_NOT_READY)
        assert drv.cuStreamQuery(s)[0] in (R.CUDA_SUCCESS, R.CUDA_ERROR_NOT_READY)
        sem = Semaphore()
        assert launch_host_func(int(s), Semaphore.post_address, sem.address) == 0
        cuda.ok(drv.cuMemFreeAsync(dev, s))
        assert (emu.get("misuses"), emu.get("watched_blocking")) == (misuses, watched)
        cuda.ok(drv.cuStreamSynchronize(s))  # a wait: recorded, not aborted
        assert (emu.get("misuses"), emu.get("watched_blocking")) == (misuses + 1, watched + 1)
        violation = emu.take_violation()
        assert violation is not None
        assert "cuStreamSynchronize called on the marked" in violation
    assert emu.get("loop_threads") == 0
    cuda.ok(drv.cuStreamSynchronize(t))  # unmarked: waiting is fine
    assert emu.get("misuses") == misuses + 1
    assert sem.value == 1
    cuda.ok(drv.cuMemFree(plain))
    cuda.ok(drv.cuEventDestroy(ev))
    cuda.ok(drv.cuMemFreeHost(pinned))
    for x in (s, t):
        cuda.ok(drv.cuStreamDestroy(x))


@emulator_only
def test_the_watched_thread_can_count_as_a_loop_thread(cuda: Cuda) -> None:
    assert cuda.emulator is not None
    emu = cuda.emulator
    emu.set("abort_on_misuse", 0)
    emu.set("watch_tid", threading.get_native_id())
    s = cuda.stream()
    misuses = emu.get("misuses")
    cuda.ok(drv.cuStreamSynchronize(s))
    assert emu.get("misuses") == misuses  # watched only: counted, not refused
    emu.set("watch_is_loop", 1)
    cuda.ok(drv.cuStreamSynchronize(s))
    assert emu.get("misuses") == misuses + 1
    violation = emu.take_violation()
    assert violation is not None
    assert "cuStreamSynchronize called on the marked event-loop thread" in violation
    emu.set("watch_is_loop", 0)  # the fixture releases the context on this thread
    cuda.ok(drv.cuStreamDestroy(s))


@emulator_only
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=hs.lists(
        hs.tuples(hs.sampled_from(["stream", "event", "destroy", "use"]), hs.integers(0, 1 << 16)),
        max_size=40,
    )
)
def test_every_stale_handle_is_caught_however_many_were_made_since(
    cuda: Cuda, ops: list[tuple[str, int]]
) -> None:
    """Any interleaving of creating, destroying and using streams and events: a live handle
    works, a destroyed one is a misuse every time, and no value is ever handed out twice."""
    assert cuda.emulator is not None
    emu = cuda.emulator
    emu.set("abort_on_misuse", 0)
    live: dict[int, tuple[str, Any]] = {}
    dead: dict[int, str] = {}
    seen: set[int] = set()
    for op, pick in ops:
        if op in ("stream", "event"):
            handle = cuda.stream() if op == "stream" else cuda.ok(drv.cuEventCreate(2))
            assert int(handle) not in seen  # never reused
            seen.add(int(handle))
            live[int(handle)] = (op, handle)
        elif op == "destroy" and live:
            key = sorted(live)[pick % len(live)]
            kind, handle = live.pop(key)
            destroy = drv.cuStreamDestroy if kind == "stream" else drv.cuEventDestroy
            cuda.ok(destroy(handle))
            dead[key] = kind
        elif op == "use" and (live or dead):
            keys = sorted(live) + sorted(dead)
            key = keys[pick % len(keys)]
            kind = live[key][0] if key in live else dead[key]
            query = drv.cuStreamQuery if kind == "stream" else drv.cuEventQuery
            handle = drv.CUstream(key) if kind == "stream" else drv.CUevent(key)
            misuses = emu.get("misuses")
            err = query(handle)[0]
            if key in live:
                assert err == R.CUDA_SUCCESS
                assert emu.get("misuses") == misuses
            else:
                assert err == R.CUDA_ERROR_INVALID_HANDLE
                assert emu.get("misuses") == misuses + 1
                violation = emu.take_violation()
                assert violation is not None
                assert f"{kind} {key:#x} used after it was destroyed" in violation
    for kind, handle in live.values():
        cuda.ok((drv.cuStreamDestroy if kind == "stream" else drv.cuEventDestroy)(handle))
    emu.set("abort_on_misuse", 1)


@emulator_only
def test_a_sticky_error_drops_queued_work_so_a_synchronising_call_returns_it() -> None:
    # As on the real driver: once a fault breaks the context its queued work is dropped at
    # once, a stream held by a wait on device memory included, so a synchronising call on
    # another thread (the loop marked) has nothing to wait for and returns the error.
    _assert_survives(
        """
        retain(); s = stream(); s2 = stream(); victim = halloc(4096)
        word = dalloc(4)
        ok(L.cuMemsetD32_v2(U(word), 0, Z(1)), "cuMemsetD32")
        ok(L.cuStreamWaitValue32_v2(s, U(word), 1, 0), "cuStreamWaitValue32")
        a, b = dalloc(64), dalloc(64)
        ok(copy(a, b, 64, s), "cuMemcpyAsync behind the wait")
        emu_set("lose_after_copies", 0)
        ok(copy(a, b, 64, s2), "cuMemcpyAsync that faults")
        until(lambda: emu_get("sticky") != 0, "the sticky error")
        assert L.cuemu_mark_loop_thread(0) == 0
        rc = []
        def free():
            retain()
            rc.append(L.cuMemFreeHost(V(victim)))
        t = threading.Thread(target=free); t.start(); t.join()
        assert len(rc) == 1, rc  # returned (no abort, no wait for the held stream)
        assert L.cuStreamQuery(s) == 700  # CUDA_ERROR_ILLEGAL_ADDRESS, the sticky error
        """
    )
