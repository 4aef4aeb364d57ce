"""The plugin hook for foreign memory: how a backend adopts memory that another library
made (PyTorch, CuPy, JAX, numba...) and handed over by DLPack or the CUDA Array Interface.

A factory offers a `MemoryImporter` from ``EpFactory.create_memory_importer``. The
core asks the registered importers, in registration order, which of them owns the
memory; the owner's device then holds the imported tensor (zero-copy, never freed by
aioep) and its data transfers move it. The host's importer owns ``kDLCPU``.
"""

from __future__ import annotations

from typing import Any

from .._base.codes import DLDeviceType
from .._base.types import MemoryInfo
from .buffer import HOST_MEMORY_INFO
from .stream_impl import NotificationImpl, StreamImpl

__all__ = ["HostMemoryImporter", "MemoryImporter"]


class MemoryImporter:
    """Adopts foreign memory on a backend's devices (DLPack and CUDA Array Interface imports).

    ``dlpack_device_types`` lists the DLPack device types whose memory the backend may
    own; the core only asks an importer about those. Every method runs on the event loop
    (or the caller's thread) and must not block: no call that waits on a device.
    """

    dlpack_device_types: tuple[int, ...] = ()
    """DLPack device type codes ([`DLDeviceType`][aioep.abc.DLDeviceType]) this backend's memory may
    have."""

    def adopt(self, device_type: int, device_id: int, ptr: int, nbytes: int) -> MemoryInfo | None:
        """The memory info of ``nbytes`` at ``ptr`` on the DLPack device
        ``(device_type, device_id)`` when one of this backend's devices owns that memory,
        else None (another backend, or nobody, owns it).

        For a CUDA Array Interface, which names no device, ``device_type`` is
        ``kDLCUDA`` and ``device_id`` is -1: the importer finds the device from the
        pointer (unified addressing) or returns None.
        """
        return None

    def dlpack_stream(self, device_type: int, device_id: int, stream: StreamImpl | None) -> Any:
        """The ``stream`` argument for the producer's ``__dlpack__`` when a copy on
        ``stream`` (None: a copy without a stream) uses memory on this DLPack device.

        The array API standard's convention: the consumer's stream handle, so the
        producer orders its pending work before it; None for devices without streams
        and, on CUDA, the legacy default stream.
        """
        return None

    def producer_work(
        self, memory: MemoryInfo, producer_stream: Any, stream: StreamImpl | None
    ) -> NotificationImpl | None:
        """A notification activated after the work enqueued so far on the producer's
        stream, which the copy must wait for; None when there is nothing to wait for.

        ``producer_stream`` is what this importer's
        [`dlpack_stream`][aioep.abc.MemoryImporter.dlpack_stream] returned (the producer ordered its
        work before that stream), or a CUDA Array Interface's ``stream`` (never None here).
        ``stream`` is the copy's stream (None: none); the core waits for the notification on it, on
        the device, or on a worker thread before a copy without a stream.
        """
        return None


class HostMemoryImporter(MemoryImporter):
    """Host RAM handed over as ``kDLCPU`` (numpy, PyTorch and JAX CPU tensors)."""

    dlpack_device_types = (DLDeviceType.CPU,)

    def adopt(self, device_type: int, device_id: int, ptr: int, nbytes: int) -> MemoryInfo | None:
        return HOST_MEMORY_INFO if device_type == DLDeviceType.CPU else None
