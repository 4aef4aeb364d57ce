"""The crash-isolating test runner: no crash or hang hides another test.

The test files run in one pytest child with `check_gpu.pytest_plugin`, which records each
test's outcome as it ends. A test that kills the child (a signal) or outlives its timeout
(the plugin's watchdog dumps every thread's stack and ends the child) is reported as
``crash`` or ``hang`` with those stacks, and a new child runs the tests after it. Each test
function that crashed or hung then runs again alone, in a child of its own, to tell a
test's own crash from one that an earlier test's garbage caused.
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .process import TIMED_OUT, died, run_child, signal_name, with_tools
from .progress import Progress
from .pytest_plugin import ENV_LOG, ENV_STACKS, ENV_TIMEOUT

__all__ = ["ISOLATE", "TEST_TIMEOUT", "Isolate", "Outcome", "TestChild", "run_group", "run_tests"]

TEST_TIMEOUT = 45.0
"""Seconds after which a test counts as hung (``--test-timeout``)."""

Outcome = Literal["pass", "skip", "not-run", "fail", "error", "hang", "crash"]
SEVERITY: tuple[Outcome, ...] = ("pass", "skip", "not-run", "fail", "error", "hang", "crash")
"""Outcomes, least severe first: a function's outcome is its worst case's."""
GOOD: tuple[Outcome, ...] = ("pass", "skip")

Isolate = Literal["crashed", "all", "none"]
ISOLATE: tuple[Isolate, ...] = ("crashed", "all", "none")
"""What runs again alone: the first cases of each function that crashed or hung, every
function, or nothing."""

ISOLATE_CASES = 2
"""Cases of one crashed function run again alone."""

MAX_CHILDREN = 60
"""Test children one run starts at most (each crash or hang costs one)."""


def function_of(nodeid: str) -> str:
    """The test function of a test id (its parameters dropped)."""
    return nodeid.split("[", 1)[0]


@dataclass
class TestChild:
    """What one pytest child reported: the tests it collected, the files it could not,
    each finished test's outcome, the test it was running when it ended (if any), its
    exit status, output and the stacks the plugin dumped."""

    test_timeout: float
    collected: list[str] = field(default_factory=list)
    collect_errors: dict[str, str] = field(default_factory=dict)
    done: dict[str, dict[str, Any]] = field(default_factory=dict)
    running: str | None = None
    status: int = 0
    seconds: float = 0.0
    stacks: str = ""
    output: str = ""

    __test__ = False  # not a pytest test class

    def read_log(self, log: Path) -> None:
        """Take in the plugin's records (a line a crash cut short is skipped)."""
        for line in log.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            event = record["event"]
            if event == "collect_error":
                self.collect_errors[record["nodeid"]] = record["message"]
            elif event == "collected":
                self.collected = list(record["nodeids"])
            elif event == "start":
                self.running = record["nodeid"]
            elif event == "done":
                self.done[record["nodeid"]] = {
                    k: record[k] for k in ("outcome", "message", "seconds")
                }
                self.running = None

    def death(self) -> dict[str, Any]:
        """The outcome of the test this child died in: crash (a signal, or an exit in the
        middle of it) or hang (the watchdog's dump, or the parent's timeout), with stacks."""
        entry: dict[str, Any] = {"seconds": None}
        if self.status < 0:
            entry["outcome"] = "crash"
            entry["signal"] = signal_name(self.status)
            entry["message"] = f"the test process died of {entry['signal']}"
        elif self.status == TIMED_OUT or "Timeout (" in self.stacks or "Timeout (" in self.output:
            entry["outcome"] = "hang"
            entry["message"] = (
                "the test process outlived its time budget and was killed"
                if self.status == TIMED_OUT
                else f"still running after {self.test_timeout:g} s: every thread's stack is in "
                "'stacks'"
            )
        else:
            entry["outcome"] = "crash"
            entry["message"] = f"the test process exited with status {self.status} during this test"
        entry["stacks"] = self.stacks
        entry["output_tail"] = self.output[-2000:]
        return entry

    def collect_errors_text(self) -> str:
        """Why the child stopped before its first test: the files it could not collect."""
        errors = "; ".join(f"{path}: {msg}" for path, msg in self.collect_errors.items())
        text = f"pytest stopped at {len(self.collect_errors)} collection error(s): {errors}"
        if any("ModuleNotFoundError" in m for m in self.collect_errors.values()):
            text += " (the CUDA tests need aioep's test extra: pip install -e '.[test]')"
        return text


