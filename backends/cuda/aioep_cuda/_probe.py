"""What CUDA driver and GPUs this process sees: `describe_driver` and `GpuFacts`.

The GPU check (``python -m aioep check-gpu``, whose harness lives in an aioep checkout's
``tools/check_gpu``) runs `describe_driver` in a child process of its own; `CudaDevice`
reads its GPU's facts here too. Nothing here makes a context: these queries never wait
for the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._driver import check, load_driver

__all__ = ["GpuFacts", "describe_driver"]


@dataclass(frozen=True)
class GpuFacts:
    """One GPU as the driver describes it (no context needed)."""

    ordinal: int
    name: str
    uuid: str
    pci_bus_id: str
    compute_capability: tuple[int, int]
    total_memory: int
    memory_pools: bool
    """Whether the device supports stream-ordered memory pools (``cuMemAllocAsync``)."""

    @classmethod
    def read(cls, drv: Any, ordinal: int) -> GpuFacts:
        """Query the driver module ``drv`` (after ``cuInit``) about GPU ``ordinal``."""
        dev = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
        raw_name = check(drv.cuDeviceGetName(256, dev), "cuDeviceGetName")
        raw_bus = check(drv.cuDeviceGetPCIBusId(64, dev), "cuDeviceGetPCIBusId")
        attr = drv.CUdevice_attribute

        def attribute(which: Any) -> int:
            return int(check(drv.cuDeviceGetAttribute(which, dev), "cuDeviceGetAttribute"))

        return cls(
            ordinal=ordinal,
            name=_text(raw_name),
            uuid=_uuid(drv, dev),
            pci_bus_id=_text(raw_bus),
            compute_capability=(
                attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            ),
            total_memory=int(check(drv.cuDeviceTotalMem(dev), "cuDeviceTotalMem")),
            memory_pools=bool(attribute(attr.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)),
        )

    def metadata(self) -> dict[str, str]:
        """The GPU's hardware-device metadata (name, UUID, PCI bus id, compute capability,
        total memory)."""
        major, minor = self.compute_capability
        return {
            "name": self.name,
            "uuid": self.uuid,
            "pci_bus_id": self.pci_bus_id,
            "compute_capability": f"{major}.{minor}",
            "total_memory": str(self.total_memory),
        }


def _text(raw: Any) -> str:
    return bytes(raw).split(b"\0", 1)[0].decode(errors="replace")


def _uuid(drv: Any, dev: Any) -> str:
    fn = getattr(drv, "cuDeviceGetUuid_v2", None) or drv.cuDeviceGetUuid
    uuid = check(fn(dev), "cuDeviceGetUuid")
    h = bytes(uuid.bytes).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _driver_library() -> str | None:
    """The path of the ``libcuda.so`` this process loaded (Linux), or None."""
    try:
        with open("/proc/self/maps") as maps:
            libs = sorted({line.split()[-1] for line in maps if "/libcuda.so" in line})
    except OSError:
        return None
    return libs[0] if libs else None


def describe_driver() -> dict[str, Any]:
    """The driver and GPUs this process sees, JSON-able: ``bindings_version``,
    ``driver_version`` (``cuDriverGetVersion``: 13000 for CUDA 13.0), ``device_count``,
    ``devices`` (each GPU's metadata, with its ``ordinal``), ``library`` (the driver
    library's path) and, where the driver could not be loaded or queried, ``error``.
    Loads the driver (``cuInit``): call it in a process that may."""
    out: dict[str, Any] = {}
    try:
        import cuda.bindings

        out["bindings_version"] = getattr(cuda.bindings, "__version__", None)
        drv = load_driver()
        out["driver_version"] = int(check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
        out["device_count"] = int(check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
        out["devices"] = [
            {"ordinal": i, **GpuFacts.read(drv, i).metadata()} for i in range(out["device_count"])
        ]
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["library"] = _driver_library()
    return out
