"""Running a benchmark of the checkout so that its death keeps the figures it wrote."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .process import TIMED_OUT, died, run_child, signal_name

__all__ = ["MAX_ATTEMPTS", "run_benchmark"]

MAX_ATTEMPTS = 8
"""Starts of one resumable benchmark at most (each death in a step costs one)."""


def _read(out: Path) -> dict[str, Any]:
    if not out.is_file():
        return {}
    try:
        data = json.loads(out.read_text())
    except ValueError as exc:
        return {"error": f"its JSON is unreadable: {exc}"}
    return data if isinstance(data, dict) else {"error": "its JSON is not an object"}


def run_benchmark(
    script: str,
    *,
    py: str,
    env: Mapping[str, str],
    checkout: Path,
    scratch: Path,
    quick: bool,
    timeout: float,
    resumable: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run a benchmark (``script``, a path in ``checkout``) that writes its JSON as it goes:
    what it wrote is kept even when it dies, with its exit status and output beside it. A
    ``resumable`` one that died in the middle of a step is started again with ``--resume``
    (it skips what it did, and records the step it died in as failed) while the time
    allows. ``log`` hears each step it starts (from the ``running`` key of its JSON, where
    it writes one)."""
    if timeout <= 1:
        return {"error": "not run: the time budget was spent"}
    deadline = time.monotonic() + timeout
    out = scratch / (Path(script).stem + ".json")
    cmd = [py, script, "--json", str(out), *(["--quick"] if quick else [])]
    data: dict[str, Any] = {}
    deaths: list[str] = []
    deaths_by_step: dict[str, str] = {}
    seconds = 0.0
    status, text = 0, ""
    step_seen: list[object] = [None]

    def poll() -> None:
        try:
            step = json.loads(out.read_text()).get("running")
        except (OSError, ValueError, AttributeError):
            return  # not written yet, or half written
        if step and step != step_seen[0] and log is not None:
            log(f"  {Path(script).name}: {step} ...")
        step_seen[0] = step

    for attempt in range(MAX_ATTEMPTS):
        left = deadline - time.monotonic()
        if left <= 1:
            break
        resume = ["--resume"] if attempt else []
        status, text, took = run_child([*cmd, *resume], env, checkout, left, poll if log else None)
        seconds += took
        data = _read(out)
        if died(status):
            how = signal_name(status) if status < 0 else f"outliving {left:.0f} s"
            step = data.get("running") or "start-up"
            deaths.append(f"{step}: the process died of {how}")
            deaths_by_step[step] = f"the benchmark process died of {how} during this step"
        if not (resumable and died(status) and data.get("running")):
            break
    if status != 0:
        data["exit_status"] = status
        data["output_tail"] = text[-2000:]
        if status < 0:
            data.setdefault("error", f"the benchmark died of {signal_name(status)}")
        elif status == TIMED_OUT:
            data.setdefault("error", f"the benchmark outlived its {timeout:.0f} s")
        else:
            data.setdefault("error", f"the benchmark exited with status {status}")
    if deaths:
        data["deaths"] = deaths
        errors = data.setdefault("errors", {})
        for step, why in deaths_by_step.items():
            if step in errors or step == data.get("running"):
                errors[step] = why
    data["seconds"] = round(seconds, 2)
    return data
