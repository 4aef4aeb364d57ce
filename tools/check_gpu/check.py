"""``python -m aioep check-gpu``: verify the CUDA backend on a GPU in one call, into one JSON file.

It runs, each in a child process (this process never loads the driver):

1. a driver probe: driver and cuda-bindings versions, the driver library's path, every
   GPU's name, UUID, compute capability and memory;
2. the CUDA tests of an aioep checkout (``test_cuda.py``, ``test_cuda_api.py``,
   ``test_cuda_soak.py`` and ``test_cuda_staging.py`` in ``tests/backends/cuda/``, and
   ``tests/interop/test_foreign_tensors.py``) so that a crash cannot hide the other tests:
   the files run in one pytest child that records each test's outcome as it ends; a test that kills the
   child (a signal) or outlives ``--test-timeout`` (the child dumps every thread's stack
   and exits) is reported as ``crash`` or ``hang`` with those stacks, and a new child runs
   the tests after it. Each test function that crashed or hung is then run again alone in
   a child of its own (``--isolate all``: every function), to tell a test's own crash from
   one that an earlier test's garbage caused;
3. ``benchmarks/cuda_copy.py`` (bandwidth, wake latency, the copy future's wake, loop lag,
   1000 awaiters) and ``benchmarks/arena.py`` (the arena's pair rate against CuPy's pool);
   a benchmark that dies keeps the figures it wrote before;
4. a DLPack exchange with CuPy and PyTorch where they are installed (zero-copy, values).

Everything runs within ``--budget`` seconds (default 480: one 10-minute GPU call with
room to spare); what the budget did not reach is reported as not run, and why (a test file
that cannot be imported stops pytest before any test). The console shows each test file
and benchmark step as it starts, and a line every 30 s while one runs long. The summary judges
each figure against its target, says why for each figure and each test, and is ``ok``
only when every test passed or skipped and every figure was measured and met.
``--emulator`` runs the same steps on the emulated driver of the checkout's
``tests/cuda_emulator`` (a test double: the figures are measured but not judged) so the
command itself can be checked without a GPU.

Exit status: 0 when ok, 1 otherwise, 2 when there is no GPU (and no ``--emulator``) or no
checkout to take the tests from.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["FIGURES", "add_parser", "find_checkout", "judge", "main", "run_check", "run_tests"]

_TESTS = (
    "tests/backends/cuda/test_cuda.py",
    "tests/backends/cuda/test_cuda_api.py",
    "tests/backends/cuda/test_cuda_soak.py",
    "tests/backends/cuda/test_cuda_staging.py",
    "tests/interop/test_foreign_tensors.py",
)
_BENCH = "benchmarks/cuda_copy.py"
_PAGEABLE = "benchmarks/cuda_pageable.py"
_ARENA = "benchmarks/arena.py"
_GOOD = ("pass", "skip")
_BUDGET = 480.0
_TEST_TIMEOUT = 45.0
_ISOLATE_CASES = 2  # cases per crashed function run again alone


def _get(data: Mapping[str, Any], *path: str) -> Any:
    value: Any = data
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def _best_wake(r: Mapping[str, Any]) -> float | None:
    lat = _get(r, "cuda_copy", "latency_us") or {}
    default = lat.get("aioep_default")
    others = [lat.get(k) for k in ("aioep_hostfn", "aioep_poll")]
    known = [float(v) for v in others if isinstance(v, (int, float)) and v > 0]
    if not isinstance(default, (int, float)) or len(known) < len(others):
        return None
    return float(default) / min(known)


def _staging_within_bound(r: Mapping[str, Any]) -> float | None:
    stats = _get(r, "cuda_pageable", "aioep_staged", "staging") or {}
    peak, bound = stats.get("peak_bytes"), stats.get("bound_bytes")
    if not isinstance(peak, int) or not isinstance(bound, int):
        return None
    return 1.0 if peak <= bound else 0.0


FIGURES: list[tuple[str, str, Callable[[Mapping[str, Any]], Any], str, float, bool]] = [
    (
        "pinned_h2d_vs_cupy",
        "pinned 1 GiB host-to-device bandwidth / CuPy's",
        lambda r: _get(r, "cuda_copy", "bandwidth", "h2d_ratio"),
        ">=",
        0.95,
        True,
    ),
    (
        "pinned_d2h_vs_cupy",
        "pinned 1 GiB device-to-host bandwidth / CuPy's",
        lambda r: _get(r, "cuda_copy", "bandwidth", "d2h_ratio"),
        ">=",
        0.95,
        True,
    ),
    (
        "wake_vs_to_thread",
        "`await stream` after a 4 KiB copy (default wake) / to_thread(cuEventSynchronize)",
        lambda r: _get(r, "cuda_copy", "latency_us", "ratio_vs_to_thread"),
        "<=",
        0.5,
        True,
    ),
    (
        "future_vs_await_stream",
        "awaiting the future of a 4 KiB pinned copy / `await stream` after the same copy",
        lambda r: _get(r, "cuda_copy", "latency_us", "future_vs_await_stream"),
        "<=",
        1.2,
        True,
    ),
    (
        "future_vs_to_thread",
        "awaiting the future of a 4 KiB pinned copy / to_thread(cuEventSynchronize)",
        lambda r: _get(r, "cuda_copy", "latency_us", "future_vs_to_thread"),
        "<=",
        0.5,
        True,
    ),
    (
        "default_wake_vs_best",
        "default wake latency / the faster of wake='hostfn' and wake='poll' (10% for noise)",
        _best_wake,
        "<=",
        1.1,
        True,
    ),
    (
        "loop_lag_ms",
        "event-loop lag with 8 GiB of copies in flight (ms)",
        lambda r: _get(r, "cuda_copy", "loop_lag", "max_lag_ms"),
        "<=",
        2.0,
        True,
    ),
    (
        "awaiters_threads_constant",
        "1000 awaiters on 8 streams: thread count constant",
        lambda r: _get(r, "cuda_copy", "awaiters", "constant"),
        "==",
        1.0,
        True,
    ),
    (
        "pageable_h2d_vs_cupy",
        "pageable (numpy) 1 GiB host-to-device, staged / CuPy's ndarray.set",
        lambda r: _get(r, "cuda_pageable", "ratios", "h2d_vs_cupy"),
        ">=",
        2.5,
        False,
    ),
    (
        "pageable_h2d_vs_torch",
        "pageable (numpy) 1 GiB host-to-device, staged / PyTorch's .cuda()",
        lambda r: _get(r, "cuda_pageable", "ratios", "h2d_vs_torch"),
        ">=",
        2.5,
        False,
    ),
    (
        "pageable_d2h_vs_cupy",
        "pageable (numpy) 1 GiB device-to-host, staged / CuPy's get",
        lambda r: _get(r, "cuda_pageable", "ratios", "d2h_vs_cupy"),
        ">=",
        1.4,
        False,
    ),
    (
        "pageable_loop_lag_ms",
        "event-loop lag during the staged pageable copies (ms)",
        lambda r: _get(r, "cuda_pageable", "aioep_staged", "max_lag_ms"),
        "<=",
        2.0,
        True,
    ),
    (
        "pageable_staging_within_bound",
        "peak pinned staging memory within its configured bound (1: yes)",
        lambda r: _staging_within_bound(r),
        "==",
        1.0,
        True,
    ),
    (
        "arena_vs_cupy_pool",
        "arena alloc+free pair rate on the GPU / CuPy's memory pool",
        lambda r: _get(r, "arena", "gpu", "ratio"),
        ">=",
        0.8,
        False,
    ),
]
"""(key, what, how to read it from the results, comparison, target, whether the emulator
measures it too: not the arena's, whose baseline is CuPy's pool on the real driver)."""

_LATENCY = ("latency", "to_thread")
_SECTION: dict[str, tuple[str, ...]] = {
    "pinned_h2d_vs_cupy": ("bandwidth",),
    "pinned_d2h_vs_cupy": ("bandwidth",),
    "wake_vs_to_thread": _LATENCY,
    "future_vs_await_stream": _LATENCY,
    "future_vs_to_thread": _LATENCY,
    "default_wake_vs_best": ("latency", "latency_hostfn", "latency_poll"),
    "loop_lag_ms": ("loop_lag",),
    "awaiters_threads_constant": ("awaiters",),
}
"""The benchmark's steps each figure needs (their names in its ``errors``)."""


