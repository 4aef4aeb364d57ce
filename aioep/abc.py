"""Base classes and helpers for backend (plugin) authors.

A backend is an :class:`EpFactory` subclass registered in the entry-point group
``aioep.backends``. It offers :class:`aioep.EpDevice` objects, an
:class:`Allocator` per memory info, optionally a :class:`DataTransfer`, streams
(:class:`StreamImpl` / :class:`NotificationImpl`; :class:`ThreadStream` is a
ready one driven by a worker thread; :class:`HostAllocator` is a ready allocator of
aligned host memory, e.g. for a HOST_ACCESSIBLE memory info) and an :class:`ExternalDataLoader`.
Its options are parsed with :func:`parse_int_option`, :func:`parse_float_option`,
:func:`parse_bool_option`, :func:`parse_choice_option` and
:func:`reject_unknown_options`, so every backend reads a value the same way.
``backends/sim`` is the reference implementation to copy.
"""

from ._allocator import Allocator as Allocator
from ._chunked_loader import DEFAULT_CHUNK_BYTES as DEFAULT_CHUNK_BYTES
from ._chunked_loader import ChunkedExternalDataLoader as ChunkedExternalDataLoader
from ._ep import CompiledNode as CompiledNode
from ._ep import Ep as Ep
from ._external_data import ExternalDataLoader as ExternalDataLoader
from ._factory import EpFactory as EpFactory
from ._factory import FactoryOptions as FactoryOptions
from ._host import HostAllocator as HostAllocator
from ._options import parse_bool_option as parse_bool_option
from ._options import parse_choice_option as parse_choice_option
from ._options import parse_float_option as parse_float_option
from ._options import parse_int_option as parse_int_option
from ._options import reject_unknown_options as reject_unknown_options
from ._stream_impl import HostNotification as HostNotification
from ._stream_impl import NotificationImpl as NotificationImpl
from ._stream_impl import StreamImpl as StreamImpl
from ._stream_impl import ThreadStream as ThreadStream
from ._transfer import CopyPair as CopyPair
from ._transfer import DataTransfer as DataTransfer

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Allocator",
    "ChunkedExternalDataLoader",
    "CompiledNode",
    "Ep",
    "CopyPair",
    "DataTransfer",
    "EpFactory",
    "ExternalDataLoader",
    "FactoryOptions",
    "HostAllocator",
    "HostNotification",
    "NotificationImpl",
    "StreamImpl",
    "ThreadStream",
    "parse_bool_option",
    "parse_choice_option",
    "parse_float_option",
    "parse_int_option",
    "reject_unknown_options",
]
