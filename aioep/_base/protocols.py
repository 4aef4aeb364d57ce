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
    """An object that exports its memory through DLPack: ``__dlpack__`` and ``__dlpack_device__``
    (a PyTorch, CuPy, JAX or numpy array).

    aioep calls ``__dlpack__(stream=...)`` (with ``max_version=`` where the producer takes it)
    and ``__dlpack_device__()``, which returns the DLPack device type code and device id.
    """

    def __dlpack__(self, *, stream: Any = None) -> object: ...

    def __dlpack_device__(self) -> tuple[int | enum.Enum, int]: ...


@runtime_checkable
class SupportsCudaArrayInterface(Protocol):
    """An object that describes its CUDA memory with ``__cuda_array_interface__`` (a CuPy,
    PyTorch or numba array), version 2 or 3 of the interface."""

    @property
    def __cuda_array_interface__(self) -> Mapping[str, Any]: ...
