"""Progress bars for long set-up work (initializer loads, session creation): tqdm's, shown
when asked for, or by default when standard error is a terminal; none without tqdm."""

from __future__ import annotations

import sys
from typing import Any

from .errors import InvalidArgument

__all__ = ["ProgressBar", "wants_bar"]


def wants_bar(progress: bool | None, where: str) -> bool:
    """Whether to show a bar: ``progress`` as given, or (None) when stderr is a terminal.

    Raises:
        InvalidArgument: ``progress`` is not a bool or None.
    """
    if progress is None:
        stream = sys.stderr
        return stream is not None and stream.isatty()
    if not isinstance(progress, bool):
        raise InvalidArgument(f"{where}: progress must be True, False or None, got {progress!r}")
    return progress


class ProgressBar:
    """A tqdm bar of ``total`` ``unit``s, or nothing when ``show`` is false, ``total`` is 0
    or tqdm is not installed. Thread-safe as tqdm is; `close` is idempotent."""

    def __init__(self, total: int, desc: str, show: bool, *, unit: str = "B") -> None:
        self._bar: Any = None
        if show and total:
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is optional: no bar without it
                return
            scale = unit == "B"
            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024)

    def update(self, n: int, desc: str | None = None) -> None:
        """Advance by ``n`` (and relabel the bar with ``desc``)."""
        if self._bar is not None:
            if desc is not None:
                self._bar.set_description_str(desc, refresh=False)
            self._bar.update(n)

    def close(self) -> None:
        """Finish the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
