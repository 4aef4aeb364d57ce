"""Copy routing cached per stream: which data transfer copies between two memory devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._base.types import MemoryDevice
    from .._memory.transfer import DataTransfer

__all__ = ["Route", "RouteCache", "RouteKey"]

Route = tuple[str, "DataTransfer"]
"""(library name, data transfer)."""
RouteKey = tuple["MemoryDevice", "MemoryDevice"]
"""(source memory device, destination memory device)."""


class RouteCache:
    """Routing decisions for one stream (or for un-streamed copies): (source device,
    destination device) -> the (library name, transfer) that copies between them.

    Valid while the environment's transfer list is unchanged; `table`
    compares it with the list it was filled from and starts afresh when it
    differs (a library registered or removed). Only successes are cached, so
    every error is raised again with its full message. This relies on
    ``can_copy`` and ``can_use_stream`` giving the same answer for the same
    arguments while a transfer is registered.
    """

    __slots__ = ("_routes", "_snapshot")

    def __init__(self) -> None:
        self._snapshot: tuple[tuple[str, DataTransfer], ...] = ()
        self._routes: dict[RouteKey, Route] = {}

    def table(self, transfers: Sequence[tuple[str, DataTransfer]]) -> dict[RouteKey, Route]:
        """The cached routes for ``transfers`` (a fresh table if the list changed)."""
        current = tuple(transfers)
        if self._snapshot != current:
            self._snapshot = current
            self._routes = {}
        return self._routes
