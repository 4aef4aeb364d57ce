"""aioep: ONNX Runtime's plugin execution-provider device layer for async Python.

The public API is what this module re-exports; everything else lives in private
modules, one concern each (``_environment``, ``_stream``, ``_transfer`` ...).
Plugin authors find the base classes they implement in :mod:`aioep.abc`.
"""

from ._allocator import Allocator as Allocator
from ._device import EpDevice as EpDevice
from ._environment import Environment as Environment
from ._environment import copy_tensors as copy_tensors
from ._environment import current_environment as current_environment
from ._errors import ClosedError as ClosedError
from ._errors import DeviceError as DeviceError
from ._errors import EpError as EpError
from ._errors import ErrorCode as ErrorCode
from ._errors import InUseError as InUseError
from ._errors import InvalidArgument as InvalidArgument
from ._errors import NoSuchFile as NoSuchFile
from ._errors import NotImplementedByEp as NotImplementedByEp
from ._factory import EpFactory as EpFactory
from ._future import CopyFuture as CopyFuture
from ._future import CopyStatus as CopyStatus
from ._notification import Notification as Notification
from ._stream import SyncStream as SyncStream
from ._tensor import Buffer as Buffer
from ._tensor import Tensor as Tensor
from ._types import AllocatorType as AllocatorType
from ._types import DeviceType as DeviceType
from ._types import HardwareDevice as HardwareDevice
from ._types import MemoryDevice as MemoryDevice
from ._types import MemoryInfo as MemoryInfo
from ._types import MemoryType as MemoryType

__version__ = "0.1.0"

__all__ = [
    "Allocator",
    "AllocatorType",
    "Buffer",
    "ClosedError",
    "CopyFuture",
    "CopyStatus",
    "DeviceError",
    "DeviceType",
    "EpDevice",
    "EpError",
    "EpFactory",
    "Environment",
    "ErrorCode",
    "HardwareDevice",
    "InUseError",
    "InvalidArgument",
    "MemoryDevice",
    "MemoryInfo",
    "MemoryType",
    "NoSuchFile",
    "NotImplementedByEp",
    "Notification",
    "SyncStream",
    "Tensor",
    "copy_tensors",
    "current_environment",
]
