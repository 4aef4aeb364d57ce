"""Argument checks for the public boundary: each raises `InvalidArgument` naming the
argument, what it got and what it accepts, before anything is done."""

from __future__ import annotations

import math
import numbers
import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import InvalidArgument

__all__ = [
    "MAX_DIM",
    "check_dtype",
    "check_int",
    "check_options",
    "check_timeout",
    "check_type",
    "describe",
    "short_repr",
]

MAX_DIM = 1 << 62
"""The largest tensor dimension or byte count accepted (ORT's int64 sizes, with room)."""


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message, at most about ``limit`` characters; never raises.

    A long str shows its start and its length; an int too long to show (Python refuses to
    convert one of over 4,300 digits to text) shows its size; anything else is cut.
    """
    if isinstance(value, str) and len(value) > limit:
        return f"{value[: limit - 20]!r}... ({len(value)} characters)"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 3 * limit:
        # (each decimal digit is ~3.3 bits: over `limit` digits; no conversion to text)
        kind = "a negative int" if value < 0 else "an int"
        return f"<{kind} of about {int(value.bit_length() * math.log10(2)) + 1} digits>"
    try:
        text = repr(value)
    except Exception:  # a repr that fails: say what it is
        return f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(value: object) -> str:
    """A short description of ``value`` for an error message: its type and a bounded repr."""
    return f"{type(value).__name__} {short_repr(value)}"


def check_type(
    where: str, name: str, value: object, types: type | tuple[type, ...], accepts: str
) -> None:
    """Raise unless ``isinstance(value, types)``."""
    if not isinstance(value, types):
        raise InvalidArgument(f"{where}: {name} must be {accepts}, got {describe(value)}")


def check_int(
    where: str, name: str, value: object, *, minimum: int = 0, maximum: int = MAX_DIM
) -> int:
    """``value`` as an int in ``[minimum, maximum]`` (a bool is refused; numpy ints pass)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgument(
            f"{where}: {name} must be an int in [{minimum}, {maximum}], got {describe(value)}"
        )
    out = int(value)
    if not minimum <= out <= maximum:
        raise InvalidArgument(
            f"{where}: {name} must be an int in [{minimum}, {maximum}], got {short_repr(out)}"
        )
    return out


def check_timeout(where: str, timeout: object) -> float | None:
    """A blocking wait's timeout: None or a number of seconds >= 0 (NaN and negative
    numbers are refused, as trio refuses them).

    Returns None (wait as long as it takes) for None, infinity and any timeout longer than
    the threads can wait at once (``threading.TIMEOUT_MAX``, about 292 years), which
    ``threading`` would refuse with an ``OverflowError``.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidArgument(
            f"{where}: timeout must be None or a number of seconds >= 0, got {describe(timeout)}"
        )
    try:
        value = float(timeout)
    except OverflowError:  # an int (or a Fraction) beyond a float's range
        value = math.inf if timeout > 0 else -math.inf  # type: ignore[operator]
    if math.isnan(value) or value < 0:
        raise InvalidArgument(f"{where}: timeout must be >= 0 seconds (or None), got {value}")
    return None if value > threading.TIMEOUT_MAX else value


def check_options(where: str, name: str, options: object) -> dict[str, Any]:
    """An options mapping as a dict with str keys (None gives ``{}``)."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise InvalidArgument(
            f"{where}: {name} must be a mapping of str keys to values (or None), "
            f"got {describe(options)}"
        )
    bad = [k for k in options if not isinstance(k, str)]
    if bad:
        raise InvalidArgument(f"{where}: {name} keys must be str, got {describe(bad[0])}")
    return dict(options)


def check_path(where: str, name: str, value: object) -> str:
    """A filesystem path argument (str or os.PathLike) as a str."""
    if not isinstance(value, (str, os.PathLike)):
        raise InvalidArgument(
            f"{where}: {name} must be a str or os.PathLike, got {describe(value)}"
        )
    path = os.fspath(value)
    if not isinstance(path, str):
        raise InvalidArgument(f"{where}: {name} must be a text path, got {describe(path)}")
    return path


def check_dtype(where: str, dtype: object) -> np.dtype[Any]:
    """``dtype`` as a numpy dtype; anything numpy cannot read (it may raise TypeError,
    ValueError or even SyntaxError for a malformed string) is InvalidArgument."""
    try:
        return np.dtype(dtype)  # type: ignore[call-overload,no-any-return]
    except Exception as exc:
        raise InvalidArgument(
            f"{where}: {dtype!r} is not a numpy dtype ({type(exc).__name__}: {exc})"
        ) from exc
