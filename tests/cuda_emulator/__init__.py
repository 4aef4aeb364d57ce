"""The emulated CUDA driver (a test double) and how the CUDA tests choose a driver.

``emulator.c`` in this folder is a small C library that cuda-bindings loads in place of
``libcuda.so.1`` (see its header comment and README.md). It is compiled at test time with
the system C compiler into a cache folder under the temporary directory, and:

* in the test process, loaded with ``RTLD_GLOBAL`` before cuda-bindings first looks for
  the driver: cuda-pathfinder takes a ``libcuda.so.1`` that is already loaded, and so
  does aioep_cuda's own ``ctypes.CDLL("libcuda.so.1")``;
* in a child process (``python -m aioep check-gpu --emulator``, the benchmark), found
  through ``LD_LIBRARY_PATH`` (`child_env`).

`select_driver` decides, once per process: the real driver when ``cuInit`` finds a
GPU there (probed in a child process, so this one stays clean), else the emulator when a
C compiler exists, else nothing (the GPU tests skip with the reason).
``AIOEP_CUDA_EMULATOR=1`` forces the emulator (useful on a GPU machine, to test the
emulator itself), ``AIOEP_CUDA_EMULATOR=0`` forbids it.

In the test process the emulator offers **no device** until a test asks for one
(`Emulator.devices`), so the rest of the suite sees a driver without a GPU, as on a
machine without one, and nothing else changes behaviour.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "SOURCE",
    "Driver",
    "Emulator",
    "EmulatorUnavailable",
    "build",
    "child_env",
    "compiler",
    "load",
    "probe_real_gpu",
    "select_driver",
]

SOURCE = Path(__file__).with_name("emulator.c")
SONAME = "libcuda.so.1"
ENV_SWITCH = "AIOEP_CUDA_EMULATOR"

# CUresult codes the tests inject.
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_UNKNOWN = 999


class EmulatorUnavailable(RuntimeError):
    """The emulator cannot be built or loaded here (the message says why)."""


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on the PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name:
            path = shutil.which(name)
            if path:
                return path
    return None


_build_lock = threading.Lock()


def build(directory: Path | None = None) -> Path:
    """Compile ``emulator.c`` into ``<directory>/libcuda.so.1`` and return its path.

    Without ``directory`` the library goes to a cache folder in the temporary directory,
    keyed by a hash of the source and the compiler, so it is built once per change.

    Raises:
        EmulatorUnavailable: no C compiler, or the compile failed (with its output).
    """
    cc = compiler()
    if cc is None:
        raise EmulatorUnavailable("no C compiler (cc, gcc or clang) to build the CUDA emulator")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + cc.encode()).hexdigest()[:16]
    if directory is None:
        directory = Path(tempfile.gettempdir()) / f"aioep-cuda-emulator-{key}"
    target = directory / SONAME
    with _build_lock:
        if target.exists():
            return target
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".{SONAME}.{os.getpid()}.tmp"
        cmd = [
            cc,
            "-O2",
            "-shared",
            "-fPIC",
            "-pthread",
            "-fvisibility=hidden",
            f"-Wl,-soname,{SONAME}",
            "-o",
            str(partial),
            str(SOURCE),
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EmulatorUnavailable(f"compiling the CUDA emulator failed: {exc}") from exc
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise EmulatorUnavailable(
                f"compiling the CUDA emulator failed ({' '.join(cmd)}):\n{done.stderr}"
            )
        os.replace(partial, target)  # atomic: a concurrent build sees all or nothing
    return target


class Emulator:
    """The loaded emulator library: configuration, statistics and fault injection."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.lib = lib
        self.path = path
        lib.cuemu_set.argtypes = [ctypes.c_char_p, ctypes.c_longlong]
        lib.cuemu_set.restype = ctypes.c_int
        lib.cuemu_get.argtypes = [ctypes.c_char_p]
        lib.cuemu_get.restype = ctypes.c_longlong
        lib.cuemu_fail_call.argtypes = [
            ctypes.c_char_p,
            ctypes.c_longlong,
            ctypes.c_longlong,
            ctypes.c_int,
        ]
        lib.cuemu_fail_call.restype = ctypes.c_int
        lib.cuemu_last_violation.argtypes = [ctypes.c_int]
        lib.cuemu_last_violation.restype = ctypes.c_char_p
        lib.cuemu_reset.argtypes = []
        lib.cuemu_reset.restype = None
        lib.cuemu_identity.restype = ctypes.c_char_p
        lib.cuemu_reset_contexts.restype = ctypes.c_int
        lib.cuemu_mark_loop_thread.argtypes = [ctypes.c_long]
        lib.cuemu_mark_loop_thread.restype = ctypes.c_int
        lib.cuemu_unmark_loop_thread.argtypes = [ctypes.c_long]
        lib.cuemu_unmark_loop_thread.restype = ctypes.c_int

    def set(self, key: str, value: int) -> None:
        """Set a configuration value (``devices``, ``memory_limit``, ``bandwidth`` in bytes/s,
        ``latency_ns``, ``stream_mem_ops``, ``watch_tid``, ``lose_after_copies``,
        ``pageable_staging_limit``, ``abort_on_misuse``, ``strict_loop_sync`` ...)."""
        rc = self.lib.cuemu_set(key.encode(), int(value))
        if rc == -2:
            raise RuntimeError(f"emulator: cannot set {key}={value}: a context is retained")
        if rc != 0:
            raise KeyError(f"emulator: unknown setting or bad value {key}={value}")

    def get(self, key: str) -> int:
        """A configuration value or a statistic (``copies``, ``violations``, ``hostfns``,
        ``pageable_copies``, ``watched_pageable``, ``watched_blocking``, ``device_used``,
        ``live_allocs``, ``retained_contexts``, ``threads_live``, ``misuses``, ``sync_calls``,
        ``sync_waits``, ``sync_waiting``, ``host_waiting``, ``loop_threads`` ...)."""
        value = int(self.lib.cuemu_get(key.encode()))
        if value == -1 and key not in ("lose_after_copies",):
            raise KeyError(f"emulator: unknown key {key!r}")
        return value

    def fail_call(self, name: str, *, after: int = 0, times: int = 1, code: int = 999) -> None:
        """Make call ``after + 1`` of driver function ``name`` (from now) fail with ``code``,
        ``times`` times in a row (-1: every call from then on)."""
        if self.lib.cuemu_fail_call(name.encode(), after, times, code) != 0:
            raise RuntimeError("emulator: the fault table is full")

    def clear_faults(self) -> None:
        self.lib.cuemu_fail_call(b"", 0, 0, 0)

    def take_violation(self) -> str | None:
        """The last ordering / memory violation the emulator saw (then forget them), or None."""
        count = self.get("violations")
        message = self.lib.cuemu_last_violation(1).decode()
        return f"{count} violation(s); last: {message}" if count else None

    def reset(self) -> None:
        """Restore the configuration (the device count stays), clear faults and unmark every
        event-loop thread."""
        self.lib.cuemu_reset()

    def mark_loop_thread(self, tid: int | None = None) -> None:
        """Mark thread ``tid`` (a native id; default: this thread) as an event loop: any driver
        call from it that has to wait, for the device or behind another thread's
        context-synchronising call, aborts the process naming the call (see README.md)."""
        if self.lib.cuemu_mark_loop_thread(threading.get_native_id() if tid is None else tid):
            raise RuntimeError("emulator: too many event-loop threads marked")

    def unmark_loop_thread(self, tid: int | None = None) -> bool:
        """Undo `mark_loop_thread`; whether the thread was marked."""
        tid = threading.get_native_id() if tid is None else tid
        return bool(self.lib.cuemu_unmark_loop_thread(tid))

    @contextlib.contextmanager
    def loop_thread(self, tid: int | None = None) -> Iterator[None]:
        """Mark ``tid`` (default: this thread) as an event loop inside the block."""
        tid = threading.get_native_id() if tid is None else tid
        self.mark_loop_thread(tid)
        try:
            yield
        finally:
            self.unmark_loop_thread(tid)

    def reset_contexts(self) -> int:
        """Destroy every primary context, retained or not (what a leaked environment left);
        returns how many were still retained."""
        return int(self.lib.cuemu_reset_contexts())

    @contextlib.contextmanager
    def devices(self, count: int = 1) -> Iterator[Emulator]:
        """Offer ``count`` devices inside the block, none after it (configuration reset).

        Raises:
            RuntimeError: at the end, if a primary context was still retained (something
                did not close); the contexts are destroyed anyway, so the next test starts
                clean.
        """
        self.set("devices", count)
        try:
            yield self
        finally:
            self.reset()
            self.clear_faults()
            leaked = self.get("retained_contexts")
            if leaked:
                self.reset_contexts()
            self.set("devices", 0)
        if leaked:
            raise RuntimeError(
                f"{leaked} CUDA context(s) were still retained after the test: an environment "
                "or factory was not closed"
            )


