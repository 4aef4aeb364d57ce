"""DLPack and CUDA Array Interface for sim memory: import (a `MemoryImporter`) and
export (``Tensor.__dlpack__`` of sim device tensors).

Sim device memory is DLPack device type ``kDLExtDev`` (12, the type ``dlpack.h`` reserves
for extension devices), device id = sim device id. A sim stream's handle (its worker
thread's id) is the ``stream`` value of the DLPack and CUDA Array Interface protocols:
an importer makes the copy wait for the producer's stream, an exporter makes the
consumer's stream wait for the tensor's stream, both on the device (the worker thread).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aioep import DeviceError, InvalidArgument, MemoryInfo, Tensor
from aioep.abc import DLDeviceType, MemoryImporter, NotificationImpl, StreamImpl, dlpack_capsule

from ._device import SimDevice
from ._stream import SimStream, stream_by_handle

__all__ = ["SimMemoryImporter", "export_dlpack"]


class SimMemoryImporter(MemoryImporter):
    """Adopts sim device memory: ``kDLExtDev`` DLPack tensors and CUDA Array Interfaces
    whose pointer is inside a live sim allocation."""

    dlpack_device_types = (DLDeviceType.EXT_DEV,)

    def __init__(self, devices: Mapping[int, SimDevice]) -> None:
        self._devices = dict(devices)

    def adopt(self, device_type: int, device_id: int, ptr: int, nbytes: int) -> MemoryInfo | None:
        if device_type == DLDeviceType.EXT_DEV:
            candidates = [self._devices[device_id]] if device_id in self._devices else []
        elif device_type == DLDeviceType.CUDA and device_id == -1:
            candidates = list(self._devices.values())  # unified addresses: find the device
        else:
            return None
        for dev in candidates:
            if nbytes == 0 and device_type == DLDeviceType.EXT_DEV:
                return dev.memory_info
            try:
                dev.memory.resolve(ptr, max(nbytes, 1))
            except DeviceError:
                continue
            return dev.memory_info
        return None

    def dlpack_stream(self, device_type: int, device_id: int, stream: StreamImpl | None) -> Any:
        return stream.handle if isinstance(stream, SimStream) else None

    def producer_work(
        self, memory: MemoryInfo, producer_stream: Any, stream: StreamImpl | None
    ) -> NotificationImpl | None:
        if producer_stream is None or producer_stream == -1:
            return None
        if stream is not None and producer_stream == stream.handle:
            return None  # the producer ordered its work before our own stream
        producer = stream_by_handle(int(producer_stream))
        if producer is None:
            raise InvalidArgument(
                f"sim: producer stream {producer_stream!r} is not an open sim stream"
            )
        notification = producer.create_notification()
        notification.activate()
        return notification


def export_dlpack(tensor: Tensor, stream: Any = None) -> Any:
    """A ``kDLExtDev`` capsule of a sim device tensor, the consumer's ``stream`` (a sim
    stream handle) ordered after aioep's work on the tensor (the stream its buffer was
    allocated on, the last copy that used it); None: wait for that work here; -1: no wait."""
    if tensor.buffer.freed:
        raise BufferError(f"tensor buffer {tensor.buffer!r} was freed")
    if stream != -1:
        consumer = None if stream is None else stream_by_handle(int(stream))
        if stream is not None and consumer is None:
            raise BufferError(f"sim: stream {stream!r} is not an open sim stream")
        marks: list[NotificationImpl] = []
        producer = getattr(tensor.buffer.stream, "impl", None)
        if isinstance(producer, SimStream) and not producer.closed and producer is not consumer:
            # The buffer was allocated on an open sim stream: its work comes first.
            mark = producer.create_notification()
            mark.activate()
            marks.append(mark)
        work = tensor.buffer.pending_work
        if work is not None and (work.stream is None or work.stream.impl is not consumer):
            marks.append(work.impl)  # the last copy that used the buffer, still running
        for point in marks:
            if consumer is None:
                point.wait_on_host(None)  # no consumer stream: the data must be ready now
            else:
                point.wait_on_device(consumer)
    return dlpack_capsule(
        tensor.data_ptr,
        tensor.shape,
        tensor.dtype,
        (DLDeviceType.EXT_DEV, tensor.device.device_id),
        tensor,
    )
