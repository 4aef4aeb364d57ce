"""The option-parsing helpers of aioep.abc, and that the backends share their rules."""

from __future__ import annotations

import threading
from fractions import Fraction
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import aioep
from aioep._base.validate import check_timeout
from aioep._environment.host import HostFactory
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


# -- any value in: a parsed value or InvalidArgument, with a bounded message ------------------

HUGE_DIGITS = "9" * 5000  # over Python's 4,300-digit limit for int <-> str conversion
PARSERS = {
    "int": lambda v: parse_int_option(OWNER, "k", v, minimum=0, maximum=1 << 40),
    "unbounded int": lambda v: parse_int_option(OWNER, "k", v),
    "float": lambda v: parse_float_option(OWNER, "k", v, minimum=0, maximum=1e6),
    "unbounded float": lambda v: parse_float_option(OWNER, "k", v),
    "bool": lambda v: parse_bool_option(OWNER, "k", v),
    "choice": lambda v: parse_choice_option(OWNER, "k", v, ("a", "b")),
}


def _parses_or_refuses(parse: Any, value: Any) -> None:
    try:
        parse(value)
    except aioep.InvalidArgument as exc:
        message = str(exc)
        assert message.startswith("test backend option 'k' must be")
        assert len(message) < 300, message  # never the whole value


@pytest.mark.parametrize("parser", sorted(PARSERS))
@pytest.mark.parametrize(
    "value",
    [
        HUGE_DIGITS,
        f"  -{HUGE_DIGITS}  ",
        "1" * 20_000 + "x",  # the old float pattern backtracked for a minute on this
        HUGE_DIGITS + ".5",
        "1e" + HUGE_DIGITS,
        "x" * 100_000,
    ],
    ids=lambda v: f"{len(v)}-chars",
)
def test_strings_past_the_int_string_limit_are_refused_briefly(parser: str, value: str) -> None:
    with pytest.raises(aioep.InvalidArgument) as info:
        PARSERS[parser](value)
    message = str(info.value)
    assert len(message) < 300, message
    assert message.startswith("test backend option 'k' must be")
    assert f"({len(value)} characters)" in message  # a truncated rendering, and its size


@pytest.mark.parametrize(
    "value", [10**5000, -(10**400), Fraction(10**400, 3)], ids=["10**5000", "-10**400", "frac"]
)
def test_huge_numbers_are_refused_briefly_where_out_of_range(value: Any) -> None:
    for name in ("int", "float", "bool", "choice"):
        with pytest.raises(aioep.InvalidArgument) as info:
            PARSERS[name](value)
        assert len(str(info.value)) < 300
    for name in ("unbounded int", "unbounded float"):
        _parses_or_refuses(PARSERS[name], value)  # an int is an int, however large


def test_the_int_limit_is_named_and_hex_has_none() -> None:
    with pytest.raises(aioep.InvalidArgument, match=r"\(5000 characters\) \(too many digits\)$"):
        parse_int_option(OWNER, "k", HUGE_DIGITS)
    with pytest.raises(aioep.InvalidArgument, match=r"got <an int of about 5001 digits>$"):
        parse_int_option(OWNER, "k", 10**5000, maximum=10)
    with pytest.raises(aioep.InvalidArgument, match=r"\(5001 characters\) \(too many digits\)$"):
        parse_int_option(OWNER, "k", "0" * 5000 + "1")  # Python counts the zeros too
    assert parse_float_option(OWNER, "k", "0" * 5000 + "1") == 1.0
    # Python converts power-of-two bases without a limit: a huge hex string is just a number.
    assert parse_int_option(OWNER, "k", "0x" + "f" * 5000) == 16**5000 - 1
    assert parse_float_option(OWNER, "k", "0." + "0" * 5000 + "1") == 0.0


@given(st.text())
def test_any_string_parses_or_is_invalid_argument(text: str) -> None:
    for parse in PARSERS.values():
        _parses_or_refuses(parse, text)


@given(
    st.one_of(
        st.integers(),
        st.integers(min_value=-(10**6000), max_value=10**6000),
        st.floats(),
        st.fractions(),
        st.booleans(),
        st.none(),
        st.binary(max_size=8),
    )
)
def test_any_value_parses_or_is_invalid_argument(value: Any) -> None:
    for parse in PARSERS.values():
        _parses_or_refuses(parse, value)


