"""The structural types of other libraries' tensors that aioep accepts wherever it takes a
tensor (``copy_tensors``, session inputs): PyTorch, CuPy, JAX, numba and numpy arrays type-check
against them without aioep importing any of those libraries."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = ["SupportsCudaArrayInterface", "SupportsDLPack"]


@runtime_checkable
class SupportsDLPack(Protocol):
    """Another library's tensor that aioep takes through DLPack (PyTorch, CuPy, JAX, numpy).

    It has ``__dlpack__`` and ``__dlpack_device__``. aioep calls ``__dlpack__(stream=...)``
    (with ``max_version=`` where the producer takes it) and ``__dlpack_device__()``, which
    returns the DLPack device type code and the device id. Annotate with it (or
    ``SupportsCudaArrayInterface``) what you hand to ``copy_tensors`` or ``Session.run``.
    """

    def __dlpack__(self, *, stream: Any = None) -> object: ...

    def __dlpack_device__(self) -> tuple[int | enum.Enum, int]: ...


@runtime_checkable
class SupportsCudaArrayInterface(Protocol):
    """Another library's CUDA tensor that aioep takes through the CUDA Array Interface.

    It has ``__cuda_array_interface__`` (version 2 or 3): a CuPy, PyTorch or numba array.
    """

    @property
    def __cuda_array_interface__(self) -> Mapping[str, Any]: ...
