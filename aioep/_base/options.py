"""Parsing backend options: one rule set for every factory.

Backend options arrive as a mapping of str to str/int/float (``backend_options=``
of `aioep.Environment`, the ``options`` of ``register_library``,
``create_shared_allocator`` and ``create_sync_stream``); strings come from
config files and ORT-style key/value pairs. These helpers turn one value into a
checked Python value, so that the same value means the same thing to every
backend:

=====================  =========================================================================
helper                 accepts
=====================  =========================================================================
parse_int_option       an ``int`` (not a ``bool``), or a ``str`` that is wholly an integer
                       after stripping whitespace: decimal (``"4096"``, ``"-1"``, ``"+7"``) or
                       ``0x`` hex (``"0x1000"``). Floats are refused, even ``2.0`` and
                       ``"2.0"`` (a size or a count that is not a whole number is a mistake).
parse_float_option     an ``int`` or ``float`` (not a ``bool``), or a ``str`` that is wholly a
                       decimal number (``"2.5"``, ``"1e-3"``, ``"8"``); never NaN or infinity.
parse_bool_option      a ``bool``, the ints ``0`` / ``1``, or the strs ``"true"`` /
                       ``"false"`` / ``"1"`` / ``"0"`` (any case, whitespace stripped).
parse_choice_option    a ``str`` that is one of the choices after stripping whitespace
                       (case-sensitive).
=====================  =========================================================================

``minimum`` and ``maximum`` are inclusive. `reject_unknown_options` checks the
mapping itself and its keys. Every error is an `aioep.InvalidArgument` whose
message names the owner (``"sim backend"``, ``"cuda allocator"``), the key, what is
allowed and the value given, e.g. ``sim backend option 'num_devices' must be an
integer in [0, 64], got '2.0' (not a whole integer)``.

A factory validates all of its options once, in its constructor, into a frozen
dataclass::

    reject_unknown_options("my backend", options, {"streams", "wake"})
    streams = parse_int_option("my backend", "streams", options.get("streams", 4), minimum=1)
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import InvalidArgument
from .validate import short_repr

__all__ = [
    "parse_bool_option",
    "parse_choice_option",
    "parse_float_option",
    "parse_int_option",
    "reject_unknown_options",
]

_INT = re.compile(r"[+-]?(?:0[xX][0-9a-fA-F]+|[0-9]+)")
# (one way to match each string: `[0-9]+\.?[0-9]*` backtracked for seconds on 10**4 digits)
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_TRUE = ("true", "1")
_FALSE = ("false", "0")


def _bounds(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def _error(owner: str, key: str, wanted: str, value: Any, note: str = "") -> InvalidArgument:
    return InvalidArgument(
        f"{owner} option {key!r} must be {wanted}, got {short_repr(value)}{note}"
    )


def parse_int_option(
    owner: str,
    key: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int:
    """Parse an integer option: an int (not a bool) or a str that is wholly an integer.

    Strings are stripped of whitespace and may have a sign; ``0x`` / ``0X`` marks hex.
    Floats (``2.0``) and float strings (``"2.0"``) are refused.

    Args:
        owner: who is parsing, for the message (``"sim backend"``).
        key: the option's name.
        value: the value given.
        minimum: the smallest value allowed (inclusive), or ``None``.
        maximum: the largest value allowed (inclusive), or ``None``.

    Raises:
        InvalidArgument: not an integer, or out of range.
    """
    wanted = "an integer" + _bounds(minimum, maximum)
    if isinstance(value, bool):
        raise _error(owner, key, wanted, value, " (a bool; pass 0 or 1)")
    if isinstance(value, numbers.Integral):
        number = int(value)
    elif isinstance(value, str):
        text = value.strip()
        if not _INT.fullmatch(text):
            note = " (not a whole integer)" if _FLOAT.fullmatch(text) else ""
            raise _error(owner, key, wanted + " (decimal or 0x hex)", value, note)
        try:
            number = int(text, 0) if "x" in text or "X" in text else int(text, 10)
        except ValueError:  # more decimal digits than Python converts (4,300 by default)
            raise _error(owner, key, wanted, value, " (too many digits)") from None
    elif isinstance(value, numbers.Real):
        raise _error(owner, key, wanted, value, " (a float; pass an int or an int string)")
    else:
        raise _error(owner, key, wanted, value, f" (a {type(value).__name__})")
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise _error(owner, key, wanted, value)
    return number


def parse_float_option(
    owner: str,
    key: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float:
    """Parse a number option: an int or a float (not a bool), or a str that is wholly a number.

    Strings are stripped of whitespace and are decimal (``"2.5"``, ``"-1"``, ``"1e-3"``).
    NaN and infinity are refused, as values and as strings.

    Args:
        owner: who is parsing, for the message (``"sim backend"``).
        key: the option's name.
        value: the value given.
        minimum: the smallest value allowed (inclusive), or ``None``.
        maximum: the largest value allowed (inclusive), or ``None``.

    Raises:
        InvalidArgument: not a finite number, or out of range.
    """
    wanted = "a number" + _bounds(minimum, maximum)
    if isinstance(value, bool):
        raise _error(owner, key, wanted, value, " (a bool)")
    if isinstance(value, numbers.Real):
        try:
            number = float(value)
        except OverflowError:  # an int (or a Fraction) beyond a float's range
            number = math.inf
    elif isinstance(value, str):
        text = value.strip()
        if not _FLOAT.fullmatch(text):
            raise _error(owner, key, wanted, value)
        number = float(text)
    else:
        raise _error(owner, key, wanted, value, f" (a {type(value).__name__})")
    if not math.isfinite(number):
        raise _error(owner, key, "a finite number" + _bounds(minimum, maximum), value)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise _error(owner, key, wanted, value)
    return number


def parse_bool_option(owner: str, key: str, value: Any) -> bool:
    """Parse a flag: a bool, the ints 0 and 1, or ``"true"``/``"false"``/``"1"``/``"0"``.

    Strings are stripped of whitespace and compared without regard to case.

    Raises:
        InvalidArgument: any other value.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and int(value) in (0, 1):
        return bool(int(value))
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise _error(owner, key, "a bool (true/false/1/0)", value)


def parse_choice_option(owner: str, key: str, value: Any, choices: Iterable[str]) -> str:
    """Parse a str that must be one of ``choices`` (whitespace stripped, case-sensitive).

    Returns:
        The choice, as spelled in ``choices``.

    Raises:
        InvalidArgument: not a str, or not one of the choices (the message lists them).
    """
    allowed = list(choices)
    if isinstance(value, str) and value.strip() in allowed:
        return value.strip()
    raise _error(owner, key, f"one of {allowed}", value)


def reject_unknown_options(
    owner: str, given: Mapping[str, Any] | None, known: Iterable[str]
) -> None:
    """Check that ``given`` is a mapping (or ``None``) whose keys are all in ``known``.

    Raises:
        InvalidArgument: ``given`` is not a mapping, or it has a key that is not known
            (the message lists the unknown and the known keys).
    """
    if given is None:
        return
    if not isinstance(given, Mapping):
        raise InvalidArgument(
            f"{owner} options must be a mapping of str to str/int/float, got {type(given).__name__}"
        )
    names = set(known)
    unknown = sorted(
        k if isinstance(k, str) and len(k) <= 80 else short_repr(k) for k in given if k not in names
    )
    if unknown:
        if names:
            known_text = f"; known options are {sorted(names)}"
        else:
            known_text = f"; {owner} takes no options"
        raise InvalidArgument(f"{owner}: unknown option(s) {unknown}{known_text}")
