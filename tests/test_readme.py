"""The README's two fresh-machine commands stay true: CI runs the test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

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
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci
