"""The CUDA backend's driver-call surface matches the installed cuda-bindings (no GPU needed).

``aioep_cuda`` was written against ``cuda.bindings.driver`` without a GPU, so a misspelled
function or enum name, a wrong argument count or a wrong unpacking of a result tuple would
only show on the first GPU run. This test reads the backend (and the GPU tests and the CUDA
benchmark) with ``ast``, finds every ``drv.<name>...`` attribute chain and ``drv.cuXxx(...)``
call (``drv`` = any name bound to the driver module, or ``driver()``), and checks them
against the bindings: the names resolve, positional argument counts match the binding's
signature, and ``a, b = drv.cuXxx(...)`` / ``a, b = check(drv.cuXxx(...), ...)`` unpack as
many values as the binding returns (read from its docstring's ``Returns`` section).
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

drv = pytest.importorskip("cuda.bindings.driver")

ROOT = Path(__file__).resolve().parents[3]
SOURCES = [
    *sorted((ROOT / "backends" / "cuda" / "aioep_cuda").glob("*.py")),
    ROOT / "tests" / "backends" / "cuda" / "test_cuda.py",
    ROOT / "benchmarks" / "cuda_copy.py",
]
DRIVER_NAMES = {"drv"}  # local names the backend binds to the driver module


@dataclass(frozen=True)
class Use:
    where: str
    chain: tuple[str, ...]  # ("cuMemcpyAsync",) or ("CUresult", "CUDA_SUCCESS")
    nargs: int | None = None  # positional arguments of a call (None: not a plain call)
    unpacked: int | None = None  # values a tuple assignment takes from the call's result
    through_check: bool = False  # the result went through _driver.check (status dropped)


def _chain(node: ast.AST) -> tuple[str, ...] | None:
    """``drv.A.B`` or ``driver().A.B`` -> ("A", "B"); anything else -> None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not parts:
        return None
    rooted = (isinstance(node, ast.Name) and node.id in DRIVER_NAMES) or (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "driver"
        and not node.args
    )
    return tuple(reversed(parts)) if rooted else None


def scan(source: str, filename: str) -> list[Use]:
    """Every driver attribute chain and call in ``source``."""
    tree = ast.parse(source, filename)
    uses: list[Use] = []
    calls: dict[int, Use] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            chain = _chain(node.func)
            if chain is not None:
                plain = not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args)
                use = Use(f"{filename}:{node.lineno}", chain, len(node.args) if plain else None)
                calls[id(node)] = use
                uses.append(use)
        elif isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain is not None:
                uses.append(Use(f"{filename}:{node.lineno}", chain))
    # Tuple unpacking of a driver call's result, directly or through check(...).
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Tuple)
            and isinstance(node.value, ast.Call)
        ):
            continue
        n = len(node.targets[0].elts)
        value = node.value
        through = False
        if isinstance(value.func, ast.Name) and value.func.id == "check" and value.args:
            inner = value.args[0]
            if not isinstance(inner, ast.Call):
                continue
            value, through = inner, True
        call = calls.get(id(value))
        if call is not None:
            uses.append(Use(call.where, call.chain, None, n, through))
    return uses


def _resolve(chain: tuple[str, ...]) -> Any:
    obj: Any = drv
    for part in chain:
        obj = getattr(obj, part)
    return obj


