"""The ``ort`` backend's factory: real ONNX Runtime plugin EP libraries as aioep devices."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from aioep import (
    ClosedError,
    DeviceType,
    EpDevice,
    HardwareDevice,
    InvalidArgument,
    MemoryDevice,
    MemoryInfo,
    MemoryType,
    NotImplementedByEp,
)
from aioep.abc import (
    Allocator,
    DataTransfer,
    EpFactory,
    FactoryOptions,
    StreamImpl,
    parse_bool_option,
    parse_float_option,
    parse_int_option,
    reject_unknown_options,
)

from ._binding import DeviceIO
from ._memory import AddressMap, OrtAllocator
from ._ort import ort, translate
from ._registry import Registration, acquire, release
from ._stream import OrtStream
from ._transfer import CallPacer, OrtDataTransfer

if TYPE_CHECKING:
    from aioep import Tensor

__all__ = ["OrtFactory", "OrtOptions", "OrtPluginDevice"]

DEFAULT_CHUNK_MS = 8.0
_SEMVER = re.compile(r"^\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$")
_HW_TYPES = {"CPU": DeviceType.CPU, "GPU": DeviceType.GPU, "NPU": DeviceType.NPU}
_OWNER = "ort backend"
_KNOWN = (
    "library_path",
    "registration_name",
    "libraries",
    "chunk_bytes",
    "chunk_ms",
    "device_check",
)


@dataclass(frozen=True)
class OrtOptions:
    """The ``ort`` backend's options (see the README)."""

    libraries: tuple[tuple[str, str], ...] = ()
    """(registration name, library path) pairs, in order."""
    chunk_bytes: int | None = None
    """Fixed size of ORT copy calls and of the segments of buffers with opaque handles
    (``0``: one call and one OrtValue per tensor); ``None`` (``"auto"``): sized by time."""
    chunk_ms: float = DEFAULT_CHUNK_MS
    """With ``chunk_bytes`` auto: how long one ORT copy call may hold the GIL (target)."""
    device_check: bool = True
    """Before the first allocation, check that the library can create its device."""

    @classmethod
    def from_options(cls, options: FactoryOptions | None) -> OrtOptions:
        """Validate a backend options mapping.

        Raises:
            InvalidArgument: an unknown key or a bad value.
        """
        reject_unknown_options(_OWNER, options, _KNOWN)
        opts = dict(options or {})
        libs: list[tuple[str, str]] = []
        spec = opts.get("libraries", "")
        if not isinstance(spec, str):
            raise InvalidArgument(
                f"ort backend: libraries must be a 'name=path;name2=path2' string, got {spec!r}"
            )
        for item in filter(None, (s.strip() for s in spec.split(";"))):
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise InvalidArgument(f"ort backend: libraries entry {item!r} is not 'name=path'")
            libs.append((name.strip(), path.strip()))
        lib_path = opts.get("library_path")
        if lib_path is not None:
            if not isinstance(lib_path, str) or not lib_path:
                raise InvalidArgument(f"ort backend: library_path must be a path, got {lib_path!r}")
            reg_name = (
                opts.get("registration_name") or os.path.splitext(os.path.basename(lib_path))[0]
            )
            if not isinstance(reg_name, str):
                raise InvalidArgument(
                    f"ort backend: registration_name must be a str, got {reg_name!r}"
                )
            libs.append((reg_name, lib_path))
        elif "registration_name" in opts:
            raise InvalidArgument("ort backend: registration_name needs library_path")
        names = [n for n, _ in libs]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"ort backend: duplicate library names in {names}")
        for name, path in libs:
            if not os.path.isfile(path):
                raise InvalidArgument(
                    f"ort backend: plugin library {path!r} (for {name!r}) does not exist"
                )
        chunk: int | None = None
        raw_chunk = opts.get("chunk_bytes", "auto")
        if not (isinstance(raw_chunk, str) and raw_chunk.strip() == "auto"):
            chunk = parse_int_option(_OWNER, "chunk_bytes", raw_chunk, minimum=0)
            if chunk != 0 and chunk < 4096:
                raise InvalidArgument(
                    "ort backend option 'chunk_bytes' must be 'auto', 0 (no chunking) or an "
                    f"integer >= 4096, got {raw_chunk!r}"
                )
        ms = parse_float_option(
            _OWNER, "chunk_ms", opts.get("chunk_ms", DEFAULT_CHUNK_MS), minimum=0.5, maximum=1000
        )
        check = parse_bool_option(_OWNER, "device_check", opts.get("device_check", True))
        return cls(tuple(libs), chunk, ms, check)


def _no_segments() -> int:
    return 0


