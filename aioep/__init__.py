"""aioep: ONNX Runtime's plugin execution-provider device layer for async Python.

The public API is what this module re-exports; everything else lives in private
subpackages, one layer each (``_streams``, ``_memory``, ``_copies``, ``_session`` ...).
Plugin authors find what they implement and use in [`aioep.abc`][aioep.abc]; backends
import nothing else.
"""

# Layout: the private subpackages are layers that import only downward (_base; _tensors
# and _streams; _memory and _interop; _devices; _copies and _external_data; _environment
# and _graph; _session; _tools), each saying its job in its docstring, checked by the
# import-linter contracts in pyproject.toml. This module and aioep.abc sit on top and
# only re-export; a test checks their names and docstrings.

from ._base.budget import InlineBudget as InlineBudget
from ._base.errors import ClosedError as ClosedError
from ._base.errors import DeviceError as DeviceError
from ._base.errors import EpError as EpError
from ._base.errors import ErrorCode as ErrorCode
from ._base.errors import InUseError as InUseError
from ._base.errors import InvalidArgument as InvalidArgument
from ._base.errors import NoSuchFile as NoSuchFile
from ._base.errors import NotImplementedByEp as NotImplementedByEp
from ._base.protocols import SupportsCudaArrayInterface as SupportsCudaArrayInterface
from ._base.protocols import SupportsDLPack as SupportsDLPack
from ._base.types import AllocatorType as AllocatorType
from ._base.types import DeviceType as DeviceType
from ._base.types import HardwareDevice as HardwareDevice
from ._base.types import MemoryDevice as MemoryDevice
from ._base.types import MemoryInfo as MemoryInfo
from ._base.types import MemoryType as MemoryType
from ._copies.future import CopyFuture as CopyFuture
from ._copies.future import CopyStatus as CopyStatus
from ._environment.environment import Environment as Environment
from ._environment.environment import copy_tensors as copy_tensors
from ._environment.environment import current_environment as current_environment
from ._environment.report import CloseReport as CloseReport
from ._environment.report import LiveBuffers as LiveBuffers
from ._graph.graph import GraphView as GraphView
from ._graph.graph import Initializer as Initializer
from ._graph.graph import Node as Node
from ._graph.graph import ValueInfo as ValueInfo
from ._memory.arena import ArenaAllocator as ArenaAllocator
from ._memory.arena import ArenaConfig as ArenaConfig
from ._memory.arena import ArenaExtendStrategy as ArenaExtendStrategy
from ._plugin.allocator import Allocator as Allocator
from ._plugin.buffer import Buffer as Buffer
from ._plugin.device import EpDevice as EpDevice
from ._plugin.ep import CompiledNode as CompiledNode
from ._plugin.ep import Ep as Ep
from ._plugin.ep import FusedGroup as FusedGroup
from ._plugin.ep import IndexedSubGraph as IndexedSubGraph
from ._plugin.ep import MetaDef as MetaDef
from ._plugin.factory import EpFactory as EpFactory
from ._plugin.notification import Notification as Notification
from ._plugin.stream import SyncStream as SyncStream
from ._plugin.tensor import Tensor as Tensor
from ._session.io_binding import IOBinding as IOBinding
from ._session.node_arg import NodeArg as NodeArg
from ._session.session import Session as Session

__version__ = "0.1.0"

__all__ = [
    "Allocator",
    "AllocatorType",
    "ArenaAllocator",
    "ArenaConfig",
    "ArenaExtendStrategy",
    "Buffer",
    "CloseReport",
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
    "InlineBudget",
    "InvalidArgument",
    "LiveBuffers",
    "MemoryDevice",
    "MemoryInfo",
    "MemoryType",
    "MetaDef",
    "NoSuchFile",
    "Node",
    "NodeArg",
    "NotImplementedByEp",
    "Notification",
    "Session",
    "SupportsCudaArrayInterface",
    "SupportsDLPack",
    "SyncStream",
    "Tensor",
    "ValueInfo",
    "copy_tensors",
    "current_environment",
]
