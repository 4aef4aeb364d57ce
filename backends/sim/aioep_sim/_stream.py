"""Sim streams: each one is a worker thread that runs its device work strictly in order."""

from __future__ import annotations

import itertools

from aioep.abc import ThreadStream

from ._device import SimDevice

__all__ = ["SimStream"]

_ids = itertools.count()


class SimStream(ThreadStream):
    """An in-order queue of work on one sim device, run by its own worker thread.

    Everything comes from :class:`aioep.abc.ThreadStream`: copies are
    enqueued by the data transfer, notifications mark points in the order, and
    a wait on another stream's notification parks this worker (the "device"),
    never the host.
    """

    def __init__(self, device: SimDevice) -> None:
        super().__init__(f"sim:{device.device_id}/stream-{next(_ids)}")
        self.device = device

    def __repr__(self) -> str:
        return f"<SimStream {self.name}>"
