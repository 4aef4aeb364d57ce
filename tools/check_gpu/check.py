"""The whole check, step by step, into one JSON summary (`run_check`).

It runs, each in a child process (this process never loads the driver):

1. the driver probe (`check_gpu.probe_driver`): driver and cuda-bindings versions, the
   driver library's path, every GPU's name, UUID, compute capability and memory;
2. the CUDA tests of the checkout (`TESTS`) through the crash-isolating runner
   (`check_gpu.runner`);
3. ``benchmarks/cuda_copy.py`` (bandwidth, wake latency, the copy future's wake, loop lag,
   1000 awaiters), ``benchmarks/cuda_pageable.py`` (staged pageable copies against CuPy and
   PyTorch) and ``benchmarks/arena.py`` (the arena's pair rate against CuPy's pool); a
   benchmark that dies keeps the figures it wrote before (`check_gpu.benchmarks`);
4. a DLPack exchange with CuPy and PyTorch where they are installed
   (`check_gpu.probe_dlpack`).

The summary is written after each step, so a killed run keeps what was done. It judges
each figure (`check_gpu.judge`), says why for each figure and each test, and is ``ok``
only when every test passed or skipped and every judged figure was measured and met.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .benchmarks import run_benchmark
from .judge import judge
from .process import last_json, run_child, with_tools
from .runner import TEST_TIMEOUT, Isolate, run_tests

__all__ = ["BENCHMARKS", "BUDGET", "SUMMARY_VERSION", "TESTS", "run_check", "write_summary"]

TESTS = (
    "tests/backends/cuda/test_cuda.py",
    "tests/backends/cuda/test_cuda_api.py",
    "tests/backends/cuda/test_cuda_soak.py",
    "tests/backends/cuda/test_cuda_staging.py",
    "tests/memory/test_foreign_tensors.py",
)
"""The test files the check runs (paths in the checkout)."""

BENCHMARKS: tuple[tuple[str, str, float], ...] = (
    ("cuda_copy", "benchmarks/cuda_copy.py", 0.6),
    ("cuda_pageable", "benchmarks/cuda_pageable.py", 0.6),
    ("arena", "benchmarks/arena.py", 0.8),
)
"""(summary key, script in the checkout, share of the time left it may take)."""

BUDGET = 480.0
"""Seconds for the whole check by default: one 10-minute GPU call with room to spare."""

SUMMARY_VERSION = 2
"""The summary's ``aioep_check_gpu`` field: bumped when its shape changes."""

_PROBE_SECONDS = 120.0
_DLPACK_RESERVE = 20.0  # seconds the benchmarks leave for the DLPack exchange


