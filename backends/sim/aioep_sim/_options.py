"""The sim backend's options, validated once when the factory is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from aioep.abc import parse_float_option, parse_int_option, reject_unknown_options

__all__ = ["SimOptions"]

_OWNER = "sim backend"
# option -> (minimum, maximum); the int options, then the number options
_INTS: dict[str, tuple[int, int | None]] = {
    "num_devices": (0, 64),
    "memory_bytes": (1, None),
    "fail_after_copies": (0, None),
    "lose_device_after_copies": (0, None),
}
_FLOATS: dict[str, tuple[float, float | None]] = {
    "bandwidth_gbps": (0.0, None),
    "latency_us": (0.0, None),
}


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

        Values follow [`aioep.abc`][aioep.abc]'s option rules: counts and sizes are ints or int
        strings (decimal or ``0x`` hex; never floats), rates and times are numbers or
        number strings.

        Raises:
            InvalidArgument: an unknown option or a bad value (the message names it).
        """
        if options is None:
            return cls()
        reject_unknown_options(_OWNER, options, [f.name for f in fields(cls)])
        values: dict[str, Any] = {}
        for name, value in options.items():
            if name in _FLOATS:
                lo, hi = _FLOATS[name]
                values[name] = parse_float_option(_OWNER, name, value, minimum=lo, maximum=hi)
            elif value is not None or not name.endswith("_copies"):
                # (None, the default of the fault-injection counts, means never)
                ilo, ihi = _INTS[name]
                values[name] = parse_int_option(_OWNER, name, value, minimum=ilo, maximum=ihi)
        return cls(**values)
