"""An environment's settings: its constructor's arguments, checked once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._base.budget import InlineBudget
from .._base.errors import InvalidArgument
from .._base.validate import check_int, check_options, check_type, describe

__all__ = ["MAX_STREAM_POOL_SIZE", "Settings"]

MAX_STREAM_POOL_SIZE = 1024


@dataclass(frozen=True)
class Settings:
    """What `Environment` was asked for: which backends to load with which options, the
    stream pool's size and the inline budget."""

    autoload: bool
    backends: list[str] | None
    backend_options: dict[str, dict[str, Any]]
    stream_pool_size: int
    budget: InlineBudget

    @classmethod
    def checked(
        cls,
        autoload: bool,
        backends: Sequence[str] | None,
        backend_options: Mapping[str, Mapping[str, Any]] | None,
        stream_pool_size: int,
        inline_budget_us: float,
    ) -> Settings:
        """The settings of ``Environment(...)``'s arguments (see `Environment`).

        Raises:
            InvalidArgument: an argument is of the wrong type or out of range (the message
                names it).
        """
        check_type("Environment", "autoload", autoload, bool, "a bool")
        size = check_int(
            "Environment",
            "stream_pool_size",
            stream_pool_size,
            minimum=1,
            maximum=MAX_STREAM_POOL_SIZE,
        )
        try:
            budget = InlineBudget(inline_budget_us)
        except InvalidArgument as exc:
            raise InvalidArgument(f"Environment: {exc}") from None
        names: list[str] | None = None
        if backends is not None:
            try:
                if isinstance(backends, (str, bytes, Mapping)):
                    raise TypeError
                names = list(backends)
            except TypeError:
                names = [None]  # type: ignore[list-item]
            if not all(isinstance(b, str) for b in names):
                raise InvalidArgument(
                    f"Environment: backends must be a list of names (str), got {describe(backends)}"
                )
        outer = check_options("Environment", "backend_options", backend_options)
        options = {
            k: check_options("Environment", f"backend_options[{k!r}]", v) for k, v in outer.items()
        }
        return cls(autoload, names, options, size, budget)
