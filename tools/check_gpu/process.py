"""Child processes: run one with a time limit, keep the tail of its output, name its signal.

Every step of the check runs in a child (this process never loads the CUDA driver), so a
crash or a hang costs only that step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "TIMED_OUT",
    "TOOLS",
    "Finished",
    "died",
    "last_json",
    "run_child",
    "signal_name",
    "with_tools",
]

TOOLS = Path(__file__).resolve().parents[1]
"""The folder that holds the ``check_gpu`` package (a checkout's ``tools/``): children that
import the harness's own modules (the pytest plugin, the probes) get it on their path."""

TIMED_OUT = 124
"""The exit status `run_child` reports for a child it killed at its time limit."""

_TAIL = 4000


class Finished(NamedTuple):
    """How a child ended: its exit status (negative: the signal that killed it;
    `TIMED_OUT`), the tail of its output (stdout, then stderr) and the seconds it ran."""

    status: int
    output: str
    seconds: float


def with_tools(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with `TOOLS` first on ``PYTHONPATH``."""
    out = dict(env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(TOOLS), out.get("PYTHONPATH", "")) if p)
    return out


def run_child(
    cmd: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    timeout: float,
    poll: Callable[[], None] | None = None,
) -> Finished:
    """Run ``cmd`` in ``cwd`` for at most ``timeout`` seconds (at least 1). ``poll`` is
    called about once a second while it runs (to report progress) and once at its end."""
    started = time.perf_counter()
    timeout = max(timeout, 1.0)
    deadline = time.monotonic() + timeout
    proc = subprocess.Popen(
        list(cmd),
        env=dict(env),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    )
    while True:
        left = deadline - time.monotonic()
        try:
            out, err = proc.communicate(timeout=max(min(left, 1.0), 0.01))
            break
        except subprocess.TimeoutExpired:  # retrying communicate() loses no output
            if poll is not None:
                poll()
            if left <= 1.0:
                proc.kill()
                out, _ = proc.communicate()
                tail = (out or "")[-_TAIL:] + f"\n(timed out after {timeout:g} s)"
                return Finished(TIMED_OUT, tail, timeout)
    if poll is not None:
        poll()
    return Finished(proc.returncode, (out + err)[-_TAIL:], time.perf_counter() - started)


def signal_name(status: int) -> str:
    """``SIGSEGV`` for the exit status -11 (a child killed by a signal)."""
    try:
        return signal.Signals(-status).name
    except ValueError:
        return f"signal {-status}"


def died(status: int) -> bool:
    """Whether a child with this exit status was killed (a signal, or its time limit)."""
    return status < 0 or status == TIMED_OUT


def last_json(text: str) -> Any:
    """The last line of ``text`` that holds a JSON object (a probe's answer), or None."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None