class OrtPluginDevice(EpDevice):
    """An aioep `EpDevice` for one ORT ``OrtEpDevice``; names and metadata are ORT's."""

    __slots__ = ("_ep_name", "_ep_vendor", "index", "registration_name")

    def __init__(
        self,
        factory: OrtFactory,
        hardware: HardwareDevice,
        *,
        index: int,
        registration_name: str,
        ep_name: str,
        ep_vendor: str,
        memory_infos: Mapping[MemoryType, MemoryInfo],
        ep_metadata: Mapping[str, str],
        ep_options: Mapping[str, str],
    ) -> None:
        metadata = dict(ep_metadata)
        version = metadata.pop("version", None)  # the core fills it from the factory otherwise
        super().__init__(
            factory,
            hardware,
            memory_infos=memory_infos,
            ep_metadata=metadata,
            ep_options=ep_options,
        )
        if version is not None:
            self.ep_metadata = MappingProxyType({**self.ep_metadata, "version": version})
        self._ep_name = ep_name
        self._ep_vendor = ep_vendor
        self.index = index
        self.registration_name = registration_name

    @property
    def ep_name(self) -> str:
        """The EP name the library reports (e.g. ``"WebGpuExecutionProvider"``)."""
        return self._ep_name

    @property
    def ep_vendor(self) -> str:
        """The EP vendor the library reports."""
        return self._ep_vendor

    @property
    def ort_device(self) -> Any:
        """The ``onnxruntime.OrtEpDevice`` (for ORT sessions) while the library is registered.

        Raises:
            ClosedError: the library was unregistered (ORT objects from before are invalid).
        """
        factory = self.factory
        assert isinstance(factory, OrtFactory)
        return factory._ort_device(self.index)


