"""Run every test function of a test file in its own process and say how each ended.

    python tests/cuda_emulator/run_each.py tests/backends/cuda/test_cuda.py [--timeout 90] [-k EXPR]

Each function runs as ``python -m pytest FILE::NAME`` (all its parameters in that one
process), so an abort or a crash in one never hides the others. Outcomes: ``pass``,
``fail``, ``skip``, ``misuse`` (the strict CUDA emulator aborted: its MISUSE line is shown),
``crash`` (another signal), ``hang`` (killed after the timeout; pytest's faulthandler dumps
every thread's stack a little before, and the dump is shown). Under the emulator, as in the
normal test run (the driver is chosen by ``cuda_emulator.select_driver``).
"""

from __future__ import annotations

import argparse
import ast
import re
import signal
import subprocess
import sys
from pathlib import Path


def functions_in(path: Path) -> list[str]:
    """The names of the module-level test functions of ``path``, in order."""
    tree = ast.parse(path.read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    ]


def run_one(path: Path, name: str, timeout: float) -> tuple[str, str]:
    """(outcome, detail) of one test function run in its own process."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        f"{path}::{name}",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        f"faulthandler_timeout={max(1, int(timeout) - 15)}",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        out = (
            (exc.stdout or b"").decode(errors="replace")
            if isinstance(exc.stdout, bytes)
            else (exc.stdout or "")
        )
        err = (
            (exc.stderr or b"").decode(errors="replace")
            if isinstance(exc.stderr, bytes)
            else (exc.stderr or "")
        )
        return "hang", _stacks(out + err)
    said = done.stdout + done.stderr
    misuse = [line for line in said.splitlines() if "MISUSE" in line]
    if done.returncode < 0:
        sig = signal.Signals(-done.returncode).name
        if misuse:
            return "misuse", misuse[0] + "\n" + _python_stack(said)
        return "crash", f"{sig}\n{_python_stack(said)}"
    summary = said.strip().splitlines()[-1] if said.strip() else ""
    if done.returncode == 0:
        return ("skip" if "skipped" in summary and "passed" not in summary else "pass"), summary
    failures = [line for line in said.splitlines() if line.startswith(("FAILED", "ERROR", "E "))]
    # recorded misuses (abort_on_misuse=0): every distinct one, not only the last violation
    for line in dict.fromkeys(line.strip(". ") for line in said.splitlines() if "MISUSE" in line):
        failures.insert(0, line)
    return "fail", "\n".join([*failures[:12], summary])


def _python_stack(said: str) -> str:
    """The faulthandler section of the output (the thread that aborted or crashed)."""
    match = re.search(r"(Fatal Python error.*?)(?:\n\nExtension modules|\Z)", said, re.S)
    if not match:
        return ""
    lines = [line for line in match.group(1).splitlines() if "site-packages" not in line]
    return "\n".join(lines[:30])


def _stacks(said: str) -> str:
    match = re.search(r"(Timeout \(\d.*)", said, re.S)
    text = match.group(1) if match else said[-4000:]
    lines = [line for line in text.splitlines() if "site-packages" not in line]
    return "\n".join(lines[:80])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("-k", default="", help="only the names containing this")
    args = parser.parse_args()
    counts: dict[str, int] = {}
    for name in functions_in(args.file):
        if args.k and args.k not in name:
            continue
        outcome, detail = run_one(args.file, name, args.timeout)
        counts[outcome] = counts.get(outcome, 0) + 1
        print(f"{outcome:7} {name}", flush=True)
        if outcome not in ("pass", "skip"):
            print("        " + detail.replace("\n", "\n        "), flush=True)
    print("totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0 if set(counts) <= {"pass", "skip"} else 1


if __name__ == "__main__":
    raise SystemExit(main())