def run_pytest_child(
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
) -> TestChild:
    """Run pytest on ``args`` in a child with check-gpu's plugin; ``on_record`` sees each
    record of its log (collected, start, done ...) while it runs, and a ``poll`` record
    about once a second."""
    n = len(list(scratch.glob("log-*.jsonl")))
    log = scratch / f"log-{n}.jsonl"
    stacks = scratch / f"stacks-{n}.txt"
    child_env = with_tools(env)
    child_env[ENV_LOG] = str(log)
    child_env[ENV_STACKS] = str(stacks)
    child_env[ENV_TIMEOUT] = f"{test_timeout:g}"
    child_env.pop("PYTHONFAULTHANDLER", None)  # the plugin's own handler writes the stacks
    cmd = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:faulthandler"]
    cmd += ["-p", "check_gpu.pytest_plugin", *pytest_args, *args]
    child = TestChild(test_timeout)
    poll = None
    if on_record is not None:
        report = on_record
        seen = 0  # the log's complete lines already handed on

        def poll() -> None:
            nonlocal seen
            if not log.is_file():
                return
            lines = log.read_text().split("\n")[:-1]  # the last line may be half written
            for line in lines[seen:]:
                try:
                    report(json.loads(line))
                except ValueError:
                    pass
            seen = len(lines)
            report({"event": "poll"})  # a second went by

    child.status, child.output, child.seconds = run_child(cmd, child_env, cwd, timeout, poll)
    if log.is_file():
        child.read_log(log)
    if stacks.is_file():
        child.stacks = stacks.read_text(errors="replace")[-20000:]
    return child


