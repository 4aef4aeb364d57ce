"""Process-wide bookkeeping of the plugin libraries registered with onnxruntime.

ONNX Runtime's Python binding has one global environment, so a library is
registered with ORT once per process however many aioep environments use it:
each `Registration` is reference-counted. It also counts the OrtValues
alive on the library's memory and unregisters from ORT only when both counts
reach zero, because unregistering while an OrtValue (or session) of the
library is alive crashes the interpreter (SIGSEGV at its next use or release).
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

from aioep import DeviceError, InvalidArgument

from ._ort import ort, translate

__all__ = ["Registration", "acquire", "release"]

# A 69-byte ONNX model, Identity(float[n]): creating a session with the EP makes the
# library create its device, and a missing device is then a catchable EPFail (an
# allocation would abort the process instead, e.g. WebGPU without an adapter).
_PROBE_MODEL = (
    b'\x08\x08\x12\x00:9\n\x10\n\x01x\x12\x01y"\x08Identity\x12\x01pZ\x10\n\x01x\x12\x0b\n\t'
    b"\x08\x01\x12\x05\n\x03\x12\x01nb\x10\n\x01y\x12\x0b\n\t\x08\x01\x12\x05\n\x03\x12\x01n"
    b"B\x04\n\x00\x10\r"
)

_lock = threading.Lock()
_registrations: dict[str, Registration] = {}


class Registration:
    """One library registered with ORT under ``name``: its OrtEpDevices and users."""

    def __init__(self, name: str, path: str, devices: list[Any]) -> None:
        self.name = name
        self.path = path
        self.devices = devices
        self.refs = 0
        self.live_values = 0
        self.registered = True
        self.device_lock = threading.RLock()
        """Held by every ORT call that works on the library's devices from a worker thread
        (copies, session runs): ORT's WebGPU EP crashes when a copy or run on one thread
        overlaps a run on another, so aioep never lets them overlap."""
        self._checked: dict[int, BaseException | None] = {}
        self._check_lock = threading.Lock()

    def value_created(self) -> None:
        """Count an OrtValue on this library's memory (call before creating it)."""
        with _lock:
            self.live_values += 1

    def value_released(self) -> None:
        """Uncount an OrtValue (call after dropping the last reference to it)."""
        with _lock:
            self.live_values -= 1
            done = self.refs == 0 and self.live_values == 0 and self.registered
        if done:
            _unregister(self)

    def check_device(self, index: int) -> None:
        """Make sure device ``index`` can allocate, once per process and device.

        Raises:
            DeviceError: the library cannot create its device (no adapter/driver).
        """
        with self._check_lock:
            if index not in self._checked:
                self._checked[index] = self._probe(index)
            error = self._checked[index]
        if error is not None:
            raise DeviceError(
                f"ORT plugin library {self.name!r} ({self.path}) cannot create its device "
                f"{index}: {type(error).__name__}: {error}"
            ) from error

    def _probe(self, index: int) -> BaseException | None:
        rt = ort()
        so = rt.SessionOptions()
        so.log_severity_level = 3
        try:
            so.add_provider_for_devices([self.devices[index]], {})
            session = rt.InferenceSession(_PROBE_MODEL, sess_options=so)
        except Exception as exc:  # EPFail when there is no usable device
            return exc
        del session  # must go before the library can be unregistered
        return None


def acquire(name: str, path: str) -> Registration:
    """Register ``path`` with ORT under ``name`` (or reuse that registration) and count a user.

    Raises:
        InvalidArgument: ``name`` is registered with ORT for another library path.
        EpError: ORT refused the library (translated from ORT's error).
    """
    real = os.path.realpath(path)
    with _lock:
        reg = _registrations.get(name)
        if reg is not None:
            if reg.path != real:
                raise InvalidArgument(
                    f"ORT library name {name!r} is already registered for {reg.path!r} in this "
                    f"process; cannot register {real!r} under the same name"
                )
            reg.refs += 1
            return reg
        rt = ort()
        before = {id(d): d for d in rt.get_ep_devices()}
        names_before = {d.ep_name for d in before.values()}
        try:
            rt.register_execution_provider_library(name, real)
        except Exception as exc:
            raise translate(exc, f"registering ORT plugin library {real!r} as {name!r}") from exc
        devices = [d for d in rt.get_ep_devices() if d.ep_name not in names_before]
        reg = Registration(name, real, devices)
        reg.refs = 1
        _registrations[name] = reg
        return reg


def release(reg: Registration) -> None:
    """Drop one user; unregister from ORT once no user and no OrtValue is left."""
    with _lock:
        reg.refs -= 1
        done = reg.refs == 0 and reg.live_values == 0 and reg.registered
    if done:
        _unregister(reg)


def _unregister(reg: Registration) -> None:
    with _lock:
        if not reg.registered or reg.refs or reg.live_values:
            return
        reg.registered = False
        if _registrations.get(reg.name) is reg:
            del _registrations[reg.name]
        reg.devices = []
    try:
        ort().unregister_execution_provider_library(reg.name)
    except Exception as exc:
        warnings.warn(
            f"unregistering ORT plugin library {reg.name!r} failed: {type(exc).__name__}: {exc}",
            RuntimeWarning,
            stacklevel=2,
        )