def _exit_text(part: Mapping[str, Any]) -> str:
    if not part:
        return "its step did not run"
    if part.get("error"):
        return str(part["error"])
    rc = part.get("exit_status")
    tail = str(part.get("output_tail") or "").strip().splitlines()
    last = tail[-1] if tail else ""
    return f"the benchmark exited with status {rc}" + (f": {last}" if last else "")


def _why_missing(results: Mapping[str, Any], key: str) -> str:
    """Why a figure has no value: the benchmark's own error for its section, or its end."""
    if key == "arena_vs_cupy_pool":
        arena = results.get("arena") or {}
        skipped = _get(arena, "gpu", "skipped")
        return f"not measured: {skipped or _exit_text(arena)}"
    if key.startswith("pageable_"):
        pageable = results.get("cuda_pageable") or {}
        for name in ("cupy", "torch"):
            skipped = _get(pageable, name, "skipped")
            if skipped and name in key:
                return f"not measured: the {name} baseline was skipped: {skipped}"
        return "not measured: " + _exit_text(pageable)
    bench = results.get("cuda_copy") or {}
    errors = bench.get("errors") or {}
    failed = [f"the {name} step failed: {errors[name]}" for name in _SECTION[key] if name in errors]
    if failed:
        return "not measured: " + "; ".join(failed)
    if bench.get("running"):
        return f"not measured: the benchmark ended during its {bench['running']} step ({_exit_text(bench)})"
    return "not measured: " + _exit_text(bench)


def judge(results: Mapping[str, Any], *, judged: bool) -> dict[str, dict[str, Any]]:
    """Each figure's value, target, whether it is met and why.

    ``met``: True or False when judged, None when not (the emulator, quick sizes). ``ok``:
    False when a figure that should have been measured was not (on the emulator only the
    figures it can measure count), or when a judged figure missed its target.
    """
    out: dict[str, dict[str, Any]] = {}
    emulated = bool(results.get("emulated"))
    for key, what, read, op, target, on_emulator in FIGURES:
        value = read(results)
        entry: dict[str, Any] = {"what": what, "value": value, "target": f"{op} {target:g}"}
        expected = on_emulator or not emulated
        if value is None:
            entry["met"] = False if judged else None
            entry["ok"] = not expected
            entry["why"] = _why_missing(results, key)
            if not expected:
                entry["why"] += " (the emulator cannot measure it: not counted)"
        else:
            v = float(value)
            met = v >= target if op == ">=" else v <= target if op == "<=" else v == target
            entry["met"] = met if judged else None
            entry["ok"] = met if judged else True
            if judged:
                entry["why"] = "met" if met else f"{v:.4g} misses the target {op} {target:g}"
            else:
                entry["why"] = (
                    "measured, not judged ("
                    + ("the emulated driver" if emulated else "quick sizes")
                    + ")"
                )
        baseline = _get(results, "cuda_copy", "bandwidth", "baseline")
        if key.endswith("_vs_cupy") and baseline not in (None, "cupy"):
            entry["note"] = "CuPy is not installed: the baseline is raw cuda.bindings copies"
        out[key] = entry
    return out


