"""The arena's settings: ``ArenaConfig`` and ORT's arena option keys (``OrtArenaCfg``)."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._base.errors import InvalidArgument
from .._base.options import parse_int_option
from .._base.validate import short_repr

__all__ = ["SIZE_MAX", "ArenaConfig", "ArenaExtendStrategy"]

SIZE_MAX = (1 << 64) - 1  # ORT's "no limit" (std::numeric_limits<size_t>::max())

_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)


class ArenaExtendStrategy(enum.IntEnum):
    """How the arena grows when no free chunk fits (ORT's ``ArenaExtendStrategy``)."""

    NEXT_POWER_OF_TWO = 0
    """Regions double in size (from the initial chunk size), capped by max_power_of_two_extend_bytes."""
    SAME_AS_REQUESTED = 1
    """Each region is exactly the (rounded) request: least waste, more regions."""


_STRATEGY_NAMES = {
    "next_power_of_two": ArenaExtendStrategy.NEXT_POWER_OF_TWO,
    "same_as_requested": ArenaExtendStrategy.SAME_AS_REQUESTED,
}
# key -> (field, (min, max) of the C type ORT parses it as, unsigned?)
_KEYS: dict[str, tuple[str, tuple[int, int], bool]] = {
    "arena.extend_strategy": ("extend_strategy", _INT32, False),
    "arena.initial_chunk_size_bytes": ("initial_chunk_size_bytes", _INT32, False),
    "arena.max_dead_bytes_per_chunk": ("max_dead_bytes_per_chunk", _INT32, False),
    "arena.initial_growth_chunk_size_bytes": ("initial_growth_chunk_size_bytes", _INT32, False),
    "arena.max_power_of_two_extend_bytes": ("max_power_of_two_extend_bytes", _INT64, False),
    "arena.max_mem": ("max_mem", (0, SIZE_MAX), True),
}
_CUDA_MEMPOOL_KEYS = (
    "arena.use_cuda_mempool",
    "arena.cuda_mempool_release_threshold",
    "arena.cuda_mempool_bytes_to_keep_on_shrink",
)
_SIGNED = re.compile(r"-?[0-9]+")
_UNSIGNED = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]+")


@dataclass(frozen=True)
class ArenaConfig:
    """Arena settings, with ORT's defaults (``OrtArenaCfg`` after ``-1`` is resolved).

    Build one from ORT's key/value options with [`from_options`][aioep.ArenaConfig.from_options], or
    directly. ``max_mem=0`` means no limit.
    """

    extend_strategy: ArenaExtendStrategy = ArenaExtendStrategy.NEXT_POWER_OF_TWO
    initial_chunk_size_bytes: int = 1 << 20
    max_dead_bytes_per_chunk: int = 128 << 20
    initial_growth_chunk_size_bytes: int = 2 << 20
    max_power_of_two_extend_bytes: int = 1 << 30
    max_mem: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "extend_strategy", ArenaExtendStrategy(self.extend_strategy))
        except ValueError:
            raise InvalidArgument(
                f"ArenaConfig: extend_strategy must be 0 (next_power_of_two) or 1 "
                f"(same_as_requested), got {self.extend_strategy!r}"
            ) from None
        for name in (
            "initial_chunk_size_bytes",
            "initial_growth_chunk_size_bytes",
            "max_power_of_two_extend_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"ArenaConfig: {name} must be an int > 0, got {value!r}")
        for name in ("max_dead_bytes_per_chunk", "max_mem"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"ArenaConfig: {name} must be an int >= 0, got {value!r}")
        if self.max_mem > SIZE_MAX:
            raise InvalidArgument(f"ArenaConfig: max_mem {self.max_mem} does not fit in size_t")

    @property
    def limit(self) -> int:
        """The byte limit the arena enforces (``SIZE_MAX`` when ``max_mem`` is 0)."""
        return self.max_mem or SIZE_MAX

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> ArenaConfig:
        """Parse ORT's arena options (``OrtArenaCfg::FromKeyValuePairs`` then ``IsValid``).

        Keys: ``arena.extend_strategy`` (-1/0 next power of two, 1 same as requested,
        or the names ``next_power_of_two`` / ``same_as_requested``),
        ``arena.initial_chunk_size_bytes``, ``arena.max_dead_bytes_per_chunk``,
        ``arena.initial_growth_chunk_size_bytes``, ``arena.max_power_of_two_extend_bytes``
        and ``arena.max_mem`` (0 = no limit). Values are ints or strings that parse
        whole (``"0x"`` hex for the unsigned ``max_mem``); ``-1`` means the default.

        Raises:
            InvalidArgument: an unknown key, a value that is not an integer, out of
                range for its C type, negative where that is not allowed, or a
                strategy outside the set. The message names the key and the value.
        """
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise InvalidArgument(
                f"arena options must be a mapping of str to str/int, got {type(options).__name__}"
            )
        values: dict[str, Any] = {}
        for key, raw in options.items():
            shown = f"{short_repr(key)}={short_repr(raw)}"  # never a whole 4,000-digit value
            if key in _CUDA_MEMPOOL_KEYS:
                raise InvalidArgument(
                    f"arena option {shown}: CUDA mempool options are not supported by "
                    "aioep's arena (use the CUDA backend's allocator options instead)"
                )
            spec = _KEYS.get(key) if isinstance(key, str) else None
            if spec is None:
                raise InvalidArgument(
                    f"Invalid arena option {shown}; known keys are {sorted(_KEYS)}"
                )
            name, (lo, hi), unsigned = spec
            if name == "extend_strategy" and isinstance(raw, str) and raw in _STRATEGY_NAMES:
                values[name] = _STRATEGY_NAMES[raw]
                continue
            value = _parse_int(key, raw, unsigned)
            if value == -1:
                continue  # the default, as in ORT
            if not lo <= value <= hi:
                raise InvalidArgument(
                    f"arena option {shown}: out of range for its type [{lo}, {hi}]"
                )
            if name == "extend_strategy":
                if value not in (0, 1):
                    raise InvalidArgument(
                        f"arena option {shown}: must be -1 or 0 (next_power_of_two) "
                        "or 1 (same_as_requested)"
                    )
                values[name] = ArenaExtendStrategy(value)
            elif value < 0:
                raise InvalidArgument(f"arena option {shown}: must be -1 (the default) or >= 0")
            elif value == 0 and name != "max_dead_bytes_per_chunk" and name != "max_mem":
                raise InvalidArgument(f"arena option {shown}: must be -1 (the default) or > 0")
            else:
                values[name] = value
        return cls(**values)


def _parse_int(key: str, raw: Any, unsigned: bool) -> int:
    # ORT's syntax is stricter than the common option rules (ParseStringWithClassicLocale:
    # the whole string, no whitespace or "+", hex only for unsigned types; "-1" is the
    # default): check it here, then let parse_int_option apply the shared type rules
    # (an int, not a bool or a float) and convert. The C-type range is checked by the caller.
    syntax = _UNSIGNED if unsigned else _SIGNED
    if isinstance(raw, str) and raw != "-1" and not syntax.fullmatch(raw):
        raise InvalidArgument(f"Failed to parse value for {key!r} from {short_repr(raw)}")
    return parse_int_option("arena", key, raw)
