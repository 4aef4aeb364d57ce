"""The package layout shows the architecture: the top of ``aioep/`` holds only the public faces
and the private subpackages (one per layer of pyproject.toml's import-linter contract), each
subpackage says its job, and ``tests/`` mirrors the subpackages."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "aioep"
TESTS = ROOT / "tests"

PUBLIC_FACES = {"__init__.py", "__main__.py", "abc.py", "bench.py", "onnx_backend.py"}
PUBLIC_FACES |= {"pytest_plugin.py", "py.typed"}
# Test folders that mirror no subpackage: the backends', the emulated driver's, the examples'
# and the docs' own tests.
OWN_FOLDERS = {"backends", "cuda_emulator", "examples", "docs"}


def subpackages() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")


def contract(contract_id: str) -> dict[str, object]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for found in config["tool"]["importlinter"]["contracts"]:
        if found["id"] == contract_id:
            return dict(found)
    raise AssertionError(f"no import-linter contract {contract_id!r} in pyproject.toml")


def test_only_the_public_faces_sit_beside_the_subpackages() -> None:
    files = {p.name for p in PACKAGE.iterdir() if p.is_file() and p.suffix in (".py", ".typed")}
    assert files == PUBLIC_FACES
    for name in subpackages():
        assert name.startswith("_"), f"aioep/{name}/ is private machinery: name it _{name}"
        assert (PACKAGE / name / "__init__.py").is_file(), f"aioep/{name}/ is not a package"


@pytest.mark.parametrize("name", subpackages())
def test_each_subpackage_says_its_job_and_what_it_imports(name: str) -> None:
    init = PACKAGE / name / "__init__.py"
    tree = ast.parse(init.read_text())
    docstring = ast.get_docstring(tree)
    assert docstring, f"aioep/{name}/__init__.py has no docstring saying what the room holds"
    assert "Imports" in docstring, f"aioep/{name}/__init__.py does not say what it may import"
    # A docstring and nothing else: the public API is re-exported from aioep/__init__.py only.
    assert len(tree.body) == 1, f"aioep/{name}/__init__.py holds code besides its docstring"
    for module in (PACKAGE / name).glob("*.py"):
        assert not module.name.startswith("_") or module.name == "__init__.py", (
            f"{module.relative_to(ROOT)}: the subpackage is private already; drop the underscore"
        )


def test_the_layer_contract_names_every_subpackage_and_public_face() -> None:
    layers = contract("core-layers")
    assert layers["containers"] == ["aioep"]
    assert layers["exhaustive"] is True
    named = {part.strip() for layer in layers["layers"] for part in str(layer).split("|")}
    faces = {Path(f).stem for f in PUBLIC_FACES if f.endswith(".py") and f != "__init__.py"}
    assert named == set(subpackages()) | faces


def test_tests_mirror_the_subpackages() -> None:
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    folders.discard("__pycache__")
    mirrored = {name.removeprefix("_") for name in subpackages()}
    assert folders - OWN_FOLDERS == mirrored, "tests/ should have one folder per subpackage"
    for name in mirrored:
        assert list((TESTS / name).glob("test_*.py")), f"tests/{name}/ has no tests"
    backends = {p.name for p in (ROOT / "backends").iterdir() if (p / "pyproject.toml").is_file()}
    assert {p.name for p in (TESTS / "backends").iterdir() if p.is_dir()} - {
        "__pycache__"
    } == backends


def test_project_wide_tests_alone_sit_at_the_top_of_tests() -> None:
    top = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert top == [
        "test_dataclass_defaults.py",
        "test_layout.py",
        "test_public_api.py",
        "test_readme.py",
    ]
