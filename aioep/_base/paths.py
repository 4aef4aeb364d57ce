"""Where a model's external data may live: ONNX Runtime's rule for an external data location,
shared by the graph view (which reads initializers) and external data loading."""

from __future__ import annotations

import os
from pathlib import PurePosixPath, PureWindowsPath

from .errors import InvalidArgument

__all__ = ["resolve_location"]


def resolve_location(base_dir: str, location: str, name: str) -> str:
    """Resolve ``location`` against the model directory; refuse paths that leave it.

    Follows ORT's rule: absolute locations are refused, and
    ``weakly_canonical(base_dir / location)`` must start, component by component,
    with ``weakly_canonical(base_dir)``; symlinks are resolved first, so a link
    inside the directory that points outside is refused too.

    Raises:
        InvalidArgument: the location is absolute or escapes the model directory.
    """
    prefix = f"External data path validation failed for initializer: {name}. Error: "
    if "\x00" in location:
        raise InvalidArgument(f"{prefix}location {location!r} contains a NUL character")
    # Drive letters and UNC roots are refused on every platform, so that a model is
    # accepted or refused the same way wherever it is loaded.
    win = PureWindowsPath(location)
    if PurePosixPath(location).is_absolute() or os.path.isabs(location) or win.drive or win.root:
        raise InvalidArgument(
            f"{prefix}Absolute paths not allowed for external data location: {location!r}"
        )
    base = os.path.realpath(base_dir)
    full = os.path.realpath(os.path.join(base, location))
    if os.path.commonpath([base, full]) != base:
        raise InvalidArgument(
            f"{prefix}External data path: {location!r} escapes model directory: {base!r} "
            f"(it resolves to {full!r})"
        )
    return full
