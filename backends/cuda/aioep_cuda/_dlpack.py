"""DLPack and CUDA Array Interface for CUDA memory: export (``Tensor.__dlpack__``) and
import (a `MemoryImporter`), built with ctypes (no compiled code).

Export is registered with ``aioep.abc.register_dlpack_exporter`` under NVIDIA's vendor
id, so ``torch.from_dlpack(t)`` / ``cupy.from_dlpack(t)`` take a CUDA tensor zero-copy;
the capsule is a legacy ``"dltensor"`` one (DLPack 0.8 ABI, which every consumer
accepts), built by `aioep.abc.dlpack_capsule`.

Import takes ``kDLCUDA`` and ``kDLCUDAHost`` DLPack tensors and CUDA Array Interfaces
whose pointer the driver knows (``cuPointerGetAttribute``: device memory of one of our
GPUs, or page-locked host memory). Streams follow the array API standard: a copy on a
`CudaStream` passes its handle to the producer; a copy without a stream passes
None (the legacy default stream), and waits for that stream, or for a CUDA Array
Interface's ``stream``, on an event recorded there.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from aioep import MemoryInfo, NotImplementedByEp, Tensor
from aioep.abc import (
    DLDeviceType,
    DLManagedTensor,
    MemoryImporter,
    NotificationImpl,
    StreamImpl,
    dlpack_capsule,
    dlpack_dtype,
    live_dlpack_exports,
)

from ._device import CudaDevice
from ._driver import call_nogil, check, ctx_current, driver
from ._stream import CudaNotification, CudaStream

__all__ = [
    "CudaMemoryImporter",
    "DLManagedTensor",
    "dlpack_dtype",
    "export_dlpack",
    "live_exports",
]

_DL_CUDA = int(DLDeviceType.CUDA)
_LEGACY_STREAM = 1  # CU_STREAM_LEGACY: what DLPack's stream=None means on CUDA


def export_dlpack(tensor: Tensor, stream: Any = None) -> Any:
    """A ``"dltensor"`` capsule for a tensor in CUDA device memory.

    ``stream`` is the consumer's stream (DLPack protocol: None or 1 = legacy
    default stream, 2 = per-thread default, -1 = no synchronisation, else a
    ``cudaStream_t``). When the buffer was allocated on an open aioep stream,
    the consumer's stream is made to wait (on the device) for that stream's work.
    """
    dlpack_dtype(np.dtype(tensor.dtype))  # BufferError before any side effect
    if tensor.buffer.freed:
        raise BufferError(f"tensor buffer {tensor.buffer!r} was freed")
    _order_consumer(tensor, stream)
    return dlpack_capsule(
        tensor.data_ptr, tensor.shape, tensor.dtype, (_DL_CUDA, tensor.device.device_id), tensor
    )


def _order_consumer(tensor: Tensor, stream: Any) -> None:
    """Make the consumer's stream wait (on the device) for aioep's work on the tensor: the
    stream its buffer was allocated on and the last copy that used it."""
    if stream == -1:
        return
    consumer = _LEGACY_STREAM if stream is None else int(stream)  # 2: per-thread default
    producer = getattr(tensor.buffer.stream, "impl", None)
    if isinstance(producer, CudaStream) and not producer.closed and consumer != producer.handle:
        drv = driver()
        notification = producer.create_notification()
        notification.activate()
        event = notification.recorded_event()
        with ctx_current(producer.device.ctx):
            check(
                drv.cuStreamWaitEvent(drv.CUstream(consumer), event, 0),
                "cuStreamWaitEvent (DLPack consumer stream)",
            )
    work = tensor.buffer.pending_work
    if work is None:
        return
    impl = work.impl
    if isinstance(impl, CudaNotification):
        if getattr(work.stream, "handle", None) == consumer:
            return  # the copy is on the consumer's own stream: already in order
        drv = driver()
        event = impl.recorded_event()
        with ctx_current(impl.stream.device.ctx):
            check(
                drv.cuStreamWaitEvent(drv.CUstream(consumer), event, 0),
                "cuStreamWaitEvent (DLPack consumer stream, pending copy)",
            )
    else:
        # A copy that no CUDA event marks (run on a worker thread): finish it. A blocking
        # wait on purpose (DLPack's protocol is synchronous), so not work.wait(), which warns
        # on an event loop's thread.
        work.impl.wait_on_host(None)
        error = work.exception()
        if error is not None:
            raise error


def live_exports() -> int:
    """Capsules (or consumer tensors) that still hold an exported tensor (for tests)."""
    return live_dlpack_exports()


class CudaMemoryImporter(MemoryImporter):
    """Adopts memory the driver knows: device memory of this factory's GPUs and page-locked
    host memory (``kDLCUDA``, ``kDLCUDAHost``, CUDA Array Interface pointers)."""

    dlpack_device_types = (DLDeviceType.CUDA, DLDeviceType.CUDA_HOST)

    def __init__(self, devices: Mapping[int, CudaDevice]) -> None:
        self._devices = dict(devices)

    def adopt(self, device_type: int, device_id: int, ptr: int, nbytes: int) -> MemoryInfo | None:
        if not self._devices or device_type not in (DLDeviceType.CUDA, DLDeviceType.CUDA_HOST):
            return None
        first = next(iter(self._devices.values()))
        if not ptr or not nbytes:
            if device_type == DLDeviceType.CUDA_HOST:
                return first.pinned_info
            dev = self._devices.get(device_id)
            return None if dev is None else dev.default_info
        kind, ordinal = _pointer_kind(ptr)
        if kind == "host":
            # Page-locked host memory: any GPU reaches it; CUDA copies it asynchronously.
            if device_type == DLDeviceType.CUDA_HOST or device_id == -1:
                return first.pinned_info
            return None
        if kind != "device" or device_type != DLDeviceType.CUDA:
            return None
        if device_id not in (-1, ordinal):
            return None
        dev = self._devices.get(ordinal)
        return None if dev is None else dev.default_info

    def dlpack_stream(self, device_type: int, device_id: int, stream: StreamImpl | None) -> Any:
        return stream.handle if isinstance(stream, CudaStream) else None

    def producer_work(
        self, memory: MemoryInfo, producer_stream: Any, stream: StreamImpl | None
    ) -> NotificationImpl | None:
        if producer_stream == -1:
            return None
        if isinstance(stream, CudaStream) and producer_stream == stream.handle:
            return None  # the producer ordered its work before our stream itself
        handle = _LEGACY_STREAM if producer_stream is None else int(producer_stream)
        dev = self._devices.get(memory.device.device_id) or next(iter(self._devices.values()))
        return ForeignStreamEvent(dev, handle)


def _pointer_kind(ptr: int) -> tuple[str, int]:
    """("device", ordinal), ("host", -1) for page-locked host memory, or ("unknown", -1)."""
    drv = driver()
    attr = drv.CUpointer_attribute
    try:
        err, kind = drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
        if err != drv.CUresult.CUDA_SUCCESS:
            return "unknown", -1
        if int(kind) == int(drv.CUmemorytype.CU_MEMORYTYPE_HOST):
            return "host", -1
        if int(kind) != int(drv.CUmemorytype.CU_MEMORYTYPE_DEVICE):
            return "unknown", -1
        err, ordinal = drv.cuPointerGetAttribute(attr.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        if err != drv.CUresult.CUDA_SUCCESS:
            return "unknown", -1
        return "device", int(ordinal)
    except Exception:
        return "unknown", -1


class ForeignStreamEvent(NotificationImpl):
    """An event recorded on a producer's stream (any ``CUstream`` value, 1 = legacy default,
    2 = per-thread default): the point a copy of the producer's memory waits for."""

    __slots__ = ("_device", "event")

    def __init__(self, device: CudaDevice, handle: int) -> None:
        drv = driver()
        self._device = device
        flags = int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING) | int(
            drv.CUevent_flags.CU_EVENT_BLOCKING_SYNC
        )
        with ctx_current(device.ctx):
            self.event = check(drv.cuEventCreate(flags), "cuEventCreate")
            try:
                check(
                    drv.cuEventRecord(self.event, drv.CUstream(handle)),
                    f"cuEventRecord (producer stream {handle:#x})",
                )
            except BaseException:
                drv.cuEventDestroy(self.event)
                raise
        weakref.finalize(self, _destroy_event, self.event)

    def activate(self) -> None:
        pass  # recorded when made

    def wait_on_device(self, stream: StreamImpl) -> None:
        if not isinstance(stream, CudaStream):
            raise NotImplementedByEp(
                f"{type(stream).__name__} cannot wait on the device for a CUDA producer stream"
            )
        drv = driver()
        with stream.lock, ctx_current(stream.device.ctx):
            check(drv.cuStreamWaitEvent(stream.cu, self.event, 0), "cuStreamWaitEvent (producer)")
            stream.enqueued()

    def query(self) -> bool:
        drv = driver()
        return bool(drv.cuEventQuery(self.event)[0] != drv.CUresult.CUDA_ERROR_NOT_READY)

    def error(self) -> BaseException | None:
        drv = driver()
        err = drv.cuEventQuery(self.event)[0]
        if err in (drv.CUresult.CUDA_SUCCESS, drv.CUresult.CUDA_ERROR_NOT_READY):
            return None
        try:
            check((err,), "cuEventQuery (producer stream)")
        except BaseException as exc:
            return exc
        return None

    def wait_on_host(self, timeout: float | None) -> bool:
        if timeout is not None:
            return super().wait_on_host(timeout)
        # A blocking-sync event: the calling (worker) thread sleeps in the driver.
        check(call_nogil("cuEventSynchronize", int(self.event)), "cuEventSynchronize (producer)")
        return True


def _destroy_event(event: Any) -> None:
    try:
        driver().cuEventDestroy(event)
    except Exception:  # interpreter exit: nothing can be raised from a finalizer
        pass
