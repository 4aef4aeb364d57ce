"""aioep backend for real ONNX Runtime plugin EP libraries (entry point ``ort``).

``env.register_library("webgpu", "/path/libonnxruntime_providers_webgpu.so")``
registers the library with onnxruntime and exposes each of its ``OrtEpDevice``
objects as an `OrtPluginDevice`; tensors on its memory are OrtValues
kept alive by aioep, copies go through ``onnxruntime.copy_tensors`` off the
event loop, in chunks. See the README for options and limits.
"""

from ._factory import OrtFactory as OrtFactory
from ._factory import OrtOptions as OrtOptions
from ._factory import OrtPluginDevice as OrtPluginDevice
from ._memory import OrtAllocator as OrtAllocator
from ._stream import OrtStream as OrtStream
from ._transfer import CallPacer as CallPacer
from ._transfer import OrtDataTransfer as OrtDataTransfer

__all__ = [
    "CallPacer",
    "OrtAllocator",
    "OrtDataTransfer",
    "OrtFactory",
    "OrtOptions",
    "OrtPluginDevice",
    "OrtStream",
]
__version__ = "0.1.0"
