"""The README's two fresh-machine commands stay true: CI runs the test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line for b in blocks for line in b.splitlines() if line.startswith("python3 -m venv")]


def test_readme_has_demo_and_test_commands() -> None:
    demo, tests = _readme_commands()[:2]
    assert "examples/quickstart.py" in demo
    assert "backends/sim" in demo
    assert "pytest" in tests
    assert (ROOT / "examples" / "quickstart.py").is_file()


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    tests = _readme_commands()[1]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci


def _lower_bounds() -> dict[str, str]:
    """``name -> X`` for every ``name>=X`` the pyproject files declare: the core, test and
    backend dependencies and the user extras (not the docs site's tools, which CI builds
    with the newest versions only, nor the dev tools, which are pinned exactly)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the 3.13 CI run checks this
    bounds: dict[str, str] = {}
    for path in [ROOT / "pyproject.toml", *sorted((ROOT / "backends").glob("*/pyproject.toml"))]:
        project = tomllib.loads(path.read_text())["project"]
        reqs = list(project["dependencies"])
        for extra, deps in project.get("optional-dependencies", {}).items():
            if extra not in ("dev", "docs"):
                reqs += deps
        for req in reqs:
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=([0-9][^,;\s]*)", req.strip())
            if m and not m.group(1).startswith("aioep"):
                name = m.group(1).lower().replace("_", "-")
                assert bounds.setdefault(name, m.group(2)) == m.group(2), (
                    f"{name} has two lower bounds: {bounds[name]} and {m.group(2)} ({path})"
                )
    return bounds


def test_lowest_constraints_pin_every_declared_lower_bound() -> None:
    bounds = _lower_bounds()
    pins = {}
    for line in (ROOT / ".ci" / "lowest-constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    for name, bound in bounds.items():
        assert name in pins, f".ci/lowest-constraints.txt does not pin {name} (>= {bound})"
        assert Version(pins[name]) == Version(bound), (
            f"{name}: pyproject says >= {bound}, .ci/lowest-constraints.txt pins {pins[name]}"
        )
    assert set(pins) == set(bounds), f"pinned but never declared: {set(pins) - set(bounds)}"


def _claimed_pythons() -> list[str]:
    """The minor versions pyproject.toml's classifiers claim, e.g. ``["3.10", "3.11"]``."""
    text = (ROOT / "pyproject.toml").read_text()
    return re.findall(r'"Programming Language :: Python :: (3\.\d+)"', text)


def test_ci_runs_every_claimed_python_and_the_lowest_versions() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    claimed = _claimed_pythons()
    assert claimed == ["3.10", "3.11", "3.12", "3.13"]
    matrix = re.search(r"^SUPPORTED=\(([^)]*)\)", ci, flags=re.M)
    assert matrix is not None, ".ci/run lost its SUPPORTED=(...) matrix"
    assert matrix.group(1).split() == claimed
    # every claimed version runs the README's test command (the oldest one explicitly, the
    # others in the loop after the WebGPU driver)
    assert "run_readme_tests 3.10" in ci
    assert re.search(r"for v in 3\.11 3\.12 3\.13; do\s+run_readme_tests", ci)
    assert "-c .ci/lowest-constraints.txt" in ci
    assert 'requires-python = ">=3.10"' in (ROOT / "pyproject.toml").read_text()


def test_ci_runs_the_readme_demo_command_verbatim_and_checks_its_output() -> None:
    demo = _readme_commands()[0]
    ci = (ROOT / ".ci" / "run").read_text()
    assert demo in [line.strip() for line in ci.splitlines()]
    # the check reads the demo's own closing line, which the quickstart prints
    assert "round trips are bit-exact" in ci
    assert "round trips are bit-exact" in (ROOT / "examples" / "quickstart.py").read_text()


def test_readme_names_the_pythons_it_was_tested_on() -> None:
    text = (ROOT / "README.md").read_text()
    claimed = _claimed_pythons()
    assert f"Python {claimed[0]}\N{EN DASH}{claimed[-1]}" in text
    tested = re.search(r"CI tests it on Python ([0-9., and]+)", text)
    assert tested is not None, "the README no longer says which Pythons CI tests"
    assert re.findall(r"3\.\d+", tested.group(1)) == claimed


def test_getting_started_names_the_pythons_ci_runs() -> None:
    text = (ROOT / "docs" / "getting-started.md").read_text()
    claimed = _claimed_pythons()
    assert f"Python {claimed[0]}\N{EN DASH}{claimed[-1]}" in text
    runs = re.search(r"runs the test suite on Python ([0-9., and]+)", text)
    assert runs is not None, "getting-started no longer says which Pythons CI runs"
    assert re.findall(r"3\.\d+", runs.group(1)) == claimed


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_every_path_the_page_names_is_in_a_clone(page: str) -> None:
    """A backquoted repository path (``docs/concepts/``, ``.ci/run``, ``tests/cuda_emulator``)
    names something a clone has: not a file outside the repository."""
    text = (ROOT / page).read_text()
    named = set(re.findall(r"`(\.?[\w-]+(?:/[\w.-]*)+|[\w-]+\.(?:md|py|sh|txt|toml))`", text))
    assert named, f"{page} names no path: the pattern is out of date"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{page} names paths a clone does not have: {missing}"
