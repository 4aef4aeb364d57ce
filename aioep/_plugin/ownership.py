"""Who owns a buffer's memory, and the check that keeps an environment to its own.

Every allocator an environment makes (a library's default and shared allocators,
arenas over them) carries an `Origin`: the environment's `Scope` and
the library registration that made it. A buffer's owner is its allocator's origin.
``copy_tensors``, sessions and IOBinding call `check_owner` on each tensor:

- memory the host can address (RAM, pinned) is accepted from anywhere: it stays
  valid and readable while the buffer lives, whoever allocated it;
- device memory of this environment is accepted;
- device memory with no origin is *producer-owned* (`FOREIGN`): a buffer
  made by hand over memory that another framework owns (DLPack,
  ``__cuda_array_interface__``, a user's own allocator). aioep never frees it and
  any environment whose backends can route that memory device may use it. aioep's
  own memory imported back through DLPack or the CUDA Array Interface is not: the
  import resolves to the buffer that made it (``exports.handed_out``), so the rule
  below applies to it;
- device memory of another environment is refused with `InvalidArgument`
  naming the owner, or with `ClosedError` once that environment closed.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any, Final

from .._base.errors import ClosedError, InvalidArgument

if TYPE_CHECKING:
    from .buffer import Buffer
    from .tensor import Tensor

__all__ = ["FOREIGN", "Origin", "Scope", "check_owner", "origin_of", "owned_by"]

_scope_ids = itertools.count(1)


class Scope:
    """One environment's identity for ownership checks: a label, a closed flag and a weak
    reference back to the environment (for the module-level ``copy_tensors``)."""

    __slots__ = ("__weakref__", "_env", "closed", "label")

    def __init__(self, env: object) -> None:
        self.label = f"Environment #{next(_scope_ids)}"
        self.closed = False
        self._env = weakref.ref(env)

    @property
    def env(self) -> Any:
        """The environment, or None once it was garbage collected."""
        return self._env()

    def __repr__(self) -> str:
        return f"<{self.label}{' closed' if self.closed else ''}>"


class Origin:
    """The environment scope and library registration that made an allocator."""

    __slots__ = ("library", "scope")

    def __init__(self, scope: Scope, library: str) -> None:
        self.scope = scope
        self.library = library

    def __repr__(self) -> str:
        return f"library {self.library!r} of {self.scope.label}"


class _Foreign:
    """The owner of memory aioep did not allocate (producer-owned; never freed by aioep)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "FOREIGN"


FOREIGN: Final = _Foreign()
"""The origin of producer-owned memory: buffers built by hand over memory another framework
(or the user) owns, and tensors imported through DLPack or ``__cuda_array_interface__``.
An importer builds ``Buffer(ptr, nbytes, info, owner=keepalive)`` with no allocator: its
origin is FOREIGN, so every environment whose transfers route that memory device accepts it."""


def origin_of(buffer: Buffer) -> Origin | _Foreign:
    """The origin of ``buffer``: its allocator's, or `FOREIGN`."""
    allocator = buffer.allocator
    origin = None if allocator is None else getattr(allocator, "_origin", None)
    return FOREIGN if origin is None else origin


def check_owner(tensor: Tensor, scope: Scope, role: str) -> None:
    """Refuse ``tensor`` unless environment ``scope`` may read and write its memory.

    Raises:
        ClosedError: device memory of an environment that is closed.
        InvalidArgument: device memory of another open environment (the message names it).
    """
    allocator = tensor.buffer.allocator
    if allocator is None:
        return
    origin = allocator._origin
    if (
        origin is None
        or origin.scope is scope
        or tensor.buffer.memory_info.device.is_host_accessible
    ):
        return
    if origin.scope.closed:
        raise ClosedError(
            f"{role}: {tensor!r} is device memory of {origin}, which is closed; its memory "
            "cannot be used any more"
        )
    raise InvalidArgument(
        f"{role}: {tensor!r} is device memory of another environment ({origin}), not of "
        f"{scope.label}; use it with the environment that allocated it (or copy it to host "
        "memory there first)"
    )


def owned_by(tensor: Tensor, scope: Scope) -> bool:
    """True where `check_owner` accepts ``tensor`` for ``scope`` (the test alone, for a
    fast path that leaves every refusal to the full check and its message)."""
    allocator = tensor.buffer.allocator
    if allocator is None:
        return True
    origin = allocator._origin
    return (
        origin is None
        or origin.scope is scope
        or tensor.buffer.memory_info.device.is_host_accessible
    )