_loaded: Emulator | None = None


def _loaded_libcuda() -> str | None:
    """Path of a ``libcuda.so.1`` already loaded in this process, if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if line.rstrip().endswith("/" + SONAME) or "/libcuda.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    return None


def load(*, devices: int = 0) -> Emulator:
    """Build the emulator and load it into this process as ``libcuda.so.1``.

    It starts with ``devices`` devices (0: a driver without a GPU until a test asks for one).

    Raises:
        EmulatorUnavailable: no compiler, or another ``libcuda.so.1`` is loaded already.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    if sys.platform != "linux":
        raise EmulatorUnavailable("the CUDA emulator is built for Linux only")
    other = _loaded_libcuda()
    path = build()
    if other is not None and Path(other) != path:
        raise EmulatorUnavailable(f"another CUDA driver is loaded in this process already: {other}")
    lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    emulator = Emulator(lib, path)
    emulator.set("devices", devices)
    _loaded = emulator
    return emulator


def child_env(path: Path, base: dict[str, str] | None = None, devices: int = 1) -> dict[str, str]:
    """Environment variables under which a child process loads the emulator at ``path``."""
    env = dict(os.environ if base is None else base)
    old = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = str(path.parent) + (os.pathsep + old if old else "")
    env["CUEMU_DEVICES"] = str(devices)
    env[ENV_SWITCH] = "1"
    return env


