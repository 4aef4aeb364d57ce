"""The plugin contract: everything a backend (in-tree or third-party) needs from aioep.

A backend imports from [`aioep`][aioep] and [`aioep.abc`][aioep.abc] only; the private modules
behind them may change between releases (an import-linter contract keeps the
in-tree backends to this rule).

A backend is an [`EpFactory`][aioep.abc.EpFactory] subclass registered in the entry-point group
``aioep.backends``. It offers [`aioep.EpDevice`][aioep.EpDevice] objects, an
[`Allocator`][aioep.abc.Allocator] per memory info, optionally a
[`DataTransfer`][aioep.abc.DataTransfer] (copying [`CopyPair`][aioep.abc.CopyPair] lists), streams
([`StreamImpl`][aioep.abc.StreamImpl] / [`NotificationImpl`][aioep.abc.NotificationImpl];
[`ThreadStream`][aioep.abc.ThreadStream] is a ready one driven by a worker thread,
[`HostNotification`][aioep.abc.HostNotification] a ready notification completed by host code;
[`HostAllocator`][aioep.abc.HostAllocator] is a ready allocator of aligned host memory, e.g. for a
HOST_ACCESSIBLE memory info) and an [`ExternalDataLoader`][aioep.abc.ExternalDataLoader]
([`ChunkedExternalDataLoader`][aioep.abc.ChunkedExternalDataLoader] is the built-in one). A data
transfer whose copies are plain host memcpys says so (``DataTransfer.can_copy_inline``): the core
then runs small ones inline on the event loop while an `InlineBudget` (the environment's) measures
them within budget. Its options are parsed with [`parse_int_option`][aioep.abc.parse_int_option],
[`parse_float_option`][aioep.abc.parse_float_option],
[`parse_bool_option`][aioep.abc.parse_bool_option],
[`parse_choice_option`][aioep.abc.parse_choice_option] and
[`reject_unknown_options`][aioep.abc.reject_unknown_options], so every backend reads a value the
same way.

For sessions it offers an [`Ep`][aioep.abc.Ep]: ``get_capability`` looks at a
[`GraphView`][aioep.abc.GraphView] ([`Node`][aioep.abc.Node], [`ValueInfo`][aioep.abc.ValueInfo],
[`Initializer`][aioep.abc.Initializer]) and returns [`IndexedSubGraph`][aioep.abc.IndexedSubGraph]
claims (with a [`MetaDef`][aioep.abc.MetaDef] for a fused group); ``compile`` turns each
[`FusedGroup`][aioep.abc.FusedGroup] into a [`CompiledNode`][aioep.abc.CompiledNode].
[`HOST_MEMORY_INFO`][aioep.abc.HOST_MEMORY_INFO] is host RAM, for an EP that takes host tensors, and
[`register_dlpack_exporter`][aioep.abc.register_dlpack_exporter] lets ``Tensor.__dlpack__`` hand
device tensors to other libraries ([`dlpack_capsule`][aioep.abc.dlpack_capsule] builds the capsule),
and a [`MemoryImporter`][aioep.abc.MemoryImporter] (``EpFactory.create_memory_importer``) lets aioep
take other libraries' tensors (DLPack, CUDA Array Interface) on the backend's devices.

``backends/sim`` is the reference implementation to copy.
"""

import typing

from ._base.budget import DEFAULT_INLINE_BUDGET_US as DEFAULT_INLINE_BUDGET_US
from ._base.budget import InlineBudget as InlineBudget
from ._base.codes import DLDeviceType as DLDeviceType
from ._base.options import parse_bool_option as parse_bool_option
from ._base.options import parse_choice_option as parse_choice_option
from ._base.options import parse_float_option as parse_float_option
from ._base.options import parse_int_option as parse_int_option
from ._base.options import reject_unknown_options as reject_unknown_options
from ._copies.chunked_loader import DEFAULT_CHUNK_BYTES as DEFAULT_CHUNK_BYTES
from ._copies.chunked_loader import ChunkedExternalDataLoader as ChunkedExternalDataLoader
from ._environment.host import HostAllocator as HostAllocator
from ._graph.graph import GraphView as GraphView
from ._graph.graph import Initializer as Initializer
from ._graph.graph import Node as Node
from ._graph.graph import ValueInfo as ValueInfo
from ._memory.dlpack import DLManagedTensor as DLManagedTensor
from ._memory.dlpack import dlpack_capsule as dlpack_capsule
from ._memory.dlpack import dlpack_dtype as dlpack_dtype
from ._memory.dlpack import live_dlpack_exports as live_dlpack_exports
from ._plugin.allocator import Allocator as Allocator
from ._plugin.buffer import HOST_MEMORY_INFO as HOST_MEMORY_INFO
from ._plugin.ep import CompiledNode as CompiledNode
from ._plugin.ep import Ep as Ep
from ._plugin.ep import FusedGroup as FusedGroup
from ._plugin.ep import IndexedSubGraph as IndexedSubGraph
from ._plugin.ep import MetaDef as MetaDef
from ._plugin.factory import EpFactory as EpFactory
from ._plugin.factory import FactoryOptions as FactoryOptions
from ._plugin.importer import MemoryImporter as MemoryImporter
from ._plugin.loader import ExternalDataLoader as ExternalDataLoader
from ._plugin.stream_impl import NotificationImpl as NotificationImpl
from ._plugin.stream_impl import StreamImpl as StreamImpl
from ._plugin.tensor import register_dlpack_exporter as register_dlpack_exporter
from ._plugin.thread_stream import HostNotification as HostNotification
from ._plugin.thread_stream import ThreadStream as ThreadStream
from ._plugin.transfer import CopyPair as _CopyPair
from ._plugin.transfer import DataTransfer as DataTransfer

# Bound here rather than re-exported so that it carries its docstring (the defining
# module's alias has none).
CopyPair: typing.TypeAlias = _CopyPair
"""One copy: a ``(source, destination)`` tensor pair, as
[`DataTransfer.copy_tensors`][aioep.abc.DataTransfer.copy_tensors] receives it."""

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_INLINE_BUDGET_US",
    "HOST_MEMORY_INFO",
    "Allocator",
    "ChunkedExternalDataLoader",
    "CompiledNode",
    "CopyPair",
    "DLDeviceType",
    "DLManagedTensor",
    "DataTransfer",
    "Ep",
    "EpFactory",
    "ExternalDataLoader",
    "FactoryOptions",
    "FusedGroup",
    "GraphView",
    "HostAllocator",
    "HostNotification",
    "IndexedSubGraph",
    "Initializer",
    "InlineBudget",
    "MemoryImporter",
    "MetaDef",
    "Node",
    "NotificationImpl",
    "StreamImpl",
    "ThreadStream",
    "ValueInfo",
    "dlpack_capsule",
    "dlpack_dtype",
    "live_dlpack_exports",
    "parse_bool_option",
    "parse_choice_option",
    "parse_float_option",
    "parse_int_option",
    "register_dlpack_exporter",
    "reject_unknown_options",
]
