"""One registered plugin library: its factory and everything made from it."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from .._plugin.allocator import Allocator
from .._plugin.device import EpDevice
from .._plugin.factory import EpFactory
from .._plugin.loader import ExternalDataLoader
from .._plugin.stream import SyncStream
from .._plugin.transfer import DataTransfer
from .stream_pool import StreamRing

__all__ = ["Library"]


@dataclass(eq=False)
class Library:
    """One registered plugin library: its factory and everything made from it."""

    name: str
    factory: EpFactory
    ep_devices: list[EpDevice] = field(default_factory=list)
    allocators: list[Allocator] = field(default_factory=list)  # every allocator made from it
    transfer: DataTransfer | None = None
    loader: ExternalDataLoader | None = None
    streams: set[SyncStream] = field(default_factory=set)
    pools: dict[EpDevice, StreamRing] = field(default_factory=dict)  # env.pooled_stream's
    sessions: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)  # open sessions
    retired: list[Allocator] = field(default_factory=list)  # retired, still serving live buffers