def test_long_unknown_keys_are_cut() -> None:
    with pytest.raises(aioep.InvalidArgument) as info:
        reject_unknown_options(OWNER, {"k" * 5000: 1}, ("a",))
    assert "(5000 characters)" in str(info.value)
    assert len(str(info.value)) < 300


@given(
    st.sampled_from(["arena.max_mem", "arena.extend_strategy", "arena.initial_chunk_size_bytes"]),
    st.one_of(st.text(), st.integers(min_value=-(10**6000), max_value=10**6000), st.floats()),
)
def test_arena_options_parse_or_are_invalid_argument(key: str, value: Any) -> None:
    try:
        aioep.ArenaConfig.from_options({key: value})
    except aioep.InvalidArgument as exc:
        message = str(exc)
        assert len(message) < 300


@pytest.mark.parametrize("value", [10**5000, HUGE_DIGITS, "9" * 4000], ids=["int", "5000", "4000"])
def test_arena_options_past_the_limit_are_refused_briefly(value: Any) -> None:
    with pytest.raises(aioep.InvalidArgument, match=r"'arena\.max_mem'") as info:
        aioep.ArenaConfig.from_options({"arena.max_mem": value})
    assert len(str(info.value)) < 300


# -- every backend: counts are whole ints, reported as given -----------------------------------


@pytest.mark.parametrize("value", [2.7, "2.7", "x", True, HUGE_DIGITS])
def test_every_backend_refuses_a_count_that_is_not_a_whole_int(value: Any) -> None:
    """No backend truncates ``2.7`` or reports ``"x"`` as something else: each says what
    it was given (the host backend's copy_threads took 2.7 as 2 and called "x" 0)."""
    shown = repr(value) if len(repr(value)) < 60 else "(5000 characters)"
    for parse, owner, key in (
        (lambda v: HostFactory({"copy_threads": v}), "host backend", "copy_threads"),
        (lambda v: SimOptions.from_options({"num_devices": v}), "sim backend", "num_devices"),
        (
            lambda v: CudaOptions.from_options({"staging_chunks": v}),
            "cuda backend",
            "staging_chunks",
        ),
        (lambda v: OrtOptions.from_options({"chunk_bytes": v}), "ort backend", "chunk_bytes"),
    ):
        with pytest.raises(aioep.InvalidArgument) as info:
            parse(value)
        message = str(info.value)
        assert message.startswith(f"{owner} option {key!r} must be an integer"), message
        assert shown in message
        assert len(message) < 300


def test_host_copy_threads() -> None:
    assert HostFactory({"copy_threads": "4"}).create_data_transfer()._workers == 4
    assert HostFactory({"copy_threads": 1024}).create_data_transfer()._workers == 1024
    for bad in (0, -1, 1025, 10**5000):
        with pytest.raises(aioep.InvalidArgument, match=r"'copy_threads' must be an integer in"):
            HostFactory({"copy_threads": bad})
    with pytest.raises(aioep.InvalidArgument, match=r"unknown option\(s\) \['speed'\]"):
        HostFactory({"speed": 1})


# -- timeouts of blocking waits ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [
        (None, None),
        (0, 0.0),
        (2.5, 2.5),
        (np.float32(0.5), 0.5),
        (threading.TIMEOUT_MAX, threading.TIMEOUT_MAX),
        (float("inf"), None),
        (1e300, None),  # threading refuses it (OverflowError): it means "as long as it takes"
        (10**400, None),  # an int beyond a float's range
        (Fraction(10**400, 3), None),
        (threading.TIMEOUT_MAX * 2, None),
    ],
    ids=lambda v: repr(v)[:24],
)
def test_timeout_values(timeout: Any, expected: float | None) -> None:
    assert check_timeout("wait", timeout) == expected


@pytest.mark.parametrize(
    "timeout",
    [-1, -1e-9, float("nan"), float("-inf"), -(10**400), "1", True, 1j],
    ids=lambda v: repr(v)[:24],
)
def test_timeout_refusals(timeout: Any) -> None:
    with pytest.raises(aioep.InvalidArgument, match=r"^wait: timeout must be"):
        check_timeout("wait", timeout)
