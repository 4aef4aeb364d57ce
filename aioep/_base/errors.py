"""The aioep exception tree.

Every error aioep raises is an `EpError` carrying an ONNX Runtime style
`ErrorCode`. The specific subclasses also derive from the builtin that a
caller would reach for first::

    EpError (Exception)                      code varies
    ├── InvalidArgument (ValueError, TypeError)  INVALID_ARGUMENT  bad input, nothing was done
    ├── NoSuchFile (FileNotFoundError)       NO_SUCHFILE       a library, model or data file is missing
    ├── NotImplementedByEp (NotImplementedError)  NOT_IMPLEMENTED  no backend can do this
    ├── InUseError (RuntimeError)            FAIL              refused: something still uses it
    ├── ClosedError (RuntimeError)           FAIL              used after aclose()/close()
    └── DeviceError (RuntimeError)           EP_FAIL           the device or driver failed; cause chained

Backend and driver errors are translated at one boundary,
`translate_backend_error`, which keeps the original as ``__cause__``.
"""

from __future__ import annotations

import enum
import importlib
from types import ModuleType

__all__ = [
    "ClosedError",
    "DeviceError",
    "EpError",
    "ErrorCode",
    "InUseError",
    "InvalidArgument",
    "NoSuchFile",
    "NotImplementedByEp",
    "import_optional",
    "translate_backend_error",
]


class ErrorCode(enum.IntEnum):
    """ONNX Runtime's ``OrtErrorCode`` values."""

    OK = 0
    FAIL = 1
    INVALID_ARGUMENT = 2
    NO_SUCHFILE = 3
    NO_MODEL = 4
    ENGINE_ERROR = 5
    RUNTIME_EXCEPTION = 6
    INVALID_PROTOBUF = 7
    MODEL_LOADED = 8
    NOT_IMPLEMENTED = 9
    INVALID_GRAPH = 10
    EP_FAIL = 11
    MODEL_LOAD_CANCELED = 12
    MODEL_REQUIRES_COMPILATION = 13
    NOT_FOUND = 14


class EpError(Exception):
    """Base class of every aioep error; ``code`` is the ORT-style error code."""

    default_code = ErrorCode.FAIL

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.code: ErrorCode = self.default_code if code is None else code

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[object, ...]:
        # Keep a non-default code across pickling (worker processes, multiprocessing).
        return (type(self), self.args[:1], self.__dict__)


class InvalidArgument(EpError, ValueError, TypeError):
    """An argument was wrong (a bad value or a wrong type); nothing was enqueued, written or
    registered."""

    default_code = ErrorCode.INVALID_ARGUMENT


class NoSuchFile(EpError, FileNotFoundError):
    """A file that was named (plugin library, model, external data) does not exist."""

    default_code = ErrorCode.NO_SUCHFILE

    def __init__(self, message: str, *, code: ErrorCode | None = None) -> None:
        EpError.__init__(self, message, code=code)


class NotImplementedByEp(EpError, NotImplementedError):
    """No registered backend offers the requested operation."""

    default_code = ErrorCode.NOT_IMPLEMENTED


class InUseError(EpError, RuntimeError):
    """Refused because the object is still in use (live buffers, open streams, copies)."""


class ClosedError(EpError, RuntimeError):
    """The object was closed by your code and cannot be used any more."""


class DeviceError(EpError, RuntimeError):
    """The device or its driver failed (out of memory, lost device, failed copy)."""

    default_code = ErrorCode.EP_FAIL


def translate_backend_error(exc: BaseException, what: str) -> EpError:
    """Turn an exception raised by backend code into an `EpError`.

    ``what`` names the operation, e.g. ``"sim stream 'sim:0/3' copy"``. An
    ``EpError`` passes through unchanged; anything else becomes a
    `DeviceError` whose message keeps the backend's own text. The caller
    raises the result ``from exc`` so the cause stays chained.
    """
    if isinstance(exc, EpError):
        return exc
    return DeviceError(f"{what} failed: {type(exc).__name__}: {exc}")


def import_optional(module: str, needed_for: str) -> ModuleType:
    """Import ``module``, an optional dependency (installed by ``aioep[onnx]``).

    Raises:
        NotImplementedByEp: it is not installed; the message says what needs it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise NotImplementedByEp(
            f"{needed_for} needs the {module!r} package: pip install 'aioep[onnx]'"
        ) from exc
