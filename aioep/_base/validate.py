"""Argument checks for the public boundary: each raises `InvalidArgument` naming the
argument, what it got and what it accepts, before anything is done."""

from __future__ import annotations

import math
import numbers
import os
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
]

MAX_DIM = 1 << 62
"""The largest tensor dimension or byte count accepted (ORT's int64 sizes, with room)."""


def describe(value: object) -> str:
    """A short description of ``value`` for an error message: its type and a bounded repr."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


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
            f"{where}: {name} must be an int in [{minimum}, {maximum}], got {out}"
        )
    return out


def check_timeout(where: str, timeout: object) -> float | None:
    """A wait's timeout: None or a number >= 0; infinity means None (wait forever)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidArgument(
            f"{where}: timeout must be None or a number of seconds >= 0, got {describe(timeout)}"
        )
    value = float(timeout)
    if math.isnan(value) or value < 0:
        raise InvalidArgument(f"{where}: timeout must be >= 0 seconds (or None), got {value}")
    return None if math.isinf(value) else value


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
