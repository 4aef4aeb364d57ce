"""Codes that other standards define, in one place: DLPack's device types and the PCI vendor
ids aioep's core knows by number."""

from __future__ import annotations

import enum

__all__ = ["NVIDIA_VENDOR_ID", "DLDeviceType"]

NVIDIA_VENDOR_ID = 0x10DE
"""NVIDIA's PCI vendor id: memory on a device of this vendor is CUDA memory to DLPack and the
CUDA Array Interface."""


class DLDeviceType(enum.IntEnum):
    """DLPack device type codes (``DLDeviceType`` in ``dlpack.h``), as ``__dlpack_device__``
    reports them."""

    CPU = 1
    CUDA = 2
    CUDA_HOST = 3
    OPENCL = 4
    VULKAN = 7
    METAL = 8
    VPI = 9
    ROCM = 10
    ROCM_HOST = 11
    EXT_DEV = 12
    """Reserved for extension devices; what aioep's own non-CUDA device tensors report."""
    CUDA_MANAGED = 13
    ONE_API = 14
    WEBGPU = 15
    HEXAGON = 16
    MAIA = 17