class OrtFactory(EpFactory):
    """Registers ORT plugin EP libraries with onnxruntime and offers their devices.

    Options (validated): ``library_path`` and ``registration_name`` (what
    ``env.register_library(name, "/path/lib.so")`` passes), ``libraries``
    (``"name=path;name2=path2"`` for config), ``chunk_bytes``, ``chunk_ms`` and
    ``device_check``. With no library it offers nothing and imports nothing.
    """

    name = "ort"
    vendor = "onnxruntime"
    vendor_id = 0
    version = "0.1.0"

    def __init__(self, options: FactoryOptions | None = None) -> None:
        self.options = OrtOptions.from_options(options)
        self._lock = threading.Lock()
        self._closed = False
        self._map = AddressMap()
        self.pacer = CallPacer(self.options.chunk_ms / 1e3, self.options.chunk_bytes)
        """Sizes copy calls and new buffers' segments (shared by the allocators and transfer)."""
        self._registrations: list[Registration] = []
        # Per ORT device (flattened over libraries): (registration, index in it, aioep device).
        self._entries: list[tuple[Registration, int]] = []
        self._devices: list[OrtPluginDevice] = []
        self._ort_memory: dict[MemoryDevice, tuple[Any, int]] = {}  # -> (OrtMemoryInfo, device)
        self._streams_supported: dict[int, bool] = {}
        self._streams: set[OrtStream] = set()
        # The newest allocator per memory (adopts session outputs), and the data transfer.
        self._allocators: dict[MemoryDevice, OrtAllocator] = {}
        self._io_allocators: dict[MemoryDevice, OrtAllocator] = {}
        self._transfer: OrtDataTransfer | None = None
        if not self.options.libraries:
            return
        try:
            for reg_name, path in self.options.libraries:
                self._registrations.append(acquire(reg_name, path))
            self._build_devices()
        except BaseException:
            self.close()
            raise

    # -- devices -----------------------------------------------------------------------------
    def _build_devices(self) -> None:
        rt = ort()
        names: list[str] = []
        for reg in self._registrations:
            for i, od in enumerate(reg.devices):
                index = len(self._entries)
                self._entries.append((reg, i))
                hw = od.device
                hw_type = _HW_TYPES.get(getattr(hw.type, "name", str(hw.type)), DeviceType.GPU)
                hardware = HardwareDevice(
                    hw_type, int(hw.vendor_id), int(hw.device_id), str(hw.vendor), dict(hw.metadata)
                )
                infos: dict[MemoryType, MemoryInfo] = {}
                for mem_type, ort_type in _memory_types(rt, od):
                    omi = od.memory_info(ort_type)
                    if omi is None:
                        continue
                    info = _memory_info(omi, mem_type, hw_type)
                    infos[mem_type] = info
                    self._ort_memory.setdefault(info.device, (omi, index))
                self._devices.append(
                    OrtPluginDevice(
                        self,
                        hardware,
                        index=index,
                        registration_name=reg.name,
                        ep_name=str(od.ep_name),
                        ep_vendor=str(od.ep_vendor),
                        memory_infos=infos,
                        ep_metadata={str(k): str(v) for k, v in dict(od.ep_metadata).items()},
                        ep_options={str(k): str(v) for k, v in dict(od.ep_options).items()},
                    )
                )
                names.append(str(od.ep_name))
        unique = sorted(set(names))
        if len(unique) == 1:
            self.name = unique[0]
        elif unique:
            self.name = "ort[" + ",".join(unique) + "]"
        if self._devices:
            self.vendor = self._devices[0].ep_vendor
            self.vendor_id = self._devices[0].hardware.vendor_id
        version = str(getattr(rt, "__version__", ""))
        self.version = version if _SEMVER.match(version) else "0.1.0"
        if not self._devices:
            libs = ", ".join(f"{r.name}={r.path}" for r in self._registrations)
            self.unavailable_reason = f"ORT plugin libraries ({libs}) offer no EP device"

    def _ort_device(self, index: int) -> Any:
        with self._lock:
            if self._closed:
                raise ClosedError(f"{self!r} is closed: its ORT library was unregistered")
            reg, i = self._entries[index]
            return reg.devices[i]

    def get_supported_devices(self, hardware: Sequence[HardwareDevice]) -> list[EpDevice]:
        return list(self._devices)

    # -- memory ------------------------------------------------------------------------------
    def create_allocator(
        self, memory_info: MemoryInfo, options: FactoryOptions | None
    ) -> Allocator:
        if options:
            raise InvalidArgument(
                f"ort allocator for {memory_info.name!r}: unknown option(s) {sorted(options)} "
                "(ORT's arena settings go in 'arena.*' keys with AllocatorType.ARENA)"
            )
        allocator = self._new_allocator(memory_info, whole=False)
        with self._lock:
            self._allocators[memory_info.device] = allocator
        return allocator

    def _new_allocator(self, memory_info: MemoryInfo, *, whole: bool) -> OrtAllocator:
        """An allocator of ``memory_info``; ``whole``: every buffer one OrtValue."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"{self!r} is closed")
            found = self._ort_memory.get(memory_info.device)
        if found is None:
            raise InvalidArgument(f"{self!r} has no memory {memory_info!r}")
        omi, index = found
        reg, i = self._entries[index]
        segment_bytes = self.pacer.segment_bytes
        if whole or memory_info.memory_type is MemoryType.HOST_ACCESSIBLE:
            segment_bytes = _no_segments  # real host addresses: one OrtValue per buffer
        return OrtAllocator(
            memory_info,
            omi,
            reg,
            i,
            self._map,
            segment_bytes,
            device_check=self.options.device_check,
        )

    def _io_allocator(self, memory_info: MemoryInfo) -> OrtAllocator:
        """The factory's allocator of ``memory_info`` whose buffers are one OrtValue each
        (session I/O, bound to ORT sessions by handle)."""
        with self._lock:
            allocator = self._io_allocators.get(memory_info.device)
            if allocator is not None:
                return allocator
        made = self._new_allocator(memory_info, whole=True)
        with self._lock:
            return self._io_allocators.setdefault(memory_info.device, made)

    def _output_allocator(self, memory_info: MemoryInfo) -> OrtAllocator:
        """The allocator that adopts session outputs in ``memory_info``: the newest one
        created for it that is still open, else a new one of the factory's own."""
        with self._lock:
            allocator = self._allocators.get(memory_info.device)
        if allocator is not None and not allocator.closed:
            return allocator
        made = self.create_allocator(memory_info, None)
        assert isinstance(made, OrtAllocator)
        return made

    def create_data_transfer(self) -> DataTransfer | None:
        device_memory = {d for d in self._ort_memory if not d.is_host_accessible}
        if not device_memory:
            return None  # nothing the host cannot read: no data transfer needed
        self._transfer = OrtDataTransfer(
            set(self._ort_memory), self._map, self.pacer, self._owns_stream
        )
        return self._transfer

    def segment_bytes(self, tensor: Tensor) -> int:
        """The segment size of the device buffer behind ``tensor`` (its whole size where the
        buffer is one OrtValue): a copy into part of a segment reads and rewrites it whole.

        Raises:
            InvalidArgument: the tensor is not live device memory of this factory.
        """
        return self._map.find(tensor.data_ptr, tensor.nbytes).segment_bytes

    # -- streams -----------------------------------------------------------------------------
    def is_stream_aware(self) -> bool:
        return any(self._supports_streams(i) for i in range(len(self._devices)))

    def _supports_streams(self, index: int) -> bool:
        if index not in self._streams_supported:
            if self._devices[index].memory_info(MemoryType.DEFAULT) is None:
                self._streams_supported[index] = False
            else:
                try:
                    stream = self._ort_device(index).create_sync_stream()
                except Exception:
                    self._streams_supported[index] = False
                else:
                    del stream
                    self._streams_supported[index] = True
        return self._streams_supported[index]

    def create_sync_stream(
        self, memory_device: MemoryDevice, options: Mapping[str, Any] | None
    ) -> StreamImpl:
        reject_unknown_options("ort stream", options, ())
        found = self._ort_memory.get(memory_device)
        if found is None:
            raise InvalidArgument(f"{self!r} has no memory {memory_device}")
        index = found[1]
        device = self._ort_device(index)
        try:
            ort_stream = device.create_sync_stream()
        except Exception as exc:
            error = translate(exc, f"{self._devices[index].ep_name} create_sync_stream")
            if "does not support streams" in str(exc):
                error = NotImplementedByEp(
                    f"The execution provider {self._devices[index].ep_name!r} does not support "
                    f"streams (ORT: {exc})"
                )
            raise error from exc
        reg = self._entries[index][0]
        stream = OrtStream(ort_stream, reg, f"ort-stream-{reg.name}-{index}")
        self._streams.add(stream)
        return stream

    def _owns_stream(self, stream: StreamImpl) -> bool:
        return isinstance(stream, OrtStream) and stream in self._streams

    # -- EPs ---------------------------------------------------------------------------------
    def create_ep(self, ep_devices: Sequence[EpDevice], options: Mapping[str, Any] | None) -> Any:
        """An EP that delegates its node groups to onnxruntime sessions with the plugin EP
        selected (``add_provider_for_devices``); see ``_ep.py``."""
        from ._ep import OrtPluginEp

        devs = [d for d in ep_devices if isinstance(d, OrtPluginDevice)]
        names = sorted({d.ep_name for d in devs})
        if len(devs) != len(ep_devices) or len(names) != 1:
            raise InvalidArgument(
                f"ort backend: create_ep needs devices of one plugin EP, got {list(ep_devices)}"
            )

        def check() -> None:
            for d in devs:
                reg, i = self._entries[d.index]
                reg.check_device(i)

        registrations = list({id(r): r for r in (self._entries[d.index][0] for d in devs)}.values())
        device_io = None
        info = devs[0].memory_info(MemoryType.DEFAULT)
        if info is not None and not info.device.is_host_accessible:
            omi = self._ort_memory[info.device][0]
            device_io = DeviceIO(
                info,
                omi,
                self._map,
                lambda: self._output_allocator(info),
                lambda: self._io_allocator(info),
                lambda: self._transfer,
            )
        return OrtPluginEp(
            names[0],
            [d.ort_device for d in devs],
            options,
            check=check,
            registrations=registrations,
            device_io=device_io,
        )

    def close(self) -> None:
        """Drop every ORT object and release the libraries (ORT unregisters each one once
        its last OrtValue and last user are gone)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            registrations, self._registrations = self._registrations, []
            self._ort_memory.clear()
            self._streams.clear()
            self._allocators.clear()
            self._io_allocators.clear()
        for reg in registrations:
            release(reg)

    def __repr__(self) -> str:
        libs = ",".join(n for n, _ in self.options.libraries)
        return f"<OrtFactory {self.name!r} libraries=[{libs}]>"


def _memory_types(rt: Any, ort_device: Any) -> list[tuple[MemoryType, Any]]:
    """The memory types to ask an ``OrtEpDevice`` about. onnxruntime 1.23 (the lowest
    supported) gives Python neither ``OrtDeviceMemoryType`` nor ``OrtEpDevice.memory_info``:
    there a plugin EP's device offers no memory of its own, and its sessions take and give
    host memory (ORT copies inside the run), as with ORT's own Python API of that version."""
    types = getattr(rt, "OrtDeviceMemoryType", None)
    if types is None or not hasattr(ort_device, "memory_info"):
        return []
    return [
        (MemoryType.DEFAULT, types.DEFAULT),
        (MemoryType.HOST_ACCESSIBLE, types.HOST_ACCESSIBLE),
    ]


def _memory_info(omi: Any, mem_type: MemoryType, hw_type: DeviceType) -> MemoryInfo:
    """An aioep MemoryInfo for an ORT OrtMemoryInfo.

    ORT's binding does not expose the memory's device type or alignment. DEFAULT
    memory of a plugin EP is device memory (never read by the host): its type is
    the hardware's, or GPU where the hardware is listed as a CPU (WebGPU on a
    software adapter). HOST_ACCESSIBLE memory keeps the hardware's type.
    """
    if mem_type is MemoryType.DEFAULT and hw_type is DeviceType.CPU:
        device_type = DeviceType.GPU
    else:
        device_type = hw_type
    device = MemoryDevice(device_type, mem_type, int(omi.device_vendor_id), int(omi.device_id))
    from aioep import AllocatorType

    kind = getattr(omi.allocator_type, "name", "")
    allocator_type = AllocatorType.ARENA if "ARENA" in kind else AllocatorType.DEVICE
    return MemoryInfo(str(omi.name), device, allocator_type=allocator_type)
