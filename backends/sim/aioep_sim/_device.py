"""One simulated accelerator: its memory, its copy engines and its health."""

from __future__ import annotations

import collections
import threading
import time
from typing import NamedTuple, Protocol

from aioep import DeviceError, DeviceType, HardwareDevice, MemoryDevice, MemoryInfo, MemoryType

from ._memory import DEVICE_ALIGNMENT, DeviceMemory
from ._options import SimOptions

__all__ = ["SIM_VENDOR", "SIM_VENDOR_ID", "EngineUse", "SimDevice", "SimDevices"]

SIM_VENDOR_ID = 0x5151
SIM_VENDOR = "aioep-sim"
ENGINES = ("h2d", "d2h", "d2d")


class EngineUse(NamedTuple):
    """One bandwidth-throttled copy as a copy engine saw it (times from ``time.perf_counter``)."""

    engine: str
    """``"h2d"``, ``"d2h"`` or ``"d2d"``."""
    nbytes: int
    """Bytes copied."""
    start: float
    """When the copy took the engine."""
    end: float
    """When it let the engine go."""


class SimDevices(Protocol):
    """What finds the sim device that owns a memory (`SimFactory` is one): the EP reads and
    writes tensors through it."""

    def device(self, memory: MemoryInfo | MemoryDevice) -> SimDevice:
        """The sim device that owns this memory."""
        ...


_new_use = tuple.__new__  # an EngineUse without its generated __new__'s Python frame


class SimDevice:
    """A simulated GPU: private DEFAULT memory, pinned host memory and three copy engines.

    A real GPU has one copy engine per direction (host-to-device and
    device-to-host) plus on-device copies; with ``bandwidth_gbps`` set, a copy
    holds its engine for ``nbytes / bandwidth`` seconds, so copies in
    opposite directions overlap and copies in the same direction take turns.
    """

    def __init__(self, device_id: int, options: SimOptions) -> None:
        self.device_id = device_id
        self.options = options
        self.memory = DeviceMemory(device_id, options.memory_bytes)
        self.hardware = HardwareDevice(
            DeviceType.GPU,
            SIM_VENDOR_ID,
            device_id,
            SIM_VENDOR,
            {
                "memory_bytes": str(options.memory_bytes),
                "bandwidth_gbps": str(options.bandwidth_gbps),
                "latency_us": str(options.latency_us),
            },
        )
        self.memory_info = MemoryInfo(
            "Sim",
            MemoryDevice(DeviceType.GPU, MemoryType.DEFAULT, SIM_VENDOR_ID, device_id),
            alignment=DEVICE_ALIGNMENT,
        )
        self.pinned_memory_info = MemoryInfo(
            "SimPinned",
            MemoryDevice(DeviceType.GPU, MemoryType.HOST_ACCESSIBLE, SIM_VENDOR_ID, device_id),
            alignment=64,
        )
        self.engines = {name: threading.Lock() for name in ENGINES}
        self.engine_log: collections.deque[EngineUse] = collections.deque(maxlen=4096)
        """The most recent bandwidth-throttled copies, for tests and benchmarks."""
        self._lock = threading.Lock()
        self.copies = 0
        """Copies started on this device (the count fault injection uses)."""
        self.lost_reason: str | None = None
        # Fault injection, read by every copy: copies past _lose_after lose the device, copy
        # _fail_at fails.
        self._lose_after = options.lose_device_after_copies
        fail = options.fail_after_copies
        self._fail_at = None if fail is None else fail + 1
        self._faults = self._lose_after is not None or self._fail_at is not None

    @property
    def lost(self) -> bool:
        """True once the device is lost (see ``lose_device_after_copies``)."""
        return self.lost_reason is not None

    def check_alive(self, what: str) -> None:
        """Raise DeviceError if the device is lost."""
        if self.lost_reason is not None:
            raise DeviceError(f"sim device {self.device_id}: cannot {what}: {self.lost_reason}")

    def begin_copy(self) -> int:
        """Count a copy about to run and apply fault injection; returns its number (from 1).

        Raises:
            DeviceError: the device is lost, or this copy is the one set to fail.
        """
        lock = self._lock
        lock.acquire()
        try:
            if self.lost_reason is not None:
                self.check_alive("copy")
            self.copies = n = self.copies + 1
            if self._faults and self._lose_after is not None and n > self._lose_after:
                self.lost_reason = (
                    f"device lost at copy {n} (lose_device_after_copies="
                    f"{self._lose_after}); all later work on it fails"
                )
                raise DeviceError(f"sim device {self.device_id}: {self.lost_reason}")
        finally:
            lock.release()
        if self._faults and n == self._fail_at:
            raise DeviceError(
                f"sim device {self.device_id}: injected failure of copy {n} "
                f"(fail_after_copies={self.options.fail_after_copies})"
            )
        return n

    def record_engine_use(self, engine: str, nbytes: int, start: float) -> None:
        """Note a throttled copy that held ``engine`` from ``start`` until now."""
        self.engine_log.append(_new_use(EngineUse, (engine, nbytes, start, time.perf_counter())))

    def __repr__(self) -> str:
        state = " lost" if self.lost else ""
        return f"<SimDevice {self.device_id}{state} in_use={self.memory.in_use}>"
