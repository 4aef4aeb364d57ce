"""Sim streams: each one is a worker thread that runs its device work strictly in order."""

from __future__ import annotations

import itertools

from aioep import DeviceError
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

    def sticky_error(self) -> BaseException | None:
        """Once the device is lost, every later mark on its streams reports it (as CUDA does)."""
        if self.device.lost_reason is None:
            return None
        return DeviceError(f"sim device {self.device.device_id}: {self.device.lost_reason}")

    def __repr__(self) -> str:
        return f"<SimStream {self.name}>"
