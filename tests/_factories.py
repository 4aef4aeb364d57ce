"""Small EpFactory implementations used by the core tests (importable as ``tests._factories``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aioep
from aioep._base.types import HOST_MEMORY_DEVICE
from aioep._environment.host import HostAllocator
from aioep.abc import Allocator, CopyPair, DataTransfer, EpFactory, StreamImpl, ThreadStream

MakeEnv = Callable[..., Awaitable[aioep.Environment]]
"""The ``make_env`` fixture (conftest.py): ``await make_env(**sim_options)`` opens an
environment with the sim backend registered."""

FAKE_VENDOR_ID = 0xBE57
FAKE_DEVICE = aioep.MemoryDevice(aioep.DeviceType.GPU, aioep.MemoryType.DEFAULT, FAKE_VENDOR_ID, 0)
FAKE_INFO = aioep.MemoryInfo("FakeGpu", FAKE_DEVICE)

# Every close, in order, across all factories of a test: ("stream"|"transfer"|..., name).
EVENTS: list[tuple[str, str]] = []


class RecordingAllocator(HostAllocator):
    """Host memory that pretends to live on the fake GPU; records when it closes."""

    def __init__(self, memory_info: aioep.MemoryInfo, owner: str) -> None:
        super().__init__(memory_info)
        self._owner_name = owner

    def _close(self) -> None:
        EVENTS.append(("allocator", self._owner_name))


class RecordingTransfer(DataTransfer):
    """Copies between the fake GPU and the host with memmove (like ORT's example EP)."""

    def __init__(self, owner: str) -> None:
        self._owner_name = owner
        self.calls = 0

    def can_copy(self, src: aioep.MemoryDevice, dst: aioep.MemoryDevice) -> bool:
        ends = {src, dst}
        return FAKE_DEVICE in ends and ends <= {FAKE_DEVICE, HOST_MEMORY_DEVICE}

    def can_use_stream(self, stream: StreamImpl) -> bool:
        return isinstance(stream, ThreadStream)

    def copy_tensors(self, pairs: Sequence[CopyPair], stream: StreamImpl | None) -> None:
        import ctypes

        self.calls += 1

        def run() -> None:
            for s, d in pairs:
                ctypes.memmove(d.data_ptr, s.data_ptr, s.nbytes)

        if stream is None:
            run()
        else:
            assert isinstance(stream, ThreadStream)
            stream.enqueue(run)

    def close(self) -> None:
        EVENTS.append(("transfer", self._owner_name))


class RecordingStream(ThreadStream):
    def __init__(self, owner: str) -> None:
        super().__init__(f"fake-stream-{owner}")
        self._owner_name = owner

    def close(self) -> None:
        super().close()
        EVENTS.append(("stream", self._owner_name))


class FakeGpuFactory(EpFactory):
    """A fake GPU backend (vendor 0xBE57) whose closes are recorded in ``EVENTS``.

    Options: ``tag`` (str) goes into the EP options; ``fail`` ("1") makes the constructor raise.
    """

    name = "FakeGpuExecutionProvider"
    vendor = "Contoso"
    vendor_id = FAKE_VENDOR_ID
    version = "0.1.0"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        opts = dict(options or {})
        self.tag = str(opts.pop("tag", "none"))
        if opts:
            raise aioep.InvalidArgument(f"fake backend: unknown option(s) {sorted(opts)}")
        self.closed = False
        self.hardware = aioep.HardwareDevice(
            aioep.DeviceType.GPU, FAKE_VENDOR_ID, 0, "Contoso", {"is_virtual": "1"}
        )

    def get_supported_devices(
        self, hardware: Sequence[aioep.HardwareDevice]
    ) -> list[aioep.EpDevice]:
        return [
            aioep.EpDevice(
                self,
                self.hardware,
                memory_infos={aioep.MemoryType.DEFAULT: FAKE_INFO},
                ep_metadata={"supported_devices": "CrackGriffin 7+"},
                ep_options={"tag": self.tag},
            )
        ]

    def create_allocator(
        self, memory_info: aioep.MemoryInfo, options: Mapping[str, Any] | None
    ) -> Allocator:
        return RecordingAllocator(memory_info, self.tag)

    def create_data_transfer(self) -> DataTransfer:
        return RecordingTransfer(self.tag)

    def is_stream_aware(self) -> bool:
        return True

    def create_sync_stream(
        self, memory_device: aioep.MemoryDevice, options: Mapping[str, Any] | None
    ) -> StreamImpl:
        return RecordingStream(self.tag)

    def close(self) -> None:
        self.closed = True
        EVENTS.append(("factory", self.tag))


class BrokenFactory(EpFactory):
    """A backend whose constructor really fails (as when its driver is missing)."""

    name = "BrokenExecutionProvider"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        raise RuntimeError("libbroken.so.1: cannot open shared object file")

    def get_supported_devices(
        self, hardware: Sequence[aioep.HardwareDevice]
    ) -> list[aioep.EpDevice]:  # pragma: no cover - never constructed
        return []

    def create_allocator(
        self, memory_info: aioep.MemoryInfo, options: Mapping[str, Any] | None
    ) -> Allocator:  # pragma: no cover
        raise NotImplementedError


class NoDeviceFactory(EpFactory):
    """Starts, finds no device, says why."""

    name = "NoDeviceExecutionProvider"
    unavailable_reason = "no NoDevice hardware found"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        pass

    def get_supported_devices(
        self, hardware: Sequence[aioep.HardwareDevice]
    ) -> list[aioep.EpDevice]:
        return []

    def create_allocator(
        self, memory_info: aioep.MemoryInfo, options: Mapping[str, Any] | None
    ) -> Allocator:  # pragma: no cover
        raise NotImplementedError


class BadDevicesFactory(FakeGpuFactory):
    """Offers its devices but fails to create its data transfer: registration must roll back."""

    name = "BadDevicesExecutionProvider"

    def create_data_transfer(self) -> DataTransfer:
        raise OSError("transfer engine unavailable")
