"""Sim streams: each one is a worker thread that runs its device work strictly in order."""

from __future__ import annotations

import itertools
import weakref

from aioep import DeviceError
from aioep.abc import ThreadStream

from ._device import SimDevice

__all__ = ["SimStream", "stream_by_handle"]

_ids = itertools.count()
# Open streams by handle: the ``stream`` value of the DLPack and CUDA Array Interface
# protocols names a sim stream by its handle.
_by_handle: weakref.WeakValueDictionary[int, SimStream] = weakref.WeakValueDictionary()


def stream_by_handle(handle: int) -> SimStream | None:
    """The open sim stream whose handle is ``handle``, or None."""
    stream = _by_handle.get(handle)
    return None if stream is None or stream.closed else stream


class SimStream(ThreadStream):
    """An in-order queue of work on one sim device, run by its own worker thread.

    Everything comes from [`aioep.abc.ThreadStream`][aioep.abc.ThreadStream]: copies are
    enqueued by the data transfer, notifications mark points in the order, and
    a wait on another stream's notification parks this worker (the "device"),
    never the host.
    """

    def __init__(self, device: SimDevice) -> None:
        super().__init__(f"sim:{device.device_id}/stream-{next(_ids)}")
        self.device = device
        self.closed = False
        _by_handle[self.handle] = self

    def close(self) -> None:
        self.closed = True
        if _by_handle.get(self.handle) is self:
            del _by_handle[self.handle]
        super().close()

    def sticky_error(self) -> BaseException | None:
        """Once the device is lost, every later mark on its streams reports it (as CUDA does)."""
        if self.device.lost_reason is None:
            return None
        return DeviceError(f"sim device {self.device.device_id}: {self.device.lost_reason}")

    def __repr__(self) -> str:
        return f"<SimStream {self.name}>"
