"""Device-resident session I/O: aioep tensors bound to ORT's IOBinding, and ORT's outputs
adopted as aioep tensors.

An input in the plugin EP's memory is bound by its device address (or buffer handle)
with its shape and dtype: ORT reads it where it is, no copy. A host input is bound
as host memory and ORT uploads it once. Outputs are bound to the EP's device: ORT
allocates them with the plugin's allocator, and each comes back as an aioep tensor
over that very OrtValue (adopted by the factory's allocator, so it counts as a live
buffer of the library and is freed through ORT when the tensor goes).

A device tensor that is not one OrtValue from its first byte (a buffer with opaque
handles split into segments, or a view into one) cannot be bound by handle: ORT's
binding has no offsets into a WebGPU buffer. Such an input is copied once to the
host and bound from there (``DeviceIO.host_fallbacks`` counts these). The copies
a session makes of an EP's inputs never need that: they are allocated as one OrtValue
each (`DeviceIO.allocate`); ``chunk_bytes=0`` makes every buffer one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from aioep import DeviceType, InvalidArgument, MemoryInfo, Tensor

from ._memory import AddressMap
from ._ort import ort

if TYPE_CHECKING:
    from ._memory import OrtAllocator
    from ._transfer import OrtDataTransfer

__all__ = ["DeviceIO", "output_dtype"]

# ORT's OrtDevice::DeviceType values.
_ORT_DEVICE_TYPES = {DeviceType.CPU: 0, DeviceType.GPU: 1, DeviceType.FPGA: 2, DeviceType.NPU: 3}


class DeviceIO:
    """Binds one plugin EP's session inputs and outputs in its DEFAULT memory.

    Args:
        memory_info: the aioep memory info of the EP's device memory.
        ort_memory_info: ORT's ``OrtMemoryInfo`` for the same memory.
        address_map: the factory's live blocks (to find the OrtValue behind a tensor).
        allocator: returns the allocator that adopts outputs (the factory's, for this memory).
        io_allocator: returns an allocator of this memory whose buffers are one OrtValue each.
        transfer: the factory's data transfer (for the host fallback of unbindable inputs).
    """

    def __init__(
        self,
        memory_info: MemoryInfo,
        ort_memory_info: Any,
        address_map: AddressMap,
        allocator: Callable[[], OrtAllocator],
        io_allocator: Callable[[], OrtAllocator],
        transfer: Callable[[], OrtDataTransfer | None],
    ) -> None:
        self.memory_info = memory_info
        self._map = address_map
        self._allocator = allocator
        self._io_allocator = io_allocator
        self._transfer = transfer
        c = ort().capi._pybind_state
        self._device = c.OrtDevice(
            _ORT_DEVICE_TYPES.get(memory_info.device.device_type, 1),
            int(ort_memory_info.device_mem_type),
            int(ort_memory_info.device_vendor_id),
            int(ort_memory_info.device_id),
        )
        self._lock = threading.Lock()
        self.host_fallbacks = 0
        """Inputs copied to the host because no single OrtValue holds them from offset 0."""

    def bind_input(self, binding: Any, name: str, tensor: Tensor) -> Any:
        """Bind ``tensor`` as input ``name`` of ``binding`` (an ``onnxruntime.IOBinding``).

        Returns what must stay alive until the run is over (a host array, or None).
        """
        if tensor.device != self.memory_info.device:
            if not tensor.is_host_accessible:
                raise InvalidArgument(
                    f"input {name!r}: {tensor!r} is in {tensor.memory_info.name!r}, which "
                    f"{self.memory_info.name!r}'s EP cannot read"
                )
            host = np.ascontiguousarray(tensor.numpy())
            binding.bind_cpu_input(name, host)
            return host
        ptr = self._bindable_address(tensor)
        if ptr is None:
            host = np.empty(tensor.shape, tensor.dtype)
            transfer = self._transfer()
            if transfer is None:
                raise InvalidArgument(f"input {name!r}: no data transfer for {tensor!r}")
            transfer.copy_tensors([(tensor, Tensor.from_numpy(host))], None)
            with self._lock:
                self.host_fallbacks += 1
            binding.bind_cpu_input(name, host)
            return host
        binding._iobinding.bind_input(name, self._device, tensor.dtype, list(tensor.shape), ptr)
        return None

    def _bindable_address(self, tensor: Tensor) -> int | None:
        """The address ORT can read ``tensor`` at, or None where one OrtValue cannot hold it."""
        if tensor.nbytes == 0:
            return None
        block = self._map.find(tensor.data_ptr, tensor.nbytes)
        if not block.opaque:
            return tensor.data_ptr  # real addresses: any offset is a valid pointer
        offset = tensor.data_ptr - block.start
        index, rem = divmod(offset, block.segment_bytes)
        value, size = block.segment(index)
        if rem or tensor.nbytes > size:
            return None
        return int(value.data_ptr())  # the buffer handle; the tensor is its leading bytes

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Tensor:
        """A tensor for session I/O: one OrtValue from its first byte, so it binds by handle."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return Tensor(self._io_allocator().alloc(nbytes), shape, dtype)

    def bind_output(self, binding: Any, name: str, into: Tensor | None = None) -> bool:
        """Bind output ``name`` to ``into`` (ORT writes the output there; True) where one
        OrtValue can hold it and its dtype is numpy's own, else to the EP's device (ORT
        allocates it there; False)."""
        ptr = None
        if into is not None and into.dtype.type.__module__ == "numpy":
            ptr = self._bindable_address(into)
        if into is None or ptr is None:
            binding._iobinding.bind_output(name, self._device)
            return False
        binding._iobinding.bind_output(name, self._device, into.dtype, list(into.shape), ptr)
        return True

    def adopt(self, value: Any) -> Tensor:
        """An aioep tensor over ``value`` (an OrtValue ORT allocated on the EP's device)."""
        if not value.is_tensor():
            raise InvalidArgument(f"ORT returned a non-tensor value {value!r} on the device")
        shape = tuple(int(d) for d in value.shape())
        nbytes = int(value.tensor_size_in_bytes())
        dtype = output_dtype(value.data_type(), int(np.prod(shape, dtype=np.int64)), nbytes)
        if nbytes == 0:
            return Tensor.from_numpy(np.empty(shape, dtype))
        buffer = self._allocator().adopt_value(value, nbytes)
        return Tensor(buffer, shape, dtype)


def output_dtype(onnx_type: str, count: int, nbytes: int) -> np.dtype[Any]:
    """The numpy dtype of an ORT output of ``count`` elements in ``nbytes`` bytes.

    Raises:
        InvalidArgument: aioep cannot hold the type, or the dtype onnx maps it to does not
            have ORT's element size (older onnx maps bfloat16 and float8e5m2 to float32).
    """
    dtype = _numpy_dtype(onnx_type)
    if count * dtype.itemsize != nbytes:
        raise InvalidArgument(
            f"ORT returned a {onnx_type} output of {nbytes} bytes for {count} element(s); "
            f"aioep cannot hold it as {dtype} ({dtype.itemsize} bytes each)"
        )
    return dtype


# ORT packs these two (or four) to a byte; a numpy array of them holds one per byte.
_PACKED = frozenset({"int4", "uint4", "float4e2m1", "int2", "uint2"})


def _numpy_dtype(onnx_type: str) -> np.dtype[Any]:
    """The numpy dtype of an ORT tensor type such as ``"tensor(float)"``: what
    onnxruntime's own binding returns (float8e4m3fn as its uint8 bytes, so a device output
    matches the same output made by the CPU fallback), else the ``ml_dtypes`` type onnx
    uses (bfloat16, the other float8 types)."""
    import onnx

    name = onnx_type.removeprefix("tensor(").removesuffix(")")
    if name == "float8e4m3fn":
        return np.dtype(np.uint8)
    try:
        elem = onnx.TensorProto.DataType.Value(name.upper())
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
    except (ValueError, KeyError, TypeError):
        dtype = None
    if dtype is None or dtype.hasobject or name in _PACKED:
        raise InvalidArgument(f"ORT returned a {onnx_type} output, which aioep cannot hold")
    return dtype
