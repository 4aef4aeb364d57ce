"""check-gpu's command line: ``python -m aioep check-gpu [options] [-- pytest args]``.

Verify the CUDA backend on a GPU in one call, into one JSON summary: a driver probe, the
CUDA tests of the checkout (each crash or hang isolated: it hides no other test), the
copy, pageable-staging and arena benchmarks, and a DLPack exchange with CuPy and PyTorch.
Everything runs within --budget seconds; what the budget did not reach is reported as not
run, and why. The summary says why for each test and figure, and is ok only when every
test passed or skipped and every judged figure was measured and met its target.
--emulator runs the same steps on the checkout's emulated driver (tests/cuda_emulator, a
test double: the figures are measured but not judged), so the command itself can be
checked without a GPU.

Exit status: 0 when ok, 1 otherwise, 2 when there is no GPU (with --emulator: no emulated
driver) or PATH is not an aioep checkout.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from .check import BUDGET, TESTS, run_check
from .runner import ISOLATE, TEST_TIMEOUT

__all__ = ["build_parser", "main", "not_a_checkout"]

_NEEDS = ("pyproject.toml", "benchmarks/cuda_copy.py", TESTS[0])
_EMULATOR = "tests/cuda_emulator/__init__.py"


def not_a_checkout(path: Path, *, emulator: bool = False) -> str | None:
    """Why ``path`` is not an aioep checkout the check can run, or None if it is."""
    if not path.is_dir():
        return f"{path} is not a directory" if path.exists() else f"{path} does not exist"
    missing = [f for f in (*_NEEDS, *([_EMULATOR] if emulator else [])) if not (path / f).is_file()]
    if missing:
        return f"{path} is not an aioep checkout: it has no {', '.join(missing)}"
    pyproject = (path / "pyproject.toml").read_text(errors="replace")
    if not re.search(r'^name\s*=\s*"aioep"\s*$', pyproject, re.MULTILINE):
        return f"{path} is not an aioep checkout: its pyproject.toml does not name aioep"
    return None


def build_parser() -> argparse.ArgumentParser:
    """The options of ``check-gpu`` (see the module docstring)."""
    p = argparse.ArgumentParser(
        prog="aioep check-gpu",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--checkout",
        type=Path,
        default=Path("."),
        metavar="PATH",
        help="the aioep checkout whose tests and benchmarks to run (default: .); nothing "
        "searches for one",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("check-gpu.json"),
        help="where to write the JSON summary (default: ./check-gpu.json)",
    )
    p.add_argument(
        "--emulator",
        action="store_true",
        help="run on the emulated driver of tests/cuda_emulator (a test double; implies --quick)",
    )
    p.add_argument("--quick", action="store_true", help="small benchmark sizes (not judged)")
    p.add_argument(
        "--budget",
        type=float,
        default=BUDGET,
        help=f"seconds for the whole check (default {BUDGET:g}); what it does not reach is "
        "reported as not run",
    )
    p.add_argument(
        "--test-timeout",
        type=float,
        default=TEST_TIMEOUT,
        help=f"seconds after which a test counts as hung (default {TEST_TIMEOUT:g}): every "
        "thread's stack is recorded and the other tests go on in a new process",
    )
    p.add_argument(
        "--isolate",
        choices=ISOLATE,
        default="crashed",
        help="test functions to run again alone, each in a process of its own (default: "
        "those that crashed or hung)",
    )
    p.add_argument(
        "--max-crashes-per-function",
        type=int,
        default=3,
        help="after this many cases of one test function crashed or hung, its other cases are "
        "reported as not run instead of each costing a process (default 3; 0: run them all)",
    )
    p.add_argument("--no-tests", action="store_true", help="skip the pytest run")
    p.add_argument("--no-benchmarks", action="store_true", help="skip the benchmarks")
    p.add_argument(
        "pytest_args",
        nargs=argparse.REMAINDER,
        help="after --: extra pytest arguments (e.g. -- -k ordering)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check (``python -m check_gpu``, or ``python -m aioep check-gpu``); the exit
    status (see the module docstring)."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    extra = list(args.pytest_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    checkout = args.checkout.resolve()
    problem = not_a_checkout(checkout, emulator=args.emulator)
    if problem is not None:
        print(
            f"check-gpu: {problem}; run it from the root of an aioep checkout or pass "
            "--checkout PATH",
            file=sys.stderr,
        )
        return 2
    summary = run_check(
        checkout=checkout,
        out=args.out,
        emulator=args.emulator,
        quick=args.quick or args.emulator,
        tests=not args.no_tests,
        benchmarks=not args.no_benchmarks,
        pytest_args=extra,
        budget=args.budget,
        test_timeout=args.test_timeout,
        isolate=args.isolate,
        max_deaths_per_function=args.max_crashes_per_function,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    if summary.get("status") == "no-gpu":
        return 2
    return 0 if summary["ok"] else 1
