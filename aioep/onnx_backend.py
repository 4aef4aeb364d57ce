"""ONNX's backend interface over aioep sessions, for ONNX's conformance runner.

::

    import onnx.backend.test
    import aioep.onnx_backend

    backend_test = onnx.backend.test.BackendTest(aioep.onnx_backend, __name__)
    globals().update(backend_test.test_cases)

The module-level functions are those of `AioepBackend` (the sim device
where installed, else only the CPU fallback); `AioepBackend.configure`
makes a backend with other EP devices. The interface is blocking, for test
runners; serving code uses ``await env.create_session(...)`` and
``await session.run(...)``.
"""

from ._tools.onnx_backend import AioepBackend as AioepBackend
from ._tools.onnx_backend import AioepBackendRep as AioepBackendRep
from ._tools.onnx_backend import DeviceChoice as DeviceChoice

__all__ = [
    "AioepBackend",
    "AioepBackendRep",
    "DeviceChoice",
    "is_compatible",
    "prepare",
    "run_model",
    "run_node",
    "supports_device",
]

is_compatible = AioepBackend.is_compatible
prepare = AioepBackend.prepare
run_model = AioepBackend.run_model
run_node = AioepBackend.run_node
supports_device = AioepBackend.supports_device