def find_checkout(start: Sequence[Path] = ()) -> Path | None:
    """The aioep checkout whose CUDA tests and benchmark to run: the first of ``start``, the
    working directory and its parents, and the folders the installed packages live in that
    holds ``tests/backends/cuda/test_cuda.py`` and ``benchmarks/cuda_copy.py``."""
    here = Path(__file__).resolve()
    candidates = [*start, Path.cwd(), *Path.cwd().parents, *here.parents]
    try:
        import aioep

        candidates += list(Path(aioep.__file__).resolve().parents)
    except ImportError:  # pragma: no cover - aioep_cuda depends on aioep
        pass
    for folder in candidates:
        if (folder / _TESTS[0]).is_file() and (folder / _BENCH).is_file():
            return folder
    return None


def _emulator_module(checkout: Path) -> Any:
    path = checkout / "tests" / "cuda_emulator" / "__init__.py"
    spec = importlib.util.spec_from_file_location("aioep_check_cuda_emulator", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load the CUDA emulator helper {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _run(
    cmd: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    timeout: float,
    poll: Callable[[], None] | None = None,
) -> tuple[int, str, float]:
    """Run a child; (exit status, the tail of its output, seconds). 124 on a timeout.
    ``poll`` is called about once a second while it runs (to report progress)."""
    t0 = time.perf_counter()
    timeout = max(timeout, 1.0)
    if poll is not None:
        return _run_polled(cmd, env, cwd, timeout, poll)
    try:
        done = subprocess.run(
            list(cmd),
            env=dict(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else ""
        return 124, (out or "")[-4000:] + f"\n(timed out after {timeout:g} s)", timeout
    return done.returncode, (done.stdout + done.stderr)[-4000:], time.perf_counter() - t0


def _run_polled(
    cmd: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    timeout: float,
    poll: Callable[[], None],
) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    proc = subprocess.Popen(
        list(cmd),
        env=dict(env),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while True:
        left = deadline - time.monotonic()
        try:
            out, err = proc.communicate(timeout=max(min(left, 1.0), 0.01))
            break
        except subprocess.TimeoutExpired:  # retrying communicate() loses no output
            poll()
            if left <= 1.0:
                proc.kill()
                out, err = proc.communicate()
                tail = (out or "")[-4000:] + f"\n(timed out after {timeout:g} s)"
                return 124, tail, timeout
    poll()
    return proc.returncode, (out + err)[-4000:], time.perf_counter() - t0


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


# -- the tests: no crash or hang hides another test ------------------------------------------
_PLUGIN = r"""
# check-gpu's pytest plugin: one JSON line per test as it starts and as it ends (written
# before the next test runs, so a crash loses nothing); every thread's stack on a fatal
# signal; a watchdog per test that dumps every thread's stack and ends the process on a hang.
import faulthandler
import json
import os
import time

_LOG = open(os.environ["AIOEP_CHECK_LOG"], "a", buffering=1)
_STACKS = os.open(os.environ["AIOEP_CHECK_STACKS"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
_TIMEOUT = float(os.environ["AIOEP_CHECK_TEST_TIMEOUT"])
faulthandler.enable(file=_STACKS, all_threads=True)
_reports = {}
_started = {}


def _emit(**record):
    _LOG.write(json.dumps(record) + "\n")
    _LOG.flush()


def _text(report):
    try:
        text = report.longreprtext
    except Exception:
        text = str(report.longrepr)
    return text[-3000:]


def pytest_collection_finish(session):
    _emit(event="collected", nodeids=[item.nodeid for item in session.items])


def pytest_collectreport(report):
    # A test file that cannot be imported (a missing test dependency, say) stops the run
    # before any test: say which and why, its exception's last line.
    if report.failed:
        lines = [l for l in _text(report).splitlines() if l.strip()]
        errors = [l[1:].strip() for l in lines if l.startswith("E ")]
        _emit(event="collect_error", nodeid=report.nodeid,
              message=(errors or lines or ["?"])[-1][:500])


def pytest_runtest_logstart(nodeid, location):
    os.ftruncate(_STACKS, 0)
    os.lseek(_STACKS, 0, os.SEEK_SET)
    _started[nodeid] = time.perf_counter()
    _emit(event="start", nodeid=nodeid)
    faulthandler.dump_traceback_later(_TIMEOUT, exit=True, file=_STACKS)


def pytest_runtest_logreport(report):
    _reports.setdefault(report.nodeid, []).append(report)


def pytest_runtest_logfinish(nodeid, location):
    faulthandler.cancel_dump_traceback_later()
    outcome, message = "pass", ""
    for report in _reports.pop(nodeid, []):
        if report.failed:
            outcome = "fail" if report.when == "call" else "error"
            message = report.when + ": " + _text(report)
            break
        if report.skipped and outcome == "pass":
            outcome = "skip"
            longrepr = report.longrepr
            message = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)[-500:]
    seconds = round(time.perf_counter() - _started.pop(nodeid, time.perf_counter()), 3)
    _emit(event="done", nodeid=nodeid, outcome=outcome, message=message, seconds=seconds)
"""


def _function_of(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


class _Child:
    """What one pytest child reported: the tests it collected, each finished test's outcome,
    the test it was running when it ended (if any), its exit status, output and stacks."""

    def __init__(self) -> None:
        self.collected: list[str] = []
        self.collect_errors: dict[str, str] = {}
        self.done: dict[str, dict[str, Any]] = {}
        self.running: str | None = None
        self.rc = 0
        self.seconds = 0.0
        self.stacks = ""
        self.output = ""
        self.test_timeout = 0.0


def _pytest_child(
    args: Sequence[str],
    *,
    py: str,
    env: Mapping[str, str],
    cwd: Path,
    scratch: Path,
    test_timeout: float,
    timeout: float,
    pytest_args: Sequence[str],
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> _Child:
    """Run pytest on ``args`` in a child with check-gpu's plugin; ``on_record`` sees each
    record of its log (collected, start, done ...) while it runs, and a ``poll`` record
    about once a second."""
    n = len(list(scratch.glob("log-*.jsonl")))
    log = scratch / f"log-{n}.jsonl"
    stacks = scratch / f"stacks-{n}.txt"
    plugin = scratch / "aioep_check_plugin.py"
    if not plugin.is_file():
        plugin.write_text(_PLUGIN)
    child_env = dict(env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(scratch), child_env.get("PYTHONPATH", "")) if p
    )
    child_env["AIOEP_CHECK_LOG"] = str(log)
    child_env["AIOEP_CHECK_STACKS"] = str(stacks)
    child_env["AIOEP_CHECK_TEST_TIMEOUT"] = f"{test_timeout:g}"
    child_env.pop("PYTHONFAULTHANDLER", None)  # the plugin's own handler writes the stacks
    cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:faulthandler"]
    cmd += ["-p", "aioep_check_plugin", *pytest_args, *args]
    result = _Child()
    result.test_timeout = test_timeout
    poll = None
    if on_record is not None:
        seen = 0  # the log's complete lines already handed to on_record

        def poll() -> None:
            nonlocal seen
            if not log.is_file():
                return
            lines = log.read_text().split("\n")[:-1]  # the last line may be half written
            for line in lines[seen:]:
                try:
                    on_record(json.loads(line))
                except ValueError:
                    pass
            seen = len(lines)
            on_record({"event": "poll"})  # a second went by

    result.rc, result.output, result.seconds = _run(cmd, child_env, cwd, timeout, poll)
    if log.is_file():
        for line in log.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by the crash
            if record["event"] == "collect_error":
                result.collect_errors[record["nodeid"]] = record["message"]
            elif record["event"] == "collected":
                result.collected = list(record["nodeids"])
            elif record["event"] == "start":
                result.running = record["nodeid"]
            elif record["event"] == "done":
                result.done[record["nodeid"]] = {
                    k: record[k] for k in ("outcome", "message", "seconds")
                }
                result.running = None
    if stacks.is_file():
        result.stacks = stacks.read_text(errors="replace")[-20000:]
    return result


def _death(child: _Child) -> dict[str, Any]:
    """The outcome of a test its child died in: crash (a signal, or an exit in the middle of
    it) or hang (the watchdog's dump, or the parent's timeout), with the stacks."""
    entry: dict[str, Any] = {"seconds": None}
    if child.rc < 0:
        entry["outcome"] = "crash"
        entry["signal"] = _signal_name(child.rc)
        entry["message"] = f"the test process died of {entry['signal']}"
    elif child.rc == 124 or "Timeout (" in child.stacks or "Timeout (" in child.output:
        entry["outcome"] = "hang"
        entry["message"] = (
            "the test process outlived its time budget and was killed"
            if child.rc == 124
            else f"still running after {child.test_timeout:g} s: every thread's stack is in 'stacks'"
        )
    else:
        entry["outcome"] = "crash"
        entry["message"] = f"the test process exited with status {child.rc} during this test"
    entry["stacks"] = child.stacks
    entry["output_tail"] = child.output[-2000:]
    return entry


def _run_group(
    args: Sequence[str],
    *,
    deadline: float,
    max_children: int,
    run: Callable[[Sequence[str], float], _Child],
    max_deaths_per_function: int = 0,
) -> tuple[list[str], dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Run ``args`` in a child; after each crash or hang, what it did not reach in a new one.
    Returns (every test in order, each test's outcome, a note per child).

    ``max_deaths_per_function`` (0: no limit): once that many cases of one test function
    crashed or hung, its other cases are reported as not run rather than each costing a
    process of its own (a GPU's time is scarce).
    """
    order: list[str] = []
    results: dict[str, dict[str, Any]] = {}
    children: list[dict[str, Any]] = []
    deaths: dict[str, int] = {}
    pending: Sequence[str] = args
    while True:
        left = deadline - time.monotonic()
        if left <= 1 or len(children) >= max_children:
            why = "time budget spent" if left <= 1 else f"{max_children} test processes started"
            for nodeid in order:
                results.setdefault(nodeid, {"outcome": "not-run", "message": why})
            if not children:
                children.append({"error": f"not run: {why}"})
            break
        child = run(pending, left)
        note: dict[str, Any] = {
            "tests": len(child.collected),
            "exit_status": child.rc,
            "seconds": round(child.seconds, 2),
        }
        children.append(note)
        if not order:
            order = list(child.collected)
            if not order:
                note["error"] = "collected no test: " + child.output[-2000:]
                break
        results.update(child.done)
        if child.running is not None and child.running not in results:
            results[child.running] = _death(child)
            note["ended_in"] = child.running
            function = _function_of(child.running)
            deaths[function] = deaths.get(function, 0) + 1
            if max_deaths_per_function and deaths[function] >= max_deaths_per_function:
                why = (
                    f"{deaths[function]} cases of this function crashed or hung already: its "
                    "other cases were not run, to spare the time budget"
                )
                for nodeid in order:
                    if _function_of(nodeid) == function and nodeid not in results:
                        results[nodeid] = {"outcome": "not-run", "message": why}
        elif child.rc < 0 or child.rc == 124:
            note["ended_outside_a_test"] = _death(child)
        remaining = [n for n in order if n not in results]
        if not remaining:
            break
        if child.running is None:
            # It stopped between tests (at exit, say): starting it again on the same tests
            # would learn nothing new.
            why = f"the test process ended (status {child.rc}) before reaching it"
            if child.collect_errors:
                why = _collect_errors_text(child)
            for nodeid in remaining:
                results[nodeid] = {"outcome": "not-run", "message": why}
            note["output_tail"] = child.output[-2000:]
            break
        pending = remaining
    return order, results, children


def _collect_errors_text(child: _Child) -> str:
    """Why a child stopped before its first test: the files it could not collect."""
    errors = "; ".join(f"{path}: {msg}" for path, msg in child.collect_errors.items())
    text = f"pytest stopped at {len(child.collect_errors)} collection error(s): {errors}"
    if any("ModuleNotFoundError" in m for m in child.collect_errors.values()):
        text += " (the CUDA tests need aioep's test extra: pip install -e '.[test]')"
    return text


_SEVERITY = ("pass", "skip", "not-run", "fail", "error", "hang", "crash")


def _worst(outcomes: Sequence[str]) -> str:
    if not outcomes:
        return "not-run"
    return max(outcomes, key=lambda o: _SEVERITY.index(o) if o in _SEVERITY else len(_SEVERITY))


def run_tests(
    *,
    checkout: Path,
    env: Mapping[str, str],
    py: str = sys.executable,
    files: Sequence[str] = _TESTS,
    pytest_args: Sequence[str] = (),
    budget: float = 300.0,
    test_timeout: float = _TEST_TIMEOUT,
    isolate: str = "crashed",
    max_deaths_per_function: int = 3,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the CUDA test files so that no crash or hang hides another test (see the module
    docstring): every test's outcome and why, per function, and the counts.

    ``isolate``: what runs again alone, each function in a process of its own:
    ``"crashed"`` (the first cases of each function that crashed or hung), ``"all"`` (every
    case of every function) or ``"none"``. ``max_deaths_per_function``: see
    `_run_group` (0: every case runs, whatever it costs).
    """
    started = time.monotonic()
    deadline = started + budget
    present = [f for f in files if (checkout / f).is_file()]
    missing = [f for f in files if f not in present]
    progress = _Progress(log)
    with tempfile.TemporaryDirectory(prefix="aioep-check-tests-") as tmp:
        scratch = Path(tmp)

        def run(args: Sequence[str], left: float, *, report: bool = False) -> _Child:
            return _pytest_child(
                args,
                py=py,
                env=env,
                cwd=checkout,
                scratch=scratch,
                test_timeout=min(test_timeout, max(left - 5, 5)),
                timeout=left,
                pytest_args=pytest_args,
                on_record=progress.record if report else None,
            )

        order, results, children = _run_group(
            present,
            deadline=deadline,
            max_children=60,
            run=functools.partial(run, report=True),
            max_deaths_per_function=max_deaths_per_function,
        )
        functions: dict[str, list[str]] = {}
        for nodeid in order:
            functions.setdefault(_function_of(nodeid), []).append(nodeid)
        # What runs again alone: every case (isolate="all"), or the first cases of each
        # function that crashed or hung.
        again: dict[str, list[str]] = {}
        for function, ids in functions.items():
            if isolate == "all":
                again[function] = ids
            elif isolate == "crashed":
                died = [n for n in ids if results.get(n, {}).get("outcome") in ("crash", "hang")]
                if died:
                    again[function] = died[:_ISOLATE_CASES]
        isolated: dict[str, str] = {}
        for function, ids in again.items():
            if deadline - time.monotonic() <= 1:
                isolated[function] = "not-run"
                continue
            _, alone, _ = _run_group(ids, deadline=deadline, max_children=len(ids), run=run)
            for nodeid in ids:
                if nodeid in alone and nodeid in results:
                    results[nodeid]["isolated"] = alone[nodeid]
            isolated[function] = _worst([alone.get(n, {}).get("outcome", "not-run") for n in ids])
    tests = [{"nodeid": n, **results.get(n, {"outcome": "not-run"})} for n in order]
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    problems = [t for t in tests if t["outcome"] not in _GOOD]
    # Why tests were not run, most common first: one line each, not one per test.
    not_run: dict[str, int] = {}
    for t in problems:
        if t["outcome"] == "not-run":
            reason = t.get("message") or "not reached"
            not_run[reason] = not_run.get(reason, 0) + 1
    ok = bool(tests) and not problems and not missing and counts.get("pass", 0) > 0
    if ok:
        why = "every test passed or skipped"
    elif not tests:
        why = "no test ran: " + json.dumps(children)[-1500:]
    elif problems:
        listed = [f"{t['nodeid']} ({t['outcome']})" for t in problems if t["outcome"] != "not-run"]
        parts = [", ".join(listed[:20])] if listed else []
        parts += [f"{n} not run: {reason}" for reason, n in not_run.items()]
        why = f"{len(problems)} of {len(tests)} tests did not pass: " + "; ".join(parts)
    elif missing:
        why = f"test files missing from the checkout: {', '.join(missing)}"
    else:
        why = "no test passed"
    summary: dict[str, Any] = {
        "files": present,
        "missing_files": missing,
        "mode": "the files in one process; a new one for the rest after each crash or hang; "
        f"functions run again alone: {isolate}",
        "test_timeout_s": test_timeout,
        "children": children,
        "seconds": round(time.monotonic() - started, 2),
        "passed": counts.get("pass", 0),
        "failed": counts.get("fail", 0),
        "errors": counts.get("error", 0),
        "skipped": counts.get("skip", 0),
        "crashed": counts.get("crash", 0),
        "hung": counts.get("hang", 0),
        "not_run": counts.get("not-run", 0),
        "functions": {
            f: _worst([results.get(n, {}).get("outcome", "not-run") for n in ids])
            for f, ids in functions.items()
        },
        "isolated": isolated,
        "tests": tests,
        "ok": ok,
        "why": why,
    }
    log(
        f"  {summary['passed']} passed, {summary['failed']} failed, {summary['errors']} errors, "
        f"{summary['skipped']} skipped, {summary['crashed']} crashed, {summary['hung']} hung, "
        f"{summary['not_run']} not run ({summary['seconds']} s, {len(children)} processes)"
    )
    for t in [t for t in problems if t["outcome"] != "not-run"][:30]:
        alone = t.get("isolated", {}).get("outcome")
        log(f"    {t['outcome']}: {t['nodeid']}" + (f" (alone: {alone})" if alone else ""))
    for reason, n in sorted(not_run.items(), key=lambda kv: -kv[1]):
        log(f"    {n} not run: {reason[:500]}")
    if not tests and children:
        log(f"    no test ran: {json.dumps(children[-1])[-500:]}")
    return summary


class _Progress:
    """Progress of the test run on the console: a line as each test file starts, and one
    every ``every`` seconds while a file runs long (the soak tests, a slow GPU)."""

    def __init__(self, log: Callable[[str], None], every: float = 30.0) -> None:
        self.log = log
        self.every = every
        self.total = 0
        self.done = 0
        self.file = ""
        self.current = ""
        self.started = time.monotonic()
        self.last = self.started

    def record(self, record: dict[str, Any]) -> None:
        if not self.file and not self.total:
            self.started = self.last = time.monotonic()
        now = time.monotonic()
        event = record.get("event")
        if event == "collected" and not self.total:
            self.total = len(record.get("nodeids") or [])
        elif event == "collect_error":
            self.log(f"  cannot collect {record.get('nodeid')}: {record.get('message')}")
        elif event == "start":
            self.current = str(record.get("nodeid"))
            file = self.current.split("::", 1)[0]
            if file != self.file:
                self.file = file
                self._line(f"{file} ...", now)
        elif event == "done":
            self.done += 1
        if now - self.last >= self.every and self.current:
            self._line(f"still running: {self.current}", now)

    def _line(self, text: str, now: float) -> None:
        self.last = now
        self.log(f"  [{self.done}/{self.total or '?'} tests, {now - self.started:.0f} s] {text}")


_PROBE = r"""
import json, sys
out = {}
try:
    import cuda.bindings
    out["bindings_version"] = getattr(cuda.bindings, "__version__", None)
    from aioep_cuda._driver import check, load_driver
    drv = load_driver()
    out["driver_version"] = int(check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
    out["device_count"] = int(check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
    import aioep
    env = aioep.Environment(backends=["cuda"]).open()
    try:
        out["devices"] = [dict(d.hardware.metadata)
                          for d in env.ep_devices(ep_name="CUDAExecutionProvider")]
        out["load_error"] = env.load_errors.get("cuda")
    finally:
        env.close()
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
with open("/proc/self/maps") as f:
    libs = sorted({line.split()[-1] for line in f if "/libcuda.so" in line})
out["library"] = libs[0] if libs else None
print(json.dumps(out))
"""

_DLPACK = r"""
import asyncio, json
import numpy as np
import aioep

async def main():
    out = {}
    async with aioep.Environment(backends=["cuda"]) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        data = np.arange(1 << 20, dtype=np.float32)
        t = env.empty(data.shape, data.dtype, gpu.memory_info(aioep.MemoryType.DEFAULT))
        await env.copy_tensors([data], [t])
        for name in ("cupy", "torch"):
            try:
                lib = __import__(name)
            except ImportError:
                out[name] = {"status": "not installed"}
                continue
            entry = {"version": getattr(lib, "__version__", None)}
            try:
                if name == "cupy":
                    x = lib.from_dlpack(t)
                    ptr, values = x.data.ptr, x.get()
                    y = lib.asarray(t)  # the CUDA array interface
                    entry["cai_zero_copy"] = y.data.ptr == t.data_ptr
                else:
                    if not lib.cuda.is_available():
                        out[name] = {"status": "installed without CUDA", **entry}
                        continue
                    x = lib.from_dlpack(t)
                    ptr, values = x.data_ptr(), x.cpu().numpy()
                entry["zero_copy"] = ptr == t.data_ptr
                entry["values_equal"] = bool(np.array_equal(values, data))
                ok = entry["zero_copy"] and entry["values_equal"]
                entry["status"] = "ok" if ok else "mismatch"
                del x
            except Exception as exc:
                entry["status"] = "failed"
                entry["error"] = f"{type(exc).__name__}: {exc}"
            out[name] = entry
        del t
    return out

print(json.dumps(asyncio.run(main())))
"""


def _last_json(text: str) -> Any:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def _benchmark(
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
    """Run a benchmark that writes its JSON as it goes: what it wrote is kept even when it
    dies, with its exit status and output beside it. A ``resumable`` one that died in the
    middle of a step is started again with ``--resume`` (it skips what it did, and records
    the step it died in as failed) while the time allows. ``log`` hears each step it
    starts (from the ``running`` key of its JSON, where it writes one)."""
    if timeout <= 1:
        return {"error": "not run: the time budget was spent"}
    deadline = time.monotonic() + timeout
    out = scratch / (Path(script).stem + ".json")
    cmd = [py, script, "--json", str(out), *(["--quick"] if quick else [])]
    data: dict[str, Any] = {}
    deaths: list[str] = []
    deaths_by_step: dict[str, str] = {}
    seconds = 0.0
    rc, text = 0, ""
    step_seen: list[object] = [None]

    def poll() -> None:
        try:
            step = json.loads(out.read_text()).get("running")
        except (OSError, ValueError, AttributeError):
            return  # not written yet, or half written
        if step and step != step_seen[0] and log is not None:
            log(f"  {Path(script).name}: {step} ...")
        step_seen[0] = step

    for attempt in range(8):
        left = deadline - time.monotonic()
        if left <= 1:
            break
        rc, text, took = _run(
            [*cmd, *(["--resume"] if attempt else [])], env, checkout, left, poll if log else None
        )
        seconds += took
        data = {}
        if out.is_file():
            try:
                data = json.loads(out.read_text())
            except ValueError as exc:
                data = {"error": f"its JSON is unreadable: {exc}"}
        if rc < 0 or rc == 124:
            how = _signal_name(rc) if rc < 0 else f"outliving {left:.0f} s"
            step = data.get("running") or "start-up"
            deaths.append(f"{step}: the process died of {how}")
            deaths_by_step[step] = f"the benchmark process died of {how} during this step"
        if not (resumable and (rc < 0 or rc == 124) and data.get("running")):
            break
    if rc != 0:
        data["exit_status"] = rc
        data["output_tail"] = text[-2000:]
        if rc < 0:
            data.setdefault("error", f"the benchmark died of {_signal_name(rc)}")
        elif rc == 124:
            data.setdefault("error", f"the benchmark outlived its {timeout:.0f} s")
        else:
            data.setdefault("error", f"the benchmark exited with status {rc}")
    if deaths:
        data["deaths"] = deaths
        errors = data.setdefault("errors", {})
        for step, why in deaths_by_step.items():
            if step in errors or step == data.get("running"):
                errors[step] = why
    data["seconds"] = round(seconds, 2)
    return data


def run_check(
    *,
    checkout: Path,
    out: Path,
    emulator: bool = False,
    quick: bool = False,
    tests: bool = True,
    benchmarks: bool = True,
    pytest_args: Sequence[str] = (),
    budget: float = _BUDGET,
    test_timeout: float = _TEST_TIMEOUT,
    isolate: str = "crashed",
    max_deaths_per_function: int = 3,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every step (see the module docstring), write the summary to ``out`` (after each
    step, so a killed run keeps what was done), return it."""
    started = time.perf_counter()
    deadline = time.monotonic() + budget
    env = dict(os.environ)
    summary: dict[str, Any] = {
        "aioep_check_gpu": 2,
        "checkout": str(checkout),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "emulated": emulator,
        "sizes": "quick" if quick else "full",
        "budget_s": budget,
    }
    if emulator:
        module = _emulator_module(checkout)
        library = module.build()
        env = module.child_env(library, env)
        summary["note"] = (
            "ran on the emulated CUDA driver (tests/cuda_emulator, a test double, not a GPU): "
            "the tests and the plumbing are checked, the figures are measured but not judged"
        )
    else:
        env["AIOEP_CUDA_EMULATOR"] = "0"  # the tests must not fall back to the emulator
    env["PYTHONFAULTHANDLER"] = "1"  # a probe or benchmark that crashes says where
    py = sys.executable

    log("probing the driver ...")
    rc, text, _ = _run([py, "-c", _PROBE], env, checkout, 120)
    driver = _last_json(text) or {"error": text.strip()[-500:]}
    summary["driver"] = driver
    devices = driver.get("devices") or []
    if not devices:
        summary["ok"] = False
        summary["status"] = "no-gpu"
        summary["why"] = [driver.get("error") or driver.get("load_error") or "no CUDA device"]
        summary["duration_s"] = round(time.perf_counter() - started, 2)
        _write(out, summary)
        log(f"no GPU: {summary['why'][0]}")
        return summary
    names = ", ".join(d.get("name", "?") for d in devices)
    log(f"driver {driver.get('driver_version')} ({driver.get('library')}): {names}")
    _write(out, summary)

    if tests:
        log("running the CUDA tests ...")
        # At most half of what is left when the figures follow: they need the rest.
        share = (deadline - time.monotonic()) * (0.5 if benchmarks else 0.95)
        summary["tests"] = run_tests(
            checkout=checkout,
            env=env,
            py=py,
            pytest_args=pytest_args,
            budget=share,
            test_timeout=test_timeout,
            isolate=isolate,
            max_deaths_per_function=max_deaths_per_function,
            log=log,
        )
        _write(out, summary)
    with tempfile.TemporaryDirectory(prefix="aioep-check-gpu-") as tmp:
        scratch = Path(tmp)
        if benchmarks:
            for key, script, share in (
                ("cuda_copy", _BENCH, 0.6),
                ("cuda_pageable", _PAGEABLE, 0.6),
                ("arena", _ARENA, 0.8),
            ):
                log(f"running {script} ...")
                left = deadline - time.monotonic() - 20  # keep time for the DLPack check
                summary[key] = _benchmark(
                    script,
                    py=py,
                    env=env,
                    checkout=checkout,
                    scratch=scratch,
                    quick=quick,
                    timeout=left * share,
                    resumable=key == "cuda_copy",
                    log=log,
                )
                for name, error in (summary[key].get("errors") or {}).items():
                    log(f"  {name}: failed: {str(error).splitlines()[0][:200]}")
                _write(out, summary)
        if emulator:
            summary["dlpack"] = {
                "status": "skipped: CuPy and PyTorch need the real driver (their CUDA runtime "
                "does not run on the emulator)"
            }
        else:
            log("exchanging a tensor with CuPy and PyTorch over DLPack ...")
            left = max(deadline - time.monotonic(), 10)
            rc, text, _ = _run([py, "-c", _DLPACK], env, checkout, min(left, 120))
            summary["dlpack"] = _last_json(text) or {"exit_status": rc, "output_tail": text[-2000:]}

    why: list[str] = []
    if tests and not summary["tests"]["ok"]:
        why.append("tests: " + summary["tests"]["why"])
    for name, part in summary.get("dlpack", {}).items():
        if isinstance(part, Mapping) and part.get("status") in ("failed", "mismatch"):
            why.append(f"DLPack with {name}: {part.get('status')} {part.get('error', '')}".strip())
    if benchmarks:
        summary["figures"] = judge(summary, judged=not emulator and not quick)
        for key, fig in summary["figures"].items():
            if not fig["ok"]:
                why.append(f"figure {key}: {fig['why']}")
    summary["ok"] = not why
    summary["why"] = why or ["every step ran; every test passed or skipped; every figure is ok"]
    summary["status"] = "ok" if summary["ok"] else "failed"
    summary["duration_s"] = round(time.perf_counter() - started, 2)
    _write(out, summary)
    for key, fig in summary.get("figures", {}).items():
        verdict = {True: "met", False: "NOT MET", None: "not judged"}[fig["met"]]
        log(f"  {key}: {fig['value']} (target {fig['target']}): {verdict}: {fig['why']}")
    for line in why:
        log(f"  not ok: {line[:500]}")
    log(f"{summary['status']}: summary written to {out} ({summary['duration_s']} s)")
    return summary


def _write(out: Path, summary: Mapping[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2, default=str) + "\n")


def _command(args: argparse.Namespace) -> int:
    extra = list(args.pytest_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    checkout = find_checkout([args.repo] if args.repo else [])
    if checkout is None:
        print(
            "check-gpu: no aioep checkout found (it needs tests/backends/cuda/test_cuda.py and "
            "benchmarks/cuda_copy.py): run it from the checkout or pass --repo",
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


def add_parser(sub: Any) -> None:
    """Add ``check-gpu`` to the ``aioep`` command line (entry point group ``aioep.commands``)."""
    p = sub.add_parser(
        "check-gpu",
        help="verify the CUDA backend on a GPU: tests, benchmarks, DLPack; one JSON summary",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("check-gpu.json"),
        help="where to write the JSON summary (default: ./check-gpu.json)",
    )
    p.add_argument("--repo", type=Path, help="the aioep checkout (default: found from here)")
    p.add_argument(
        "--emulator",
        action="store_true",
        help="run on the emulated driver of tests/cuda_emulator (a test double; implies --quick)",
    )
    p.add_argument("--quick", action="store_true", help="small benchmark sizes (not judged)")
    p.add_argument(
        "--budget",
        type=float,
        default=_BUDGET,
        help=f"seconds for the whole check (default {_BUDGET:g}); what it does not reach is "
        "reported as not run",
    )
    p.add_argument(
        "--test-timeout",
        type=float,
        default=_TEST_TIMEOUT,
        help=f"seconds after which a test counts as hung (default {_TEST_TIMEOUT:g}): every "
        "thread's stack is recorded and the other tests go on in a new process",
    )
    p.add_argument(
        "--isolate",
        choices=("crashed", "all", "none"),
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
    p.set_defaults(func=_command)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aioep_cuda._check [options]``: the same as ``python -m aioep check-gpu``."""
    parser = argparse.ArgumentParser(prog="aioep")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["check-gpu", *(sys.argv[1:] if argv is None else argv)])
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
