"""The one place that imports onnxruntime and turns its exceptions into aioep errors.

onnxruntime is imported lazily: the ``ort`` backend is autoloaded by every
``Environment()``, and offers nothing (and imports nothing) until its options
name a plugin library.
"""

from __future__ import annotations

from typing import Any

from aioep import DeviceError, EpError, InvalidArgument, NoSuchFile, NotImplementedByEp

__all__ = ["ort", "translate"]

_module: Any = None


def ort() -> Any:
    """The ``onnxruntime`` module (imported on first use)."""
    global _module
    if _module is None:
        import onnxruntime

        _module = onnxruntime
    return _module


def translate(exc: BaseException, what: str) -> EpError:
    """An aioep error for an exception raised by onnxruntime while doing ``what``.

    The caller raises the result ``from exc``. ORT's own classes (``Fail``,
    ``InvalidArgument``, ``NotImplemented``, ``NoSuchFile``, ``EPFail`` ...) map to
    the matching aioep class; anything else becomes a `DeviceError`.
    """
    if isinstance(exc, EpError):
        return exc
    kind = type(exc).__name__
    message = f"{what} failed: {kind}: {exc}"
    if kind == "InvalidArgument":
        return InvalidArgument(message)
    if kind == "NoSuchFile":
        return NoSuchFile(message)
    if kind == "NotImplemented" or "does not support" in str(exc) or "was not found" in str(exc):
        return NotImplementedByEp(message)
    if kind == "Fail":
        return EpError(message)
    return DeviceError(message)
