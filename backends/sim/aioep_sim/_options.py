"""The sim backend's options, validated once when the factory is built."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from aioep import InvalidArgument

__all__ = ["SimOptions"]


def _number(name: str, value: Any, *, integer: bool, minimum: float) -> Any:
    # Options may arrive as strings (config files, ORT-style key/value pairs).
    if isinstance(value, bool):
        raise InvalidArgument(f"sim backend option {name!r}: expected a number, got {value!r}")
    try:
        if integer:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            number: float = int(value)
        else:
            number = float(value)
    except (TypeError, ValueError):
        kind = "an int" if integer else "a number"
        raise InvalidArgument(
            f"sim backend option {name!r}: expected {kind}, got {value!r}"
        ) from None
    if math.isnan(number) or math.isinf(number) or number < minimum:
        raise InvalidArgument(f"sim backend option {name!r}: must be >= {minimum}, got {value!r}")
    return number


@dataclass(frozen=True)
class SimOptions:
    """The sim backend's options (see the README for what each one models)."""

    num_devices: int = 2
    """How many simulated GPUs to offer."""
    memory_bytes: int = 1 << 30
    """DEFAULT (device) memory per device; allocating past it raises an out-of-memory DeviceError."""
    bandwidth_gbps: float = 0.0
    """Copy-engine bandwidth in GB/s (1e9 bytes/s); 0 means as fast as memcpy, no engines."""
    latency_us: float = 0.0
    """Fixed cost of every copy, in microseconds, before it moves data."""
    fail_after_copies: int | None = None
    """Copy N+1 on a device fails with DeviceError; later copies work again."""
    lose_device_after_copies: int | None = None
    """Copy N+1 on a device fails and the device is lost: all later work on it fails."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> SimOptions:
        """Validate a mapping of option name -> str/int/float.

        Raises:
            InvalidArgument: an unknown option or a bad value (the message names it).
        """
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise InvalidArgument(
                f"sim backend options must be a mapping, got {type(options).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise InvalidArgument(
                f"sim backend: unknown option(s) {unknown}; known options are {sorted(known)}"
            )
        values: dict[str, Any] = {}
        for name, value in options.items():
            if name == "num_devices":
                values[name] = _number(name, value, integer=True, minimum=0)
                if values[name] > 64:
                    raise InvalidArgument(
                        f"sim backend option 'num_devices': at most 64, got {value!r}"
                    )
            elif name == "memory_bytes":
                values[name] = _number(name, value, integer=True, minimum=1)
            elif name in ("bandwidth_gbps", "latency_us"):
                values[name] = _number(name, value, integer=False, minimum=0)
            elif value is not None:  # the fault-injection counts
                values[name] = _number(name, value, integer=True, minimum=0)
        return cls(**values)
