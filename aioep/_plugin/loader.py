"""The external data loader interface (ORT's ``IExternalDataLoader``) that a factory may
offer through ``create_external_data_loader()``."""

from __future__ import annotations

import abc
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._base.types import MemoryInfo
    from .stream import SyncStream
    from .tensor import Tensor

__all__ = ["ExternalDataLoader"]


class ExternalDataLoader(abc.ABC):
    """Loads ``length`` bytes at ``offset`` of a file into a device tensor."""

    @abc.abstractmethod
    def can_load(self, memory_info: MemoryInfo) -> bool:
        """True if this loader can fill tensors in ``memory_info``."""

    @abc.abstractmethod
    async def load_tensor(
        self,
        path: str | os.PathLike[str],
        offset: int,
        length: int,
        tensor: Tensor,
        *,
        stream: SyncStream | None = None,
    ) -> None:
        """Read the bytes and place them in ``tensor`` (already validated by the caller)."""

    def close(self) -> None:
        """Release resources; called when the library is unregistered."""