def _positional_count(fn: Any) -> tuple[int, int] | None:
    """(required, total) positional parameters of a binding, or None if not introspectable."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(1 for p in positional if p.default is p.empty)
    return required, len(positional)


def _returned(fn: Any) -> int | None:
    """How many values a binding returns (``CUresult`` included), from its docstring."""
    # The section may be indented (cuda-bindings 12.8 keeps the docstrings' indentation):
    # count the lines at the indentation of its "Returns" heading.
    m = re.search(r"\n([ \t]*)Returns\n[ \t]*-+\n(.*?)(?:\n\s*\n|\Z)", fn.__doc__ or "", re.S)
    if not m:
        return None
    indent = len(m.group(1))
    return sum(
        1
        for line in m.group(2).splitlines()
        if line.strip() and len(line) - len(line.lstrip()) == indent
    )


def problems(uses: list[Use]) -> list[str]:
    """What does not match the bindings, one line per problem (sorted, no duplicates)."""
    out: set[str] = set()
    for use in uses:
        name = ".".join(use.chain)
        try:
            target = _resolve(use.chain)
        except AttributeError:
            out.add(f"{use.where}: cuda.bindings.driver has no {name}")
            continue
        if use.nargs is not None and inspect.isroutine(target):
            counts = _positional_count(target)
            if counts is not None and not counts[0] <= use.nargs <= counts[1]:
                out.add(
                    f"{use.where}: {name} called with {use.nargs} argument(s); the binding "
                    f"takes {counts[1]} {inspect.signature(target)}"
                )
        if use.unpacked is not None:
            total = _returned(target)
            if total is not None:
                expected = total - 1 if use.through_check else total
                if expected == 1 and use.through_check:
                    expected = -1  # check() returns the bare value: tuple unpacking is wrong
                if use.unpacked != expected:
                    via = "check(...)" if use.through_check else "the call"
                    out.add(
                        f"{use.where}: {name}: {via} unpacked into {use.unpacked} names, but the "
                        f"binding returns {total} values (CUresult first)"
                    )
    return sorted(out)


def _all_uses() -> list[Use]:
    uses: list[Use] = []
    for path in SOURCES:
        uses += scan(path.read_text(), str(path.relative_to(ROOT)))
    return uses


def test_the_scan_finds_the_backend_calls() -> None:
    called = {u.chain[0] for u in _all_uses() if u.nargs is not None}
    # A sample of what the backend must use; if the scan misses these it checks nothing.
    for name in (
        "cuInit",
        "cuMemAllocAsync",
        "cuMemcpyAsync",
        "cuEventRecord",
        "cuStreamWaitEvent",
        "cuStreamWaitValue32",
        "cuStreamWriteValue32",
        "cuPointerGetAttribute",
    ):
        assert name in called, name


def test_driver_names_arities_and_unpacking_match_the_bindings() -> None:
    assert problems(_all_uses()) == []


def test_the_check_catches_misspellings_and_wrong_arity() -> None:
    bad = """
drv = None
err, ptr = drv.cuMemAllocAsync(1024)
drv.cuStreamWaitValue32(s, addr, 1)
x = drv.CUevent_flags.CU_EVENT_DISABLE_TIMNG
drv.cuMemcpyAsyc(d, s, n, st)
free, total, extra = check(drv.cuMemGetInfo(), "x")
a, b = check(drv.cuMemAlloc(4), "x")
ok = drv.cuMemcpyAsync(d, s, n, st)[0]
err, ptr = drv.cuMemAlloc(4)
free, total = check(driver().cuMemGetInfo(), "x")
"""
    found = problems(scan(bad, "bad.py"))
    text = "\n".join(found)
    assert "bad.py:3: cuMemAllocAsync called with 1 argument" in text
    assert "bad.py:4: cuStreamWaitValue32 called with 3 argument" in text
    assert "no CUevent_flags.CU_EVENT_DISABLE_TIMNG" in text
    assert "no cuMemcpyAsyc" in text
    assert "bad.py:7: cuMemGetInfo: check(...) unpacked into 3" in text
    assert "bad.py:8: cuMemAlloc: check(...) unpacked into 2" in text
    assert len(found) == 6, text


def test_host_function_launch_matches_the_c_signature() -> None:
    # _driver.launch_host_func calls libcuda's cuLaunchHostFunc through ctypes with three
    # pointer-sized arguments: (CUstream, CUhostFn, void* userData), like the binding.
    assert list(inspect.signature(drv.cuLaunchHostFunc).parameters) == [
        "hStream",
        "fn",
        "userData",
    ]
    from aioep_cuda import _driver

    assert "_load_launch" in dir(_driver)


def test_flag_values_the_backend_relies_on() -> None:
    # Raw values used by benchmarks/cuda_copy.py and the ctypes/int paths.
    assert int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING) == 1
    assert int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING) == 2
    assert int(drv.CUevent_flags.CU_EVENT_BLOCKING_SYNC) == 1
    assert int(drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ) == 0
    assert drv.CUresult.CUDA_SUCCESS == 0
    # Handles convert to and from the integers the backend stores and hands out.
    assert int(drv.CUstream(0x1234)) == 0x1234
    assert int(drv.CUdeviceptr(0x5678)) == 0x5678
    assert len(drv.CUuuid().bytes) == 16


def test_calls_made_without_the_gil_match_the_bindings() -> None:
    # _driver.call_nogil calls these exported symbols through ctypes (cuda-bindings before
    # 12.9.x holds the GIL during a call): as many pointer-sized arguments as the binding.
    from aioep_cuda import _driver

    for symbol, argtypes in _driver._NOGIL_ARGS.items():
        binding = getattr(drv, symbol.removesuffix("_v2"))
        assert len(inspect.signature(binding).parameters) == len(argtypes), symbol
