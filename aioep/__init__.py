"""aioep: ONNX Runtime's plugin execution-provider device layer for async Python.

The public API is what this module re-exports; everything else lives in private
modules, one concern each (``_environment``, ``_stream``, ``_transfer`` ...).
Plugin authors find what they implement and use in :mod:`aioep.abc`; backends
import nothing else.
"""

# Layout: the private modules form layers that import only downward (types and errors;
# tensors and buffers; streams and notifications; transfers, allocators and arenas;
# factories and devices; the environment; sessions; the CLI and plugins), checked by
# the import-linter contracts in pyproject.toml. This module and aioep.abc sit on top
# and only re-export; a test checks their names and docstrings.

from ._allocator import Allocator as Allocator
from ._arena import ArenaAllocator as ArenaAllocator
from ._arena import ArenaConfig as ArenaConfig
from ._arena import ArenaExtendStrategy as ArenaExtendStrategy
from ._device import EpDevice as EpDevice
from ._environment import Environment as Environment
from ._environment import copy_tensors as copy_tensors
from ._environment import current_environment as current_environment
from ._ep import CompiledNode as CompiledNode
from ._ep import Ep as Ep
from ._ep import FusedGroup as FusedGroup
from ._ep import IndexedSubGraph as IndexedSubGraph
from ._ep import MetaDef as MetaDef
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
from ._graph import GraphView as GraphView
from ._graph import Initializer as Initializer
from ._graph import Node as Node
from ._graph import ValueInfo as ValueInfo
from ._io_binding import IOBinding as IOBinding
from ._notification import Notification as Notification
from ._session import Session as Session
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
    "ArenaAllocator",
    "ArenaConfig",
    "ArenaExtendStrategy",
    "Buffer",
    "ClosedError",
    "CompiledNode",
    "CopyFuture",
    "CopyStatus",
    "DeviceError",
    "DeviceType",
    "Environment",
    "Ep",
    "EpDevice",
    "EpError",
    "EpFactory",
    "ErrorCode",
    "FusedGroup",
    "GraphView",
    "HardwareDevice",
    "InUseError",
    "IOBinding",
    "IndexedSubGraph",
    "Initializer",
    "InvalidArgument",
    "MemoryDevice",
    "MemoryInfo",
    "MemoryType",
    "MetaDef",
    "NoSuchFile",
    "Node",
    "NotImplementedByEp",
    "Notification",
    "Session",
    "SyncStream",
    "Tensor",
    "ValueInfo",
    "copy_tensors",
    "current_environment",
]
