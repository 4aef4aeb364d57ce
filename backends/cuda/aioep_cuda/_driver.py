"""The one boundary to the CUDA driver: loading it, checking results, contexts.

``cuda.bindings.driver`` is imported lazily, so ``import aioep_cuda`` works on a
machine without cuda-bindings or without a driver. Every driver call goes
through `check`, which turns a ``CUresult`` into `aioep.DeviceError`
(the translation boundary).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any

from aioep import DeviceError

__all__ = [
    "call_nogil",
    "check",
    "ctx_current",
    "driver",
    "error_name",
    "launch_host_func",
    "load_driver",
]

_driver: Any = None
_libcuda: ctypes.CDLL | None = None
_launch: Any = None
_load_lock = threading.Lock()
_nogil: dict[str, Any] = {}
_u64, _ptr, _size = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
_NOGIL_ARGS: dict[str, list[Any]] = {
    "cuEventSynchronize": [_ptr],
    "cuStreamSynchronize": [_ptr],
    "cuCtxSynchronize": [],
    "cuMemFree_v2": [_u64],
    "cuMemFreeHost": [_ptr],
    "cuMemcpyAsync": [_u64, _u64, _size, _ptr],
}


def load_driver() -> Any:
    """Import ``cuda.bindings.driver`` and run ``cuInit(0)``; return the module.

    Raises:
        RuntimeError: with a message that says what is missing (bindings, driver
            library, or a failing ``cuInit``).
    """
    global _driver
    with _load_lock:
        if _driver is not None:
            return _driver
        try:
            from cuda.bindings import driver as drv
        except ImportError as exc:  # pragma: no cover - a dependency of the distribution
            raise DeviceError(f"cuda-bindings is not installed ({exc})") from exc
        try:
            result = drv.cuInit(0)
        except Exception as exc:  # cuda-pathfinder raises when libcuda.so.1 is missing
            raise DeviceError(
                f"the NVIDIA driver library (libcuda.so.1) could not be loaded: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        err = result[0]
        if err != drv.CUresult.CUDA_SUCCESS:
            raise DeviceError(f"cuInit failed with {_name(drv, err)}")
        _driver = drv
        return drv


def driver() -> Any:
    """The loaded ``cuda.bindings.driver`` module (after `load_driver`)."""
    if _driver is None:
        return load_driver()
    return _driver


def _name(drv: Any, err: Any) -> str:
    try:
        res, name = drv.cuGetErrorName(err)
        if res == drv.CUresult.CUDA_SUCCESS and name:
            return str(name.decode() if isinstance(name, bytes) else name)
    except Exception:
        pass
    return f"CUresult {int(err)}"


def error_name(err: Any) -> str:
    """``CUDA_ERROR_...`` name of a ``CUresult``."""
    return _name(driver(), err)


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-bindings result tuple: raise `DeviceError` on failure.

    Returns None, the single value, or the tuple of values after the status.
    """
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    drv = driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        raise DeviceError(f"{what} failed: {_name(drv, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


@contextlib.contextmanager
def ctx_current(ctx: Any) -> Iterator[None]:
    """Make ``ctx`` current for the block and restore the thread's previous context after.

    Push/pop leaves the caller's own CUDA state (PyTorch, CuPy) exactly as it was.
    """
    drv = driver()
    check(drv.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        yield
    finally:
        drv.cuCtxPopCurrent()


def _lib() -> ctypes.CDLL:
    global _libcuda
    if _libcuda is None:
        # The same libcuda.so.1 that cuda-bindings loaded (dlopen returns the loaded handle).
        _libcuda = ctypes.CDLL("libcuda.so.1")
    return _libcuda


def call_nogil(name: str, *args: int) -> Any:
    """Call a driver function that can block through ctypes, which releases the GIL.

    ``name`` is one of the driver's exported symbols listed in ``_NOGIL_ARGS``: the
    synchronisations, the frees that synchronise the device, and ``cuMemcpyAsync`` for
    pageable memory (synchronous for the host). cuda-bindings before 12.9.x / 13.0 holds
    the GIL for the whole call, so a thread waiting there would stall every Python thread:
    the event loop, and the dispatcher and copy threads the device may be waiting for.
    Handles and pointers are passed as ints; returns the ``CUresult``.
    """
    fn = _nogil.get(name)
    if fn is None:
        fn = getattr(_lib(), name)
        fn.restype = ctypes.c_int
        fn.argtypes = _NOGIL_ARGS[name]
        _nogil[name] = fn
    return driver().CUresult(fn(*args))


def _load_launch() -> Any:
    global _launch
    if _launch is None:
        fn = _lib().cuLaunchHostFunc
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _launch = fn
    return _launch


def launch_host_func(stream: int, fn: int, user_data: int) -> int:
    """Call the driver's ``cuLaunchHostFunc`` directly with a raw C function pointer.

    Going through ctypes (not cuda-bindings' wrapper, which may route the call
    through a Cython trampoline that takes the GIL) guarantees the driver
    thread calls ``fn(user_data)`` itself and never enters Python. Returns the
    ``CUresult`` as an int (0 on success).
    """
    return int(_load_launch()(stream, fn, user_data))
