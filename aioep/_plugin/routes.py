"""Copy routing cached per stream: which data transfer copies between two memory devices."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._base.types import MemoryDevice
    from .transfer import DataTransfer

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

    `memo` is a second table, for what a caller derives from the routes (the copy
    dispatcher's fast path): it is emptied whenever the routes are.
    """

    __slots__ = ("_memo", "_routes", "_snapshot")

    def __init__(self) -> None:
        self._snapshot: tuple[tuple[str, DataTransfer], ...] = ()
        self._routes: dict[RouteKey, Route] = {}
        self._memo: dict[Hashable, Any] = {}

    def table(self, transfers: Sequence[tuple[str, DataTransfer]]) -> dict[RouteKey, Route]:
        """The cached routes for ``transfers`` (a fresh table if the list changed)."""
        current = tuple(transfers)
        if self._snapshot != current:
            self._snapshot = current
            self._routes = {}
            self._memo = {}
        return self._routes

    def memo(self, transfers: Sequence[tuple[str, DataTransfer]]) -> dict[Hashable, Any]:
        """The derived table for ``transfers`` (a fresh one if the list changed)."""
        current = tuple(transfers)
        if self._snapshot != current:
            self._snapshot = current
            self._routes = {}
            self._memo = {}
        return self._memo

    def clear(self) -> None:
        """Forget every route (the stream closed)."""
        self._snapshot = ()
        self._routes = {}
        self._memo = {}
