"""``mypy --strict`` on a small user program: the main path (a session from bytes, ``run`` in
both forms, ``copy_tensors`` with other libraries' tensors) type-checks precisely, with no
``Any`` in what it reveals, and the misuses the overloads exist for are refused.

mypy comes with the ``dev`` extra: the test skips without it, except where
``AIOEP_REQUIRE_MYPY=1`` (CI's lint step, which installs the extra) makes that a failure."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PROGRAM = HERE / "typed_program.py"
MISUSE = HERE / "typed_misuse.py"
REQUIRED = os.environ.get("AIOEP_REQUIRE_MYPY") == "1"


def _mypy(tmp_path: Path, *files: Path) -> list[str]:
    try:
        import mypy  # noqa: F401
    except ImportError:
        if REQUIRED:
            pytest.fail("AIOEP_REQUIRE_MYPY=1, but mypy is not installed")
        pytest.skip("mypy is not installed (it comes with aioep's dev extra)")
    # Run from outside the repository, as a user's project would: aioep is found installed.
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache")]
        + [str(f) for f in files],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.stdout.splitlines()


def _marked_lines(path: Path, pattern: str) -> dict[int, str]:
    """Line number -> the trailing comment of each code line that matches ``pattern`` (a
    regular expression whose one group is that comment)."""
    found = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = re.fullmatch(pattern, line)
        if match:
            found[number] = match.group(1).strip()
    return found


def test_the_main_path_type_checks_without_any(tmp_path: Path) -> None:
    report = _mypy(tmp_path, PROGRAM, MISUSE)
    program, misuse = str(PROGRAM), str(MISUSE)
    errors = [line for line in report if ": error:" in line and line.startswith(program)]
    assert not errors, "\n".join(errors)
    revealed = {}
    for line in report:
        match = re.match(rf"{re.escape(program)}:(\d+): note: Revealed type is \"(.*)\"", line)
        if match:
            revealed[int(match.group(1))] = match.group(2)
    expected = _marked_lines(PROGRAM, r"\s+(?:\w+ = )?reveal_type\(.*\)  # (.+)")
    assert set(revealed) == set(expected), report
    for number, want in expected.items():
        assert want in revealed[number], (number, want, revealed[number])
        assert "Any" not in revealed[number], (number, revealed[number])
    refused = {
        int(m.group(1))
        for line in report
        if (m := re.match(rf"{re.escape(misuse)}:(\d+): error:", line))
    }
    assert refused == set(_marked_lines(MISUSE, r"\s+\S.*  # (refused)")), report
