"""The pytest plugin of check-gpu's test children (``-p check_gpu.pytest_plugin``).

It writes one JSON line per test as the test starts and as it ends, flushed before the next
test runs, so that a crash loses nothing; it dumps every thread's stack on a fatal signal;
and a watchdog per test dumps every thread's stack and ends the process once the test has
run ``AIOEP_CHECK_TEST_TIMEOUT`` seconds (a hang). The records and the stacks go to the
files named by ``AIOEP_CHECK_LOG`` and ``AIOEP_CHECK_STACKS`` (see `check_gpu.runner`).
Without those variables the plugin does nothing.
"""

from __future__ import annotations

import faulthandler
import json
import os
import time
from typing import IO, Any

import pytest

__all__ = ["ENV_LOG", "ENV_STACKS", "ENV_TIMEOUT", "Recorder", "pytest_configure"]

ENV_LOG = "AIOEP_CHECK_LOG"
ENV_STACKS = "AIOEP_CHECK_STACKS"
ENV_TIMEOUT = "AIOEP_CHECK_TEST_TIMEOUT"


def _text(report: pytest.CollectReport | pytest.TestReport) -> str:
    try:
        text = report.longreprtext
    except Exception:
        text = str(report.longrepr)
    return text[-3000:]


class Recorder:
    """Records each test's start and outcome (see the module docstring)."""

    def __init__(self, log: IO[str], stacks: int, timeout: float) -> None:
        self._log = log
        self._stacks = stacks
        self._timeout = timeout
        self._reports: dict[str, list[pytest.TestReport]] = {}
        self._started: dict[str, float] = {}
        faulthandler.enable(file=stacks, all_threads=True)

    @classmethod
    def from_environ(cls) -> Recorder | None:
        """The recorder the environment asks for, or None outside check-gpu."""
        if ENV_LOG not in os.environ:
            return None
        log = open(os.environ[ENV_LOG], "a", buffering=1)  # noqa: SIM115 - lives as long as pytest
        stacks = os.open(os.environ[ENV_STACKS], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        return cls(log, stacks, float(os.environ[ENV_TIMEOUT]))

    def _emit(self, **record: Any) -> None:
        self._log.write(json.dumps(record) + "\n")
        self._log.flush()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._emit(event="collected", nodeids=[item.nodeid for item in session.items])

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        # A test file that cannot be imported (a missing test dependency, say) stops the run
        # before any test: say which and why, its exception's last line.
        if report.failed:
            lines = [line for line in _text(report).splitlines() if line.strip()]
            errors = [line[1:].strip() for line in lines if line.startswith("E ")]
            message = (errors or lines or ["?"])[-1][:500]
            self._emit(event="collect_error", nodeid=report.nodeid, message=message)

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        os.ftruncate(self._stacks, 0)
        os.lseek(self._stacks, 0, os.SEEK_SET)
        self._started[nodeid] = time.perf_counter()
        self._emit(event="start", nodeid=nodeid)
        faulthandler.dump_traceback_later(self._timeout, exit=True, file=self._stacks)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._reports.setdefault(report.nodeid, []).append(report)

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        faulthandler.cancel_dump_traceback_later()
        outcome, message = "pass", ""
        for report in self._reports.pop(nodeid, []):
            if report.failed:
                outcome = "fail" if report.when == "call" else "error"
                message = f"{report.when}: {_text(report)}"
                break
            if report.skipped and outcome == "pass":
                outcome = "skip"
                longrepr = report.longrepr
                message = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)[-500:]
        seconds = round(time.perf_counter() - self._started.pop(nodeid, time.perf_counter()), 3)
        self._emit(event="done", nodeid=nodeid, outcome=outcome, message=message, seconds=seconds)


def pytest_configure(config: pytest.Config) -> None:
    """Register the recorder when check-gpu runs this child."""
    recorder = Recorder.from_environ()
    if recorder is not None:
        config.pluginmanager.register(recorder, "check_gpu_recorder")