_PROBE = """
import ctypes, sys
try:
    lib = ctypes.CDLL("libcuda.so.1")
except OSError as exc:
    print("no driver library:", exc); sys.exit(1)
if lib.cuInit(0) != 0:
    print("cuInit failed"); sys.exit(1)
n = ctypes.c_int()
if lib.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value < 1:
    print("no CUDA device"); sys.exit(1)
print(n.value, "device(s)")
"""


def probe_real_gpu(timeout: float = 60.0) -> tuple[bool, str]:
    """Whether the system's CUDA driver finds a GPU, asked in a child process (this process
    never loads the real driver here); and what the probe said."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"the driver probe failed: {exc}"
    said = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode == 0, said[-1] if said else f"exit status {done.returncode}"


@dataclass(frozen=True)
class Driver:
    """The driver the CUDA tests run against."""

    kind: str  # "real", "emulator" or "none"
    reason: str  # why (what the probe said; why there is none)
    emulator: Emulator | None = None

    @property
    def available(self) -> bool:
        return self.kind != "none"


_selected: Driver | None = None


def select_driver() -> Driver:
    """Choose, once per process, the driver for the GPU tests (see the module docstring)."""
    global _selected
    if _selected is not None:
        return _selected
    switch = os.environ.get(ENV_SWITCH, "auto").strip().lower()
    if switch in ("1", "yes", "true", "force"):
        real, said = False, f"{ENV_SWITCH}={switch} forces the emulator"
    else:
        real, said = probe_real_gpu()
    if real:
        _selected = Driver("real", f"the NVIDIA driver: {said}")
    elif switch in ("0", "no", "false", "never"):
        _selected = Driver(
            "none", f"no GPU ({said}) and {ENV_SWITCH}={switch} forbids the emulator"
        )
    else:
        try:
            emulator = load()
        except EmulatorUnavailable as exc:
            _selected = Driver("none", f"no GPU ({said}) and no CUDA emulator: {exc}")
        else:
            _selected = Driver("emulator", f"the CUDA driver emulator (no GPU: {said})", emulator)
    return _selected