def _emulator_env(checkout: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` for children that load the checkout's emulated driver (built if need be)."""
    path = checkout / "tests" / "cuda_emulator" / "__init__.py"
    spec = importlib.util.spec_from_file_location("aioep_check_cuda_emulator", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load the CUDA emulator helper {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    library = module.build()
    child: dict[str, str] = module.child_env(library, env)
    return child


def write_summary(out: Path, summary: Mapping[str, Any]) -> None:
    """Write ``summary`` as indented JSON to ``out`` (its folder made if need be)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2, default=str) + "\n")


def _probe(module: str, env: Mapping[str, str], checkout: Path, timeout: float) -> dict[str, Any]:
    """Run ``python -m check_gpu.MODULE`` in a child: the JSON object it printed last, or
    why there is none (``error``, with its exit status and output)."""
    status, text, _ = run_child(
        [sys.executable, "-m", f"check_gpu.{module}"], with_tools(env), checkout, timeout
    )
    found = last_json(text)
    if isinstance(found, dict):
        return found
    tail = text.strip()
    last = tail.splitlines()[-1] if tail else "no output"
    return {
        "error": f"the probe exited with status {status}: {last[:500]}",
        "exit_status": status,
        "output_tail": tail[-2000:],
    }


def run_check(
    *,
    checkout: Path,
    out: Path,
    emulator: bool = False,
    quick: bool = False,
    tests: bool = True,
    benchmarks: bool = True,
    pytest_args: Sequence[str] = (),
    budget: float = BUDGET,
    test_timeout: float = TEST_TIMEOUT,
    isolate: Isolate = "crashed",
    max_deaths_per_function: int = 3,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every step (see the module docstring), write the summary to ``out`` (after each
    step), return it. ``status``: ``ok``, ``failed``, or ``no-gpu`` (nothing ran after
    the probe)."""
    started = time.perf_counter()
    deadline = time.monotonic() + budget
    env = dict(os.environ)
    summary: dict[str, Any] = {
        "aioep_check_gpu": SUMMARY_VERSION,
        "checkout": str(checkout),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "emulated": emulator,
        "sizes": "quick" if quick else "full",
        "budget_s": budget,
    }
    if emulator:
        try:
            env = _emulator_env(checkout, env)
        except RuntimeError as exc:  # no C compiler, say
            return _no_gpu(summary, f"the emulated driver is unavailable: {exc}", out, started, log)
        summary["note"] = (
            "ran on the emulated CUDA driver (tests/cuda_emulator, a test double, not a GPU): "
            "the tests and the plumbing are checked, the figures are measured but not judged"
        )
    else:
        env["AIOEP_CUDA_EMULATOR"] = "0"  # the tests must not fall back to the emulator
    env["PYTHONFAULTHANDLER"] = "1"  # a probe or benchmark that crashes says where
    py = sys.executable

    log("probing the driver ...")
    driver = _probe("probe_driver", env, checkout, _PROBE_SECONDS)
    summary["driver"] = driver
    devices = driver.get("devices") or []
    if not devices or not driver.get("backend_devices"):  # the backend did not start
        why = driver.get("error") or driver.get("load_error") or "no CUDA device"
        return _no_gpu(summary, why, out, started, log)
    names = ", ".join(d.get("name", "?") for d in devices)
    log(f"driver {driver.get('driver_version')} ({driver.get('library')}): {names}")
    write_summary(out, summary)

    if tests:
        log("running the CUDA tests ...")
        # At most half of what is left when the figures follow: they need the rest.
        share = (deadline - time.monotonic()) * (0.5 if benchmarks else 0.95)
        summary["tests"] = run_tests(
            checkout=checkout,
            env=env,
            files=TESTS,
            py=py,
            pytest_args=pytest_args,
            budget=share,
            test_timeout=test_timeout,
            isolate=isolate,
            max_deaths_per_function=max_deaths_per_function,
            log=log,
        )
        write_summary(out, summary)
    if benchmarks:
        with tempfile.TemporaryDirectory(prefix="aioep-check-gpu-") as tmp:
            for key, script, share in BENCHMARKS:
                log(f"running {script} ...")
                left = deadline - time.monotonic() - _DLPACK_RESERVE
                summary[key] = run_benchmark(
                    script,
                    py=py,
                    env=env,
                    checkout=checkout,
                    scratch=Path(tmp),
                    quick=quick,
                    timeout=left * share,
                    resumable=key == "cuda_copy",
                    log=log,
                )
                for name, error in (summary[key].get("errors") or {}).items():
                    log(f"  {name}: failed: {str(error).splitlines()[0][:200]}")
                write_summary(out, summary)
    if emulator:
        summary["dlpack"] = {
            "status": "skipped: CuPy and PyTorch need the real driver (their CUDA runtime "
            "does not run on the emulator)"
        }
    else:
        log("exchanging a tensor with CuPy and PyTorch over DLPack ...")
        left = max(deadline - time.monotonic(), 10)
        summary["dlpack"] = _probe("probe_dlpack", env, checkout, min(left, _PROBE_SECONDS))
    _conclude(summary, judged=benchmarks and not emulator and not quick, started=started)
    write_summary(out, summary)
    _log_conclusion(summary, out, log)
    return summary


def _no_gpu(
    summary: dict[str, Any], why: str, out: Path, started: float, log: Callable[[str], None]
) -> dict[str, Any]:
    """End the check before its steps: nothing to run them on."""
    summary["ok"] = False
    summary["status"] = "no-gpu"
    summary["why"] = [why]
    summary["duration_s"] = round(time.perf_counter() - started, 2)
    write_summary(out, summary)
    log(f"no GPU: {why}")
    return summary


def _conclude(summary: dict[str, Any], *, judged: bool, started: float) -> None:
    """The figures' verdicts, ``ok``, ``why`` and ``status``."""
    why: list[str] = []
    if "tests" in summary and not summary["tests"]["ok"]:
        why.append("tests: " + summary["tests"]["why"])
    for name, part in summary.get("dlpack", {}).items():
        if isinstance(part, Mapping) and part.get("status") in ("failed", "mismatch"):
            why.append(f"DLPack with {name}: {part.get('status')} {part.get('error', '')}".strip())
    if any(key in summary for key, _, _ in BENCHMARKS):
        summary["figures"] = judge(summary, judged=judged)
        for key, fig in summary["figures"].items():
            if not fig["ok"]:
                why.append(f"figure {key}: {fig['why']}")
    summary["ok"] = not why
    summary["why"] = why or ["every step ran; every test passed or skipped; every figure is ok"]
    summary["status"] = "ok" if summary["ok"] else "failed"
    summary["duration_s"] = round(time.perf_counter() - started, 2)


def _log_conclusion(summary: Mapping[str, Any], out: Path, log: Callable[[str], None]) -> None:
    for key, fig in summary.get("figures", {}).items():
        if fig["target"] is None:  # reported, never judged
            log(f"  {key}: {fig['value']} (reported): {fig['why']}")
            continue
        verdict = {True: "met", False: "NOT MET", None: "not judged"}[fig["met"]]
        log(f"  {key}: {fig['value']} (target {fig['target']}): {verdict}: {fig['why']}")
    for line in summary["why"] if not summary["ok"] else ():
        log(f"  not ok: {line[:500]}")
    log(f"{summary['status']}: summary written to {out} ({summary['duration_s']} s)")
