"""The option-parsing helpers of aioep.abc, and that the backends share their rules."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import numpy as np
import pytest

import aioep
from aioep.abc import (
    parse_bool_option,
    parse_choice_option,
    parse_float_option,
    parse_int_option,
    reject_unknown_options,
)
from aioep_cuda import CudaOptions
from aioep_ort import OrtOptions
from aioep_sim import SimOptions

OWNER = "test backend"


# -- parse_int_option --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (7, 7),
        (-1, -1),
        (1 << 70, 1 << 70),
        (np.int64(12), 12),
        ("42", 42),
        ("  42\n", 42),
        ("-3", -3),
        ("+3", 3),
        ("007", 7),
        ("0x10", 16),
        ("0XfF", 255),
        ("-0x10", -16),
    ],
)
def test_int_accepts(value: Any, expected: int) -> None:
    result = parse_int_option(OWNER, "k", value)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    ("value", "note"),
    [
        (2.0, "a float"),
        (2.5, "a float"),
        ("2.0", "not a whole integer"),
        ("1e3", "not a whole integer"),
        (True, "a bool"),
        (False, "a bool"),
        (None, "a NoneType"),
        ([1], "a list"),
        ("", ""),
        ("  ", ""),
        ("two", ""),
        ("1_000", ""),
        ("0x", ""),
        ("0xZZ", ""),
        ("1 2", ""),
        ("١٢", ""),  # non-ASCII digits: int() takes them, the rule does not
    ],
)
def test_int_rejects(value: Any, note: str) -> None:
    with pytest.raises(aioep.InvalidArgument) as info:
        parse_int_option(OWNER, "k", value)
    message = str(info.value)
    assert message.startswith("test backend option 'k' must be an integer")
    assert repr(value) in message
    assert note in message
    assert info.value.code is aioep.ErrorCode.INVALID_ARGUMENT


def test_int_range_is_inclusive_and_named() -> None:
    assert parse_int_option(OWNER, "k", "0", minimum=0, maximum=64) == 0
    assert parse_int_option(OWNER, "k", 64, minimum=0, maximum=64) == 64
    with pytest.raises(aioep.InvalidArgument, match=r"'k' must be an integer in \[0, 64\], got 65"):
        parse_int_option(OWNER, "k", 65, minimum=0, maximum=64)
    with pytest.raises(aioep.InvalidArgument, match=r"must be an integer >= 1, got '0'"):
        parse_int_option(OWNER, "k", "0", minimum=1)
    with pytest.raises(aioep.InvalidArgument, match=r"must be an integer <= 9, got '0x10'"):
        parse_int_option(OWNER, "k", "0x10", maximum=9)
    with pytest.raises(aioep.InvalidArgument, match=r"must be an integer >= 0 \(decimal"):
        parse_int_option(OWNER, "k", "-x", minimum=0)


# -- parse_float_option ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0.0),
        (3, 3.0),
        (2.5, 2.5),
        (np.float32(0.5), 0.5),
        ("2.5", 2.5),
        (" 8 ", 8.0),
        ("-1", -1.0),
        (".5", 0.5),
        ("5.", 5.0),
        ("1e-3", 1e-3),
        ("+2E2", 200.0),
    ],
)
def test_float_accepts(value: Any, expected: float) -> None:
    result = parse_float_option(OWNER, "k", value)
    assert result == expected
    assert type(result) is float


@pytest.mark.parametrize(
    "value",
    [
        True,
        None,
        "fast",
        "",
        "1_0",
        "0x10",
        "nan",
        "inf",
        "-Infinity",
        float("nan"),
        float("inf"),
        "1.5.2",
        b"1",
    ],
)
def test_float_rejects(value: Any) -> None:
    with pytest.raises(aioep.InvalidArgument) as info:
        parse_float_option(OWNER, "k", value)
    message = str(info.value)
    assert message.startswith("test backend option 'k' must be a")
    assert repr(value) in message


def test_float_range() -> None:
    assert parse_float_option(OWNER, "k", "0.5", minimum=0.5, maximum=1000) == 0.5
    assert parse_float_option(OWNER, "k", 1000, minimum=0.5, maximum=1000) == 1000.0
    with pytest.raises(aioep.InvalidArgument, match=r"a number in \[0.5, 1000\], got 0.4"):
        parse_float_option(OWNER, "k", 0.4, minimum=0.5, maximum=1000)
    with pytest.raises(aioep.InvalidArgument, match=r"a number >= 0, got '-1'"):
        parse_float_option(OWNER, "k", "-1", minimum=0)


# -- parse_bool_option -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, True),
        (False, False),
        (1, True),
        (0, False),
        (np.int8(1), True),
        ("true", True),
        ("TRUE", True),
        (" True ", True),
        ("1", True),
        ("false", False),
        ("False", False),
        ("0", False),
    ],
)
def test_bool_accepts(value: Any, expected: bool) -> None:
    assert parse_bool_option(OWNER, "k", value) is expected


@pytest.mark.parametrize("value", [2, -1, 1.0, 0.0, "yes", "no", "on", "t", "", "2", None])
def test_bool_rejects(value: Any) -> None:
    with pytest.raises(aioep.InvalidArgument) as info:
        parse_bool_option(OWNER, "k", value)
    assert str(info.value) == (
        f"test backend option 'k' must be a bool (true/false/1/0), got {value!r}"
    )


# -- parse_choice_option -----------------------------------------------------------------------


def test_choice() -> None:
    choices = ("async", "sync")
    assert parse_choice_option(OWNER, "k", "sync", choices) == "sync"
    assert parse_choice_option(OWNER, "k", " async ", iter(choices)) == "async"
    for bad in ("Sync", "arena", "", 1, None, True):
        with pytest.raises(aioep.InvalidArgument) as info:
            parse_choice_option(OWNER, "k", bad, choices)
        assert str(info.value) == (
            f"test backend option 'k' must be one of ['async', 'sync'], got {bad!r}"
        )


# -- reject_unknown_options --------------------------------------------------------------------


def test_reject_unknown_options() -> None:
    reject_unknown_options(OWNER, None, ("a",))
    reject_unknown_options(OWNER, {}, ())
    reject_unknown_options(OWNER, {"a": 1}, ("a", "b"))
    reject_unknown_options(OWNER, MappingProxyType({"b": "x"}), iter(["a", "b"]))
    with pytest.raises(aioep.InvalidArgument) as info:
        reject_unknown_options(OWNER, {"c": 1, "a": 2, "bogus": 3}, ("a", "b"))
    assert str(info.value) == (
        "test backend: unknown option(s) ['bogus', 'c']; known options are ['a', 'b']"
    )
    with pytest.raises(aioep.InvalidArgument, match=r"unknown option\(s\) \['1'\]"):
        reject_unknown_options(OWNER, {1: "x"}, ("a",))  # type: ignore[dict-item]
    with pytest.raises(aioep.InvalidArgument, match="test backend takes no options"):
        reject_unknown_options(OWNER, {"priority": 1}, ())
    with pytest.raises(aioep.InvalidArgument, match=r"must be a mapping.*got list"):
        reject_unknown_options(OWNER, [("a", 1)], ("a",))  # type: ignore[arg-type]


# -- the backends read a value the same way ----------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [(4096, 4096), ("4096", 4096), (" 4096 ", 4096), ("0x1000", 4096), ("+4096", 4096)],
)
def test_backends_accept_the_same_ints(value: Any, expected: int) -> None:
    assert SimOptions.from_options({"memory_bytes": value}).memory_bytes == expected
    assert CudaOptions.from_options({"pool_release_threshold": value}).pool_release_threshold == (
        expected
    )
    assert OrtOptions.from_options({"chunk_bytes": value}).chunk_bytes == expected


@pytest.mark.parametrize("value", [4096.0, "4096.0", True, "4k", None])
def test_backends_reject_the_same_ints(value: Any) -> None:
    for parse, key in (
        (SimOptions.from_options, "memory_bytes"),
        (CudaOptions.from_options, "pool_release_threshold"),
        (OrtOptions.from_options, "chunk_bytes"),
    ):
        with pytest.raises(aioep.InvalidArgument) as info:
            parse({key: value})
        message = str(info.value)
        assert f"option {key!r} must be" in message
        assert repr(value) in message


def test_backend_floats_and_bools() -> None:
    assert SimOptions.from_options({"latency_us": "2.5"}).latency_us == 2.5
    assert OrtOptions.from_options({"chunk_ms": "2.5"}).chunk_ms == 2.5
    assert OrtOptions.from_options({"chunk_ms": 4}).chunk_ms == 4.0
    for value, expected in ((True, True), ("false", False), ("0", False), (1, True)):
        assert OrtOptions.from_options({"device_check": value}).device_check is expected
    with pytest.raises(aioep.InvalidArgument, match=r"'device_check' must be a bool"):
        OrtOptions.from_options({"device_check": 2})


def test_backend_messages_name_the_owner() -> None:
    with pytest.raises(aioep.InvalidArgument, match=r"^sim backend option 'num_devices'"):
        SimOptions.from_options({"num_devices": 65})
    with pytest.raises(aioep.InvalidArgument, match=r"^cuda backend option 'wake'"):
        CudaOptions.from_options({"wake": "spin"})
    with pytest.raises(aioep.InvalidArgument, match=r"^ort backend option 'chunk_ms'"):
        OrtOptions.from_options({"chunk_ms": 0})
    for parse in (SimOptions.from_options, CudaOptions.from_options, OrtOptions.from_options):
        with pytest.raises(aioep.InvalidArgument, match=r"unknown option\(s\) \['bogus'\]"):
            parse({"bogus": 1})
