"""The test run's progress on the console."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Progress"]


class Progress:
    """A line as each test file starts, and one every ``every`` seconds while a file runs
    long (the soak tests, a slow GPU). Fed the test plugin's records (`record`)."""

    def __init__(self, log: Callable[[str], None], every: float = 30.0) -> None:
        self.log = log
        self.every = every
        self.total = 0
        self.done = 0
        self.file = ""
        self.current = ""
        self.started = time.monotonic()
        self.last = self.started

    def record(self, record: Mapping[str, Any]) -> None:
        """Take in one record (``collected``, ``collect_error``, ``start``, ``done`` or
        ``poll``: a second went by)."""
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
