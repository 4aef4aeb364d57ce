"""The inline budget: which small pieces of work may run on the event loop's thread.

Handing work to another thread and waking the loop when it is done costs a thread hop (tens
of microseconds). Work that costs less than that is cheaper to do on the loop thread, but
only while it stays small: `InlineBudget` decides from measurements, per *kind* of
work (a hashable key the caller chooses: a copy route, a session's CPU step) and *size
class* (the byte count rounded up to a power of two), never from a guess:

- a size class may be tried inline once a smaller class of its kind was measured within
  the budget and this one is at most twice as big, or once this class was measured off the
  loop within the budget; classes up to `PROBE_BYTES` may be tried on first sight.
  The first inline run of a class therefore costs at most about twice the budget;
- an inline run that takes longer than the budget moves its class, and every larger class
  of its kind, off the loop from then on: an overrun happens at most once per kind and size;
- an overrun the work did not cause (the loop thread preempted by another process in the
  middle of a 1 us copy, or kept waiting for the GIL) is forgiven only when the work's own
  off-loop runs show it: the median of its next `READMIT_RUNS` off-loop runs used
  less than the budget of their thread's CPU time (``time.thread_time``, which a
  preempted or waiting thread does not accrue). Work that really costs more than the
  budget never comes back; work that only sometimes does costs at most one overrun per
  ``READMIT_RUNS`` runs.

Only work that never waits (a host memcpy, a CPU computation: never a driver call that can
block, never a lock held across device work) may be offered to the budget at all.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from .errors import InvalidArgument

__all__ = [
    "DEFAULT_INLINE_BUDGET_US",
    "MAX_INLINE_BUDGET_US",
    "PROBE_BYTES",
    "READMIT_RUNS",
    "InlineBudget",
]

T = TypeVar("T")

DEFAULT_INLINE_BUDGET_US = 20.0
"""The default budget: about what the loop thread itself spends on one thread hop (making
the future, handing the work over, waking from ``select``, running the callback), measured
at 12-25 us on a 2-core VM (``benchmarks/streams.py``). Work cheaper than that costs the
loop less inline than the hop would; a 4 KiB memcpy takes about 1 us."""

MAX_INLINE_BUDGET_US = 1000.0
"""The largest budget accepted: 1 ms of loop time per piece of work."""

PROBE_BYTES = 16 << 10
"""Sizes up to this may be tried inline with no smaller measurement of their kind."""

READMIT_RUNS = 8
"""Off-loop runs whose median CPU time, under the budget, forgives an overrun."""

_PROBE_CLASS = PROBE_BYTES.bit_length()
_NO_CLASS = 1 << 80  # a mask bit above every size class (an int has no fixed width)


class _Kind:
    """What the budget knows of one kind: bit ``c`` of a mask stands for size class ``c``."""

    __slots__ = ("clean", "good", "over")

    def __init__(self) -> None:
        self.over = _NO_CLASS  # the lowest class whose inline run overran (none: above all)
        self.good = 0  # classes measured within the budget
        self.clean: dict[int, list[float]] = {}  # overrun class -> CPU times off the loop since


class InlineBudget:
    """Decides, from measured run times, whether a piece of work may run inline on the loop.

    ``budget_us`` is the most loop time one piece may take (0 runs nothing inline). Use
    `allows` to ask, `run` to run a piece inline and time it, and
    `run_off_loop` (or `record`) for a run on a worker thread. Thread-safe.
    Counters for diagnostics and tests: `inline_runs`, `overruns`.

    Raises:
        InvalidArgument: ``budget_us`` is not a number in [0, ``MAX_INLINE_BUDGET_US``].
    """

    __slots__ = ("_kinds", "_lock", "budget", "inline_runs", "overruns")

    def __init__(self, budget_us: float = DEFAULT_INLINE_BUDGET_US) -> None:
        if (
            isinstance(budget_us, bool)
            or not isinstance(budget_us, (int, float))
            or not 0 <= budget_us <= MAX_INLINE_BUDGET_US
            or math.isnan(budget_us)
        ):
            raise InvalidArgument(
                f"inline_budget_us must be a number in [0, {MAX_INLINE_BUDGET_US:g}] "
                f"(microseconds), got {budget_us!r}"
            )
        self.budget = float(budget_us) * 1e-6
        """The budget in seconds."""
        self._kinds: dict[Hashable, _Kind] = {}
        self._lock = threading.Lock()
        self.inline_runs = 0
        """Pieces of work run inline through `run`."""
        self.overruns = 0
        """Inline runs that took longer than the budget."""

    def allows(self, kind: Hashable, nbytes: int = 0) -> bool:
        """True when a piece of ``kind`` and ``nbytes`` may run inline now (see the module)."""
        if not self.budget:
            return False
        size = nbytes.bit_length()
        state = self._kinds.get(kind)
        if state is None:
            return size <= _PROBE_CLASS
        if size >= state.over:
            return False
        # This class, or the one below it, measured within the budget; or a small one.
        return size <= _PROBE_CLASS or bool(state.good & (3 << max(size - 1, 0)))

    def run(self, kind: Hashable, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` here and now (the caller checked `allows`), timing it.

        An exception ``fn`` raises propagates; the run still counts.
        """
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.ran_inline(kind, nbytes, time.perf_counter() - start)

    def ran_inline(self, kind: Hashable, nbytes: int, seconds: float) -> None:
        """`record` an inline run (the fast form, for a caller that timed it itself)."""
        state = self._kinds.get(kind)
        if seconds <= self.budget and state is not None and (state.good >> nbytes.bit_length()) & 1:
            self.inline_runs += 1  # within budget, as before: nothing to learn
        else:
            self.record(kind, nbytes, seconds, inline=True)

    def record(self, kind: Hashable, nbytes: int, seconds: float, *, inline: bool) -> None:
        """Report a run of ``kind``: inline (``seconds`` of the loop's time, wall clock), or
        off the loop (``seconds`` of its thread's CPU time)."""
        size = nbytes.bit_length()
        bit = 1 << size
        with self._lock:
            state = self._kinds.get(kind)
            if state is None:
                state = self._kinds[kind] = _Kind()
            if inline:
                self.inline_runs += 1
                if seconds > self.budget:
                    self.overruns += 1
                    state.over = min(state.over, size)
                    state.good &= bit - 1  # this class and larger ones no longer count
                    state.clean[size] = []
                else:
                    state.good |= bit
                return
            if size < state.over:
                if seconds <= self.budget:
                    state.good |= bit
                return
            if size not in state.clean:
                return  # barred only because a smaller class overran
            # An overrun class: forgive it once enough off-loop runs show the work is cheap.
            runs = state.clean[size]
            runs.append(seconds)
            if len(runs) < READMIT_RUNS:
                return
            if sorted(runs)[len(runs) // 2] > self.budget:
                runs.clear()  # it does cost that much: it stays off the loop
                return
            del state.clean[size]
            state.good |= bit
            state.over = min(state.clean, default=_NO_CLASS)

    def run_off_loop(self, kind: Hashable, nbytes: int, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on this (worker) thread and `record` the CPU time it took
        as an off-loop run."""
        start = time.thread_time()
        try:
            return fn(*args)
        finally:
            self.record(kind, nbytes, time.thread_time() - start, inline=False)

    def forget(self, kind: Hashable) -> None:
        """Drop what was measured of ``kind`` (whose work will not come again: a closed
        session's), so that the budget does not grow with every kind ever seen."""
        with self._lock:
            self._kinds.pop(kind, None)

    def __repr__(self) -> str:
        return (
            f"<InlineBudget {self.budget * 1e6:g} us: {self.inline_runs} inline runs, "
            f"{self.overruns} overruns, {len(self._kinds)} kinds>"
        )
