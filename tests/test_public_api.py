"""The public surface: ``aioep.__all__`` is exactly what the package exports, ``aioep.abc`` is
the whole plugin contract, every public name has a docstring, and the in-tree backends and
examples use nothing else."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioep
import aioep._plugin.tensor
import aioep.abc
import aioep.bench

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_MODULES = {"aioep", "aioep.abc", "aioep.bench", "aioep.onnx_backend", "aioep.pytest_plugin"}
BACKEND_MODULES = {"aioep", "aioep.abc"}


def _public_names(module: types.ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }


def test_all_matches_exports() -> None:
    assert len(aioep.__all__) == len(set(aioep.__all__))
    assert set(aioep.__all__) == _public_names(aioep)
    for name in aioep.__all__:
        assert getattr(aioep, name) is not None


def test_core_names_are_public() -> None:
    for name in [
        "Environment", "EpDevice", "EpFactory", "Tensor", "Buffer", "Allocator", "CopyFuture",
        "SyncStream", "Notification", "MemoryInfo", "MemoryDevice", "HardwareDevice",
        "DeviceType", "MemoryType", "AllocatorType", "EpError", "ErrorCode", "InvalidArgument",
        "NoSuchFile", "NotImplementedByEp", "InUseError", "DeviceError", "ClosedError",
        "copy_tensors", "current_environment",
    ]:  # fmt: skip
        assert name in aioep.__all__, name


def test_abc_module() -> None:
    assert len(aioep.abc.__all__) == len(set(aioep.abc.__all__))
    assert set(aioep.abc.__all__) == _public_names(aioep.abc)
    assert {"DataTransfer", "EpFactory", "Allocator", "StreamImpl"} <= set(aioep.abc.__all__)
    assert aioep.abc.EpFactory is aioep.EpFactory


def test_abc_holds_the_whole_ep_contract() -> None:
    # What an EP needs: the interface, the graph view it inspects, host memory, DLPack.
    for name in [
        "Ep", "CompiledNode", "FusedGroup", "IndexedSubGraph", "MetaDef", "GraphView", "Node",
        "ValueInfo", "Initializer", "HOST_MEMORY_INFO", "register_dlpack_exporter",
    ]:  # fmt: skip
        assert name in aioep.abc.__all__, name
    for name in set(aioep.abc.__all__) & set(aioep.__all__):
        assert getattr(aioep.abc, name) is getattr(aioep, name), name
    assert aioep.Tensor.from_numpy(np.zeros(1)).memory_info == aioep.abc.HOST_MEMORY_INFO
    assert aioep.abc.HOST_MEMORY_INFO.device.is_host_accessible


def test_bench_module() -> None:
    assert set(aioep.bench.__all__) == _public_names(aioep.bench)
    assert {"run_bench", "format_report", "plot_report", "BenchReport"} <= set(aioep.bench.__all__)


def test_public_classes_live_in_private_modules() -> None:
    for name in aioep.__all__:
        obj = getattr(aioep, name)
        module = getattr(obj, "__module__", "aioep")
        assert module == "aioep" or module.startswith("aioep._"), (name, module)


# -- docstrings --------------------------------------------------------------------------------


def _attribute_docstring(module: types.ModuleType, name: str) -> str | None:
    """The string literal after ``name = ...`` at module level (what mkdocstrings shows), following
    ``from ._x import name as name`` re-exports to the defining module."""
    tree = ast.parse(inspect.getsource(module))
    body = tree.body
    for stmt, after in zip(body, [*body[1:], None]):
        targets: list[ast.expr] = []
        if isinstance(stmt, ast.Assign):
            targets = stmt.targets
        elif isinstance(stmt, ast.AnnAssign):
            targets = [stmt.target]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                return after.value.value
            return None
        if isinstance(stmt, ast.ImportFrom) and stmt.level == 1 and stmt.module:
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    source = importlib.import_module(f"aioep.{stmt.module}")
                    return _attribute_docstring(source, alias.name)
    return None


def _docstring(module: types.ModuleType, name: str) -> str | None:
    obj = getattr(module, name)
    if inspect.isclass(obj):
        # The class's own docstring, not one inherited from a base (Enum, ABC ...).
        doc = vars(obj).get("__doc__")
        return doc if isinstance(doc, str) else None
    if callable(obj) and not isinstance(obj, types.GenericAlias):
        return inspect.getdoc(obj)
    return _attribute_docstring(module, name)


@pytest.mark.parametrize(
    ("module", "name"),
    [
        (module, name)
        for module in (aioep, aioep.abc, aioep.bench)
        for name in module.__all__  # type: ignore[attr-defined]
    ],
)
def test_every_public_name_has_a_docstring(module: types.ModuleType, name: str) -> None:
    doc = _docstring(module, name)
    assert doc, f"{module.__name__}.{name} has no docstring"
    assert doc.strip(), f"{module.__name__}.{name} has an empty docstring"
    summary = doc.strip().splitlines()[0]
    assert len(summary) <= 100, f"{module.__name__}.{name}: summary line too long: {summary!r}"


# -- backends and examples import only the public API ----------------------------------------


def _private_uses(source: str, allowed_modules: set[str]) -> list[str]:
    """Every place ``source`` reaches past the public API: an aioep module outside
    ``allowed_modules``, a name that is not in the module's ``__all__``, or ``aioep._x``."""
    problems: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "aioep" and alias.name not in allowed_modules:
                    problems.append(f"line {node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "aioep":
                continue
            if node.module not in allowed_modules:
                problems.append(f"line {node.lineno}: from {node.module} import ...")
                continue
            exported = set(importlib.import_module(node.module).__all__)
            for alias in node.names:
                if alias.name not in exported:
                    problems.append(f"line {node.lineno}: {alias.name} is not in {node.module}")
        elif isinstance(node, ast.Attribute):
            # aioep._x, aioep.abc._x ... (dunders such as aioep.__file__ are fine)
            parts: list[str] = [node.attr]
            value: Any = node.value
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            private = node.attr.startswith("_") and not node.attr.endswith("__")
            if private and isinstance(value, ast.Name) and value.id == "aioep":
                problems.append(f"line {node.lineno}: aioep.{'.'.join(reversed(parts))}")
    return problems


def test_private_use_checker_catches_private_imports() -> None:
    bad = (
        "import aioep._plugin.tensor\n"
        "from aioep._plugin.ep import Ep\n"
        "from aioep import _graph\n"
        "from aioep.bench import run_bench\n"
        "import aioep\n"
        "x = aioep._plugin.tensor.HOST_MEMORY_INFO\n"
    )
    assert len(_private_uses(bad, BACKEND_MODULES)) == 5
    good = "import aioep\nfrom aioep.abc import Ep, GraphView\nprint(aioep.__file__)\n"
    assert _private_uses(good, BACKEND_MODULES) == []


def _sources(pattern: str) -> list[Path]:
    files = sorted(ROOT.glob(pattern))
    assert files, f"no files match {pattern}"
    return files


@pytest.mark.parametrize("backend", ["sim", "cuda", "ort"])
def test_backends_import_only_aioep_and_aioep_abc(backend: str) -> None:
    problems = {
        str(path.relative_to(ROOT)): found
        for path in _sources(f"backends/{backend}/aioep_{backend}/**/*.py")
        if (found := _private_uses(path.read_text(encoding="utf-8"), BACKEND_MODULES))
    }
    assert problems == {}


def test_examples_use_only_the_public_api() -> None:
    problems = {
        str(path.relative_to(ROOT)): found
        for path in _sources("examples/*.py")
        if (found := _private_uses(path.read_text(encoding="utf-8"), PUBLIC_MODULES))
    }
    assert problems == {}


def test_import_contracts_hold() -> None:
    # The import-linter contracts in pyproject.toml, where the dev extra is installed (CI runs
    # `lint-imports` too); the ast scans above need no extra package.
    pytest.importorskip("importlinter")
    exe = Path(sys.executable).parent / ("lint-imports.exe" if os.name == "nt" else "lint-imports")
    if not exe.exists():
        pytest.skip(f"import-linter is installed without its {exe.name} script")
    done = subprocess.run(
        [str(exe), "--no-cache", "--no-logo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 broken." in done.stdout, done.stdout


# -- register_dlpack_exporter -------------------------------------------------------------------

_TEST_VENDOR_ID = 0x7E57  # no backend uses it


def _device_tensor() -> aioep.Tensor:
    device = aioep.MemoryDevice(aioep.DeviceType.GPU, aioep.MemoryType.DEFAULT, _TEST_VENDOR_ID, 3)
    buffer = aioep.Buffer(0x1000, 64, aioep.MemoryInfo("TestDev", device))
    return aioep.Tensor(buffer, (4,), "float32")


def test_register_dlpack_exporter() -> None:
    calls: list[tuple[aioep.Tensor, Any]] = []

    def export(tensor: aioep.Tensor, stream: Any) -> str:
        calls.append((tensor, stream))
        return "capsule"

    def other(tensor: aioep.Tensor, stream: Any) -> str:
        raise AssertionError("the first exporter stays")

    t = _device_tensor()
    with pytest.raises(BufferError, match="no DLPack export"):
        t.__dlpack__()
    try:
        assert aioep.abc.register_dlpack_exporter(_TEST_VENDOR_ID, export) is True
        assert aioep.abc.register_dlpack_exporter(_TEST_VENDOR_ID, export) is True
        assert aioep.abc.register_dlpack_exporter(_TEST_VENDOR_ID, other) is False
        assert t.__dlpack__(stream=7) == "capsule"
        assert calls == [(t, 7)]
        # Host tensors go through numpy whatever is registered.
        host = aioep.Tensor.from_numpy(np.arange(3, dtype=np.float32))
        np.testing.assert_array_equal(np.from_dlpack(host), [0, 1, 2])
    finally:
        aioep._plugin.tensor._dlpack_exporters.pop(_TEST_VENDOR_ID, None)


@pytest.mark.parametrize(
    ("vendor_id", "exporter", "match"),
    [
        (-1, print, "vendor_id"),
        (True, print, "vendor_id"),
        ("0x10de", print, "vendor_id"),
        (1, "not callable", "callable"),
    ],
)
def test_register_dlpack_exporter_rejects_bad_arguments(
    vendor_id: Any, exporter: Any, match: str
) -> None:
    with pytest.raises(aioep.InvalidArgument, match=match):
        aioep.abc.register_dlpack_exporter(vendor_id, exporter)
    assert vendor_id not in aioep._plugin.tensor._dlpack_exporters
