"""The sim's external data loader: file bytes straight into device memory, the sim's
counterpart of GPUDirect Storage (cuFile), with no staging through host buffers."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import anyio
import anyio.to_thread

from aioep import (
    DeviceError,
    DeviceType,
    InvalidArgument,
    MemoryInfo,
    MemoryType,
    SyncStream,
    Tensor,
)
from aioep.abc import ExternalDataLoader

from ._device import SIM_VENDOR_ID, SimDevice
from ._stream import SimStream

__all__ = ["SimExternalDataLoader"]


class SimExternalDataLoader(ExternalDataLoader):
    """Reads external initializer data directly into a sim device's DEFAULT memory.

    With a stream, the whole read is enqueued on it (like ``cuFileReadAsync``),
    in order with the stream's other work, and the call returns once the stream
    has passed it. Without one, the file is read in ``chunk_bytes`` pieces in
    worker threads. Either way no host staging buffer is used.
    """

    chunk_bytes = 16 << 20

    def __init__(self, devices: Mapping[int, SimDevice]) -> None:
        self._devices = dict(devices)
        self.loads = 0
        """Tensors loaded so far (lets tests see that this loader was the one used)."""

    def _device(self, memory_info: MemoryInfo) -> SimDevice | None:
        md = memory_info.device
        if (
            md.vendor_id != SIM_VENDOR_ID
            or md.device_type is not DeviceType.GPU
            or md.memory_type is not MemoryType.DEFAULT
        ):
            return None
        return self._devices.get(md.device_id)

    def can_load(self, memory_info: MemoryInfo) -> bool:
        return self._device(memory_info) is not None

    async def load_tensor(
        self,
        path: str | os.PathLike[str],
        offset: int,
        length: int,
        tensor: Tensor,
        *,
        stream: SyncStream | None = None,
    ) -> None:
        dev = self._device(tensor.memory_info)
        if dev is None:
            raise InvalidArgument(f"sim loader: {tensor!r} is not in sim device memory")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise InvalidArgument(f"sim loader: offset must be an int >= 0, got {offset!r}")
        if length != tensor.nbytes:
            raise InvalidArgument(
                f"sim loader: length {length!r} differs from the size of {tensor!r} "
                f"({tensor.nbytes} bytes)"
            )
        filename = os.fspath(path)
        self.loads += 1
        if length == 0:
            return
        if stream is not None:
            impl = stream.impl
            if not isinstance(impl, SimStream) or impl.device is not dev:
                raise InvalidArgument(
                    f"sim loader: {stream!r} is not a stream of sim device {dev.device_id}"
                )
            # The closure holds the tensor, so its memory outlives the read.
            impl.enqueue(functools.partial(_read, dev, filename, offset, length, tensor, 0))
            await stream.record()
            return
        for start in range(0, length, self.chunk_bytes):
            n = min(self.chunk_bytes, length - start)
            await anyio.to_thread.run_sync(_read, dev, filename, offset + start, n, tensor, start)

    def __repr__(self) -> str:
        return f"<SimExternalDataLoader devices={sorted(self._devices)}>"


def _read(dev: SimDevice, path: str, position: int, n: int, tensor: Tensor, at: int) -> None:
    dev.check_alive("load external data")
    # Resolved when the read runs: freed memory is an illegal address, as for copies.
    view = dev.memory.view(tensor.data_ptr + at, n)
    mv = view.data.cast("B")
    got = 0
    with open(path, "rb", buffering=0) as f:
        while got < n:
            k = os.preadv(f.fileno(), [mv[got:]], position + got)
            if k == 0:
                raise DeviceError(
                    f"sim loader: {path!r} ended at byte {position + got} while reading {n} "
                    f"bytes at {position}"
                )
            got += k
