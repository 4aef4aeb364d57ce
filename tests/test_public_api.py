"""The public surface: ``aioep.__all__`` is exactly what the package exports."""

from __future__ import annotations

import types

import aioep
import aioep.abc


def _public_names(module: types.ModuleType) -> set[str]:
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }


def test_all_matches_exports() -> None:
    assert len(aioep.__all__) == len(set(aioep.__all__))
    assert set(aioep.__all__) == _public_names(aioep)
    for name in aioep.__all__:
        assert getattr(aioep, name) is not None


def test_core_names_are_public() -> None:
    for name in [
        "Environment", "EpDevice", "EpFactory", "Tensor", "Buffer", "Allocator", "CopyFuture",
        "SyncStream", "Notification", "MemoryInfo", "MemoryDevice", "HardwareDevice",
        "DeviceType", "MemoryType", "AllocatorType", "EpError", "ErrorCode", "InvalidArgument",
        "NoSuchFile", "NotImplementedByEp", "InUseError", "DeviceError", "ClosedError",
        "copy_tensors", "current_environment",
    ]:  # fmt: skip
        assert name in aioep.__all__, name


def test_abc_module() -> None:
    assert set(aioep.abc.__all__) == _public_names(aioep.abc)
    assert {"DataTransfer", "EpFactory", "Allocator", "StreamImpl"} <= set(aioep.abc.__all__)
    assert aioep.abc.EpFactory is aioep.EpFactory


def test_public_classes_live_in_private_modules() -> None:
    for name in aioep.__all__:
        obj = getattr(aioep, name)
        module = getattr(obj, "__module__", "aioep")
        assert module == "aioep" or module.startswith("aioep._"), (name, module)