def run_group(
    args: Sequence[str],
    *,
    deadline: float,
    max_children: int,
    run: Callable[[Sequence[str], float], TestChild],
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
            "exit_status": child.status,
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
            results[child.running] = child.death()
            note["ended_in"] = child.running
            function = function_of(child.running)
            deaths[function] = deaths.get(function, 0) + 1
            if max_deaths_per_function and deaths[function] >= max_deaths_per_function:
                why = (
                    f"{deaths[function]} cases of this function crashed or hung already: its "
                    "other cases were not run, to spare the time budget"
                )
                for nodeid in order:
                    if function_of(nodeid) == function and nodeid not in results:
                        results[nodeid] = {"outcome": "not-run", "message": why}
        elif died(child.status):
            note["ended_outside_a_test"] = child.death()
        remaining = [n for n in order if n not in results]
        if not remaining:
            break
        if child.running is None:
            # It stopped between tests (at exit, say): starting it again on the same tests
            # would learn nothing new.
            why = f"the test process ended (status {child.status}) before reaching it"
            if child.collect_errors:
                why = child.collect_errors_text()
            for nodeid in remaining:
                results[nodeid] = {"outcome": "not-run", "message": why}
            note["output_tail"] = child.output[-2000:]
            break
        pending = remaining
    return order, results, children


def worst(outcomes: Sequence[str]) -> str:
    """The most severe of ``outcomes`` (``not-run`` for none)."""
    if not outcomes:
        return "not-run"
    rank: dict[str, int] = {o: i for i, o in enumerate(SEVERITY)}
    return max(outcomes, key=lambda o: rank.get(o, len(SEVERITY)))


def run_tests(
    *,
    checkout: Path,
    env: Mapping[str, str],
    files: Sequence[str],
    py: str = sys.executable,
    pytest_args: Sequence[str] = (),
    budget: float = 300.0,
    test_timeout: float = TEST_TIMEOUT,
    isolate: Isolate = "crashed",
    max_deaths_per_function: int = 3,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the test ``files`` (paths in ``checkout``) so that no crash or hang hides another
    test (see the module docstring): every test's outcome and why, per function, and the
    counts.

    ``isolate``: what runs again alone, each function in a process of its own (`ISOLATE`).
    ``max_deaths_per_function``: see `run_group` (0: every case runs, whatever it costs).
    """
    started = time.monotonic()
    deadline = started + budget
    present = [f for f in files if (checkout / f).is_file()]
    missing = [f for f in files if f not in present]
    progress = Progress(log)
    with tempfile.TemporaryDirectory(prefix="aioep-check-tests-") as tmp:
        scratch = Path(tmp)

        def run(args: Sequence[str], left: float, *, report: bool = False) -> TestChild:
            return run_pytest_child(
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

        order, results, children = run_group(
            present,
            deadline=deadline,
            max_children=MAX_CHILDREN,
            run=functools.partial(run, report=True),
            max_deaths_per_function=max_deaths_per_function,
        )
        functions: dict[str, list[str]] = {}
        for nodeid in order:
            functions.setdefault(function_of(nodeid), []).append(nodeid)
        isolated = _run_alone(functions, results, isolate, deadline, run)
    tests = [{"nodeid": n, **results.get(n, {"outcome": "not-run"})} for n in order]
    verdict = _verdict(tests, children, missing)
    summary: dict[str, Any] = {
        "files": present,
        "missing_files": missing,
        "mode": "the files in one process; a new one for the rest after each crash or hang; "
        f"functions run again alone: {isolate}",
        "test_timeout_s": test_timeout,
        "children": children,
        "seconds": round(time.monotonic() - started, 2),
        **verdict.pop("counts"),
        "functions": {
            f: worst([results.get(n, {}).get("outcome", "not-run") for n in ids])
            for f, ids in functions.items()
        },
        "isolated": isolated,
        "tests": tests,
        **verdict,
    }
    _log_summary(summary, log)
    return summary


def _run_alone(
    functions: Mapping[str, Sequence[str]],
    results: dict[str, dict[str, Any]],
    isolate: Isolate,
    deadline: float,
    run: Callable[[Sequence[str], float], TestChild],
) -> dict[str, str]:
    """Run cases again alone, each in a child of its own: every case (``isolate="all"``),
    or the first cases of each function that crashed or hung. Each case's outcome alone
    goes into its result (``isolated``); returns each function's worst outcome alone."""
    again: dict[str, list[str]] = {}
    for function, ids in functions.items():
        if isolate == "all":
            again[function] = list(ids)
        elif isolate == "crashed":
            died = [n for n in ids if results.get(n, {}).get("outcome") in ("crash", "hang")]
            if died:
                again[function] = died[:ISOLATE_CASES]
    isolated: dict[str, str] = {}
    for function, ids in again.items():
        if deadline - time.monotonic() <= 1:
            isolated[function] = "not-run"
            continue
        _, alone, _ = run_group(ids, deadline=deadline, max_children=len(ids), run=run)
        for nodeid in ids:
            if nodeid in alone and nodeid in results:
                results[nodeid]["isolated"] = alone[nodeid]
        isolated[function] = worst([alone.get(n, {}).get("outcome", "not-run") for n in ids])
    return isolated


def _verdict(
    tests: Sequence[dict[str, Any]], children: Sequence[dict[str, Any]], missing: Sequence[str]
) -> dict[str, Any]:
    """The counts (``counts``), whether the run is ok, why, and why tests were not run."""
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    problems = [t for t in tests if t["outcome"] not in GOOD]
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
    names = {"pass": "passed", "fail": "failed", "error": "errors", "skip": "skipped"}
    names.update({"crash": "crashed", "hang": "hung", "not-run": "not_run"})
    return {
        "counts": {key: counts.get(outcome, 0) for outcome, key in names.items()},
        "not_run_why": not_run,
        "ok": ok,
        "why": why,
    }


def _log_summary(summary: Mapping[str, Any], log: Callable[[str], None]) -> None:
    log(
        f"  {summary['passed']} passed, {summary['failed']} failed, {summary['errors']} errors, "
        f"{summary['skipped']} skipped, {summary['crashed']} crashed, {summary['hung']} hung, "
        f"{summary['not_run']} not run ({summary['seconds']} s, "
        f"{len(summary['children'])} processes)"
    )
    problems = [t for t in summary["tests"] if t["outcome"] not in GOOD]
    for t in [t for t in problems if t["outcome"] != "not-run"][:30]:
        alone = t.get("isolated", {}).get("outcome")
        log(f"    {t['outcome']}: {t['nodeid']}" + (f" (alone: {alone})" if alone else ""))
    for reason, n in sorted(summary["not_run_why"].items(), key=lambda kv: -kv[1]):
        log(f"    {n} not run: {reason[:500]}")
    if not summary["tests"] and summary["children"]:
        log(f"    no test ran: {json.dumps(summary['children'][-1])[-500:]}")
