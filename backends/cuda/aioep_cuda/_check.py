"""``python -m aioep check-gpu``: the entry point of the GPU check (group ``aioep.commands``).

The check is a tool of an aioep checkout, not part of this package: its harness (the
crash-isolating test runner, the figures' judge, the probes) lives in the checkout's
``tools/check_gpu``, beside the tests and benchmarks it runs. This module only adds the
subcommand: it takes ``--checkout PATH`` (default: the current directory), refuses when PATH
is not an aioep checkout, and hands every other argument to the checkout's harness
(``check_gpu.cli.main``). Nothing searches the disk for a checkout.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

__all__ = ["HARNESS", "add_parser", "not_a_checkout"]

HARNESS = Path("tools") / "check_gpu"
"""Where an aioep checkout keeps the GPU check's harness."""


def not_a_checkout(path: Path) -> str | None:
    """Why ``path`` is not an aioep checkout that holds the harness, or None if it is."""
    if not path.exists():
        return f"{path} does not exist"
    if not path.is_dir():
        return f"{path} is not a directory"
    if not (path / HARNESS / "cli.py").is_file():
        return f"{path} is not an aioep checkout: it has no {HARNESS / 'cli.py'}"
    return None


def _command(args: argparse.Namespace) -> int:
    checkout: Path = args.checkout.resolve()
    problem = not_a_checkout(checkout)
    if problem is not None:
        print(
            f"check-gpu: {problem}; run it from the root of an aioep checkout (git clone) or "
            "pass --checkout PATH",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str((checkout / HARNESS.parent).resolve()))
    cli = importlib.import_module("check_gpu.cli")
    status: int = cli.main(["--checkout", str(checkout), *args.rest])
    return status


def add_parser(sub: Any) -> None:
    """Add ``check-gpu`` to the ``aioep`` command line: the checkout's harness parses every
    argument but ``--checkout`` (``check-gpu --help`` prints them)."""
    p = sub.add_parser(
        "check-gpu",
        help="verify the CUDA backend on a GPU from an aioep checkout: tests, benchmarks, "
        "DLPack; one JSON summary",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,  # --help goes to the harness, which knows every option
        allow_abbrev=False,
    )
    p.add_argument(
        "--checkout",
        type=Path,
        default=Path("."),
        help="the aioep checkout whose tests, benchmarks and harness to run (default: .)",
    )
    p.set_defaults(func=_command, passthrough=True)
