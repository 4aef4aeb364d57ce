"""aioep's CUDA backend: NVIDIA GPUs through the CUDA driver API (``cuda.bindings.driver``).

Entry point ``cuda`` in the group ``aioep.backends`` names `CudaFactory`
(EP ``"CUDAExecutionProvider"``). Importing this package never touches the
driver: a machine without a GPU or driver gets a factory that offers no
device and says why (``Environment.load_errors["cuda"]``).

Layout: ``_driver`` (the driver boundary: loading, result checks, contexts),
``_device`` (per-GPU state: the process-wide shared context, event pool and memory pools,
released only at the last close), ``_pool`` (the caching pools: nothing synchronises while
an environment runs), ``_stream`` (CUstream / CUevent),
``_wake`` (the GIL-free ``sem_post`` wake-up and its dispatcher thread),
``_allocator``, ``_transfer``, ``_staging`` (pageable copies through pinned chunks: the
``Stager`` over a worker pool, ``_workers``, a chunk pool, ``_chunks``, and the piece
machine, ``_pieces``), ``_dlpack``, ``_factory``, ``_probe`` (what driver and GPUs
the process sees: `describe_driver`), ``_check`` (the ``check-gpu`` subcommand, whose
harness lives in an aioep checkout's ``tools/check_gpu``).
"""

from aioep.abc import register_dlpack_exporter

from ._allocator import CudaDeviceAllocator as CudaDeviceAllocator
from ._allocator import CudaPinnedAllocator as CudaPinnedAllocator
from ._device import NVIDIA_VENDOR_ID as NVIDIA_VENDOR_ID
from ._dlpack import CudaMemoryImporter as CudaMemoryImporter
from ._dlpack import export_dlpack as export_dlpack
from ._factory import CudaFactory as CudaFactory
from ._factory import CudaOptions as CudaOptions
from ._probe import describe_driver as describe_driver
from ._stream import CudaNotification as CudaNotification
from ._stream import CudaStream as CudaStream
from ._transfer import CudaDataTransfer as CudaDataTransfer

__all__ = [
    "NVIDIA_VENDOR_ID",
    "CudaDataTransfer",
    "CudaDeviceAllocator",
    "CudaMemoryImporter",
    "CudaFactory",
    "CudaNotification",
    "CudaOptions",
    "CudaPinnedAllocator",
    "CudaStream",
    "describe_driver",
    "export_dlpack",
]

__version__ = "0.1.0"

register_dlpack_exporter(NVIDIA_VENDOR_ID, export_dlpack)
