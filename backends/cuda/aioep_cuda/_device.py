"""Per-GPU state: the retained primary context, memory infos, an event pool and helper streams."""

from __future__ import annotations

import threading
from typing import Any

from aioep import DeviceError, DeviceType, HardwareDevice, MemoryDevice, MemoryInfo, MemoryType

from ._driver import call_nogil, check, ctx_current, driver
from ._free import Freer

__all__ = ["NVIDIA_VENDOR_ID", "CudaDevice", "EventPool"]

NVIDIA_VENDOR_ID = 0x10DE
_GATE_SLOTS = 1024  # 4-byte gate words per device (one per stream that copies pageable memory)


class EventPool:
    """Reusable ``CUevent`` objects created with ``CU_EVENT_DISABLE_TIMING``.

    Creating an event is a driver call with a lock inside; a notification is made
    for every ``stream.record()``, so events are recycled (up to ``keep`` idle).
    """

    def __init__(self, device: CudaDevice, keep: int = 1024) -> None:
        self._device = device
        self._keep = keep
        self._free: list[Any] = []
        self._lock = threading.Lock()
        self._closed = False
        self.created = 0

    def take(self) -> Any:
        """An idle event, or a new one."""
        with self._lock:
            if self._free:
                return self._free.pop()
        drv = driver()
        with ctx_current(self._device.ctx):
            event = check(
                drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate"
            )
        self.created += 1
        return event

    def give(self, event: Any) -> None:
        """Return an event; a later ``cuEventRecord`` re-marks it (waits already enqueued keep
        the state they captured, so reuse is safe)."""
        with self._lock:
            if not self._closed and len(self._free) < self._keep:
                self._free.append(event)
                return
        self._destroy(event)

    def _destroy(self, event: Any) -> None:
        try:
            driver().cuEventDestroy(event)
        except Exception:  # finalizers at interpreter exit: nothing can be raised
            pass

    def close(self) -> None:
        """Destroy idle events; events still held are destroyed when given back."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for event in free:
            self._destroy(event)


class CudaDevice:
    """One GPU: ordinal, ``CUdevice``, retained primary context and its memory infos."""

    def __init__(self, ordinal: int) -> None:
        drv = driver()
        self.ordinal = ordinal
        self.cu_device = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
        raw_name = check(drv.cuDeviceGetName(256, self.cu_device), "cuDeviceGetName")
        self.name = bytes(raw_name).split(b"\0", 1)[0].decode(errors="replace")
        self.uuid = _uuid(drv, self.cu_device)
        raw_bus = check(drv.cuDeviceGetPCIBusId(64, self.cu_device), "cuDeviceGetPCIBusId")
        self.pci_bus_id = bytes(raw_bus).split(b"\0", 1)[0].decode(errors="replace")
        attr = drv.CUdevice_attribute
        major = check(
            drv.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.cu_device
            ),
            "cuDeviceGetAttribute",
        )
        minor = check(
            drv.cuDeviceGetAttribute(
                attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.cu_device
            ),
            "cuDeviceGetAttribute",
        )
        self.compute_capability = (int(major), int(minor))
        self.total_memory = int(check(drv.cuDeviceTotalMem(self.cu_device), "cuDeviceTotalMem"))
        self.memory_pools = bool(
            check(
                drv.cuDeviceGetAttribute(
                    attr.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, self.cu_device
                ),
                "cuDeviceGetAttribute",
            )
        )
        self.ctx = check(drv.cuDevicePrimaryCtxRetain(self.cu_device), "cuDevicePrimaryCtxRetain")
        self._released = False
        self.events = EventPool(self)
        self.default_info = MemoryInfo(
            "Cuda", MemoryDevice(DeviceType.GPU, MemoryType.DEFAULT, NVIDIA_VENDOR_ID, ordinal), 256
        )
        self.pinned_info = MemoryInfo(
            "CudaPinned",
            MemoryDevice(DeviceType.GPU, MemoryType.HOST_ACCESSIBLE, NVIDIA_VENDOR_ID, ordinal),
            256,
        )
        self._lock = threading.Lock()
        self._helper: Any = None  # a non-blocking stream for allocations made without a stream
        self._side: Any = None  # the pageable-copy worker's stream
        self._gate_base = 0
        self._gate_free: list[int] = []
        self._local = threading.local()
        self._copy_streams: list[tuple[Any, Any]] = []
        self.freer: Freer | None = None
        """Where frees that synchronise the device run (the factory's free thread)."""

    @property
    def hardware(self) -> HardwareDevice:
        """This GPU as an :class:`aioep.HardwareDevice` (name, UUID, PCI bus id in metadata)."""
        return HardwareDevice(
            DeviceType.GPU,
            NVIDIA_VENDOR_ID,
            self.ordinal,
            "NVIDIA",
            {
                "name": self.name,
                "uuid": self.uuid,
                "pci_bus_id": self.pci_bus_id,
                "compute_capability": f"{self.compute_capability[0]}.{self.compute_capability[1]}",
                "total_memory": str(self.total_memory),
            },
        )

    def new_stream(self) -> Any:
        """A new non-blocking ``CUstream`` on this device."""
        drv = driver()
        with ctx_current(self.ctx):
            return check(
                drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate"
            )

    def helper_stream(self) -> Any:
        """The device's helper stream (allocations and frees made without a stream)."""
        with self._lock:
            if self._helper is None:
                self._helper = self.new_stream()
            return self._helper

    def side_stream(self) -> Any:
        """The stream the pageable-copy worker uses on this device."""
        with self._lock:
            if self._side is None:
                self._side = self.new_stream()
            return self._side

    def copy_stream(self) -> tuple[Any, Any]:
        """This thread's (stream, blocking-sync event) for copies made without a stream."""
        pair = getattr(self._local, "pair", None)
        if pair is None:
            drv = driver()
            stream = self.new_stream()
            flags = (
                drv.CUevent_flags.CU_EVENT_DISABLE_TIMING | drv.CUevent_flags.CU_EVENT_BLOCKING_SYNC
            )
            with ctx_current(self.ctx):
                event = check(drv.cuEventCreate(flags), "cuEventCreate")
            pair = (stream, event)
            self._local.pair = pair
            with self._lock:
                self._copy_streams.append(pair)
        return pair

    def gate_slot(self) -> int | None:
        """A device address of a 4-byte gate word, or None when all are taken.

        The words are not cleared here: a synchronous ``cuMemsetD32`` runs on the legacy
        default stream, which waits for every blocking stream of the context (another
        library's work), on the caller's thread, the event loop. Each stream clears its
        word in its own order before its first wait (``cuMemsetD32Async``).
        """
        drv = driver()
        with self._lock:
            if not self._gate_base:
                with ctx_current(self.ctx):
                    base = check(drv.cuMemAlloc(4 * _GATE_SLOTS), "cuMemAlloc(gate words)")
                self._gate_base = int(base)
                self._gate_free = [self._gate_base + 4 * i for i in range(_GATE_SLOTS)]
            return self._gate_free.pop() if self._gate_free else None

    def release_gate_slot(self, addr: int) -> None:
        """Give a gate word back (its stream closed and is past every wait on it)."""
        with self._lock:
            self._gate_free.append(addr)

    def free_later(self, job: Any) -> None:
        """Run ``job`` (``cuMemFree`` / ``cuMemFreeHost``) on the free thread, or inline
        when there is none (a device used on its own, or after the factory closed)."""
        freer = self.freer
        if freer is None:
            job()
        else:
            freer.submit(job)

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes from ``cuMemGetInfo``; (-1, total) if the query fails."""
        drv = driver()
        try:
            with ctx_current(self.ctx):
                free, total = check(drv.cuMemGetInfo(), "cuMemGetInfo")
            return int(free), int(total)
        except DeviceError:
            return -1, self.total_memory

    def close(self) -> None:
        """Destroy helper streams and events, then release the primary context; idempotent."""
        if self._released:
            return
        self._released = True
        drv = driver()
        try:
            with ctx_current(self.ctx):
                call_nogil("cuCtxSynchronize")
                for stream in (self._helper, self._side):
                    if stream is not None:
                        drv.cuStreamDestroy(stream)
                for stream, event in self._copy_streams:
                    drv.cuEventDestroy(event)
                    drv.cuStreamDestroy(stream)
                if self._gate_base:
                    drv.cuMemFree(self._gate_base)
            self.events.close()
        finally:
            self._helper = self._side = None
            self._copy_streams.clear()
            self._gate_base = 0
            drv.cuDevicePrimaryCtxRelease(self.cu_device)

    def __repr__(self) -> str:
        return f"<CudaDevice {self.ordinal} {self.name!r}>"


def _uuid(drv: Any, dev: Any) -> str:
    fn = getattr(drv, "cuDeviceGetUuid_v2", None) or drv.cuDeviceGetUuid
    uuid = check(fn(dev), "cuDeviceGetUuid")
    raw = bytes(uuid.bytes)
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
