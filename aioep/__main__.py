"""The ``aioep`` command line: ``python -m aioep devices [--json]`` (and ``bench``).

``devices`` opens an environment the way an application would (every installed
backend, or only ``--backend`` ones) and prints its EP devices, their memory
infos, the shared allocators and the backends that could not start.

Installed distributions add subcommands through the entry point group
``aioep.commands``: each names an ``add_parser(subparsers)`` callable (aioep-cuda
adds ``check-gpu`` this way; the core never imports a backend). A subcommand that sets
the default ``passthrough=True`` receives the arguments it did not declare, in order, as
``args.rest`` (check-gpu hands them to the harness of an aioep checkout).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from ._base.types import MemoryInfo
from ._environment.environment import Environment

__all__ = ["describe_environment", "format_devices", "main"]


def _memory_info_json(info: MemoryInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "device": str(info.device),
        "device_type": info.device.device_type.name,
        "memory_type": info.device.memory_type.name,
        "vendor_id": info.device.vendor_id,
        "device_id": info.device.device_id,
        "alignment": info.alignment,
        "allocator_type": info.allocator_type.name,
    }


def describe_environment(env: Environment) -> dict[str, Any]:
    """What ``devices --json`` prints: a JSON-able description of an open environment."""
    devices = []
    for dev in env.ep_devices():
        hw = dev.hardware
        devices.append(
            {
                "ep_name": dev.ep_name,
                "ep_vendor": dev.ep_vendor,
                "type": hw.type.name,
                "vendor": hw.vendor,
                "vendor_id": hw.vendor_id,
                "device_id": hw.device_id,
                "ep_metadata": dict(dev.ep_metadata),
                "ep_options": dict(dev.ep_options),
                "hardware_metadata": dict(hw.metadata),
                "memory_infos": [_memory_info_json(i) for i in dev.memory_infos],
            }
        )
    allocators = []
    host = env.get_shared_allocator(env.ep_devices(ep_name="host")[0].memory_infos[0])
    shared = dict(env.shared_allocators)
    if host is not None and host.memory_info.device not in shared:
        shared[host.memory_info.device] = host
    for device, allocator in shared.items():
        allocators.append(
            {
                "memory_device": str(device),
                "memory_info": allocator.memory_info.name,
                "allocator": type(allocator).__name__,
                "allocator_type": allocator.memory_info.allocator_type.name,
                "stats": allocator.stats(),
            }
        )
    return {
        "libraries": list(env.libraries),
        "ep_devices": devices,
        "shared_allocators": allocators,
        "load_errors": dict(env.load_errors),
    }


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return out


def format_devices(desc: dict[str, Any]) -> str:
    """The human-readable table that ``devices`` prints for `describe_environment`."""
    lines = ["EP devices"]
    rows = [
        [
            str(i),
            d["ep_name"],
            d["type"],
            d["vendor"],
            f"{d['vendor_id']:#06x}",
            str(d["device_id"]),
            d["ep_metadata"].get("version", ""),
        ]
        for i, d in enumerate(desc["ep_devices"])
    ]
    lines += _table(["#", "ep name", "type", "vendor", "vendor id", "device id", "version"], rows)
    lines += ["", "Memory infos"]
    rows = [
        [
            str(i),
            m["name"],
            m["memory_type"],
            m["device"],
            str(m["alignment"]),
            m["allocator_type"],
        ]
        for i, d in enumerate(desc["ep_devices"])
        for m in d["memory_infos"]
    ]
    lines += _table(["#", "name", "memory type", "memory device", "alignment", "allocator"], rows)
    lines += ["", "Shared allocators"]
    rows = [
        [
            a["memory_device"],
            a["memory_info"],
            a["allocator"],
            a["allocator_type"],
            str(a["stats"].get("InUse", 0)),
        ]
        for a in desc["shared_allocators"]
    ]
    lines += _table(["memory device", "memory info", "class", "type", "bytes in use"], rows)
    lines += ["", "Load errors"]
    if desc["load_errors"]:
        lines += [f"{name}: {msg}" for name, msg in sorted(desc["load_errors"].items())]
    else:
        lines.append("(none)")
    return "\n".join(lines)


def _devices(args: argparse.Namespace) -> int:
    backends = args.backend or None
    with warnings.catch_warnings():
        # A backend that cannot start is reported in the table, not as a warning.
        warnings.simplefilter("ignore", RuntimeWarning)
        env = Environment(autoload=not args.no_autoload, backends=backends).open()
    try:
        desc = describe_environment(env)
    finally:
        env.close()
    print(json.dumps(desc, indent=2) if args.json else format_devices(desc))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``aioep`` argument parser: one subcommand per job."""
    parser = argparse.ArgumentParser(
        prog="aioep", description="aioep: ONNX Runtime's plugin-EP device layer for async Python"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "devices", help="list EP devices, memory infos, shared allocators and load errors"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--backend",
        action="append",
        metavar="NAME",
        help="only this installed backend (repeatable); default: all",
    )
    p.add_argument("--no-autoload", action="store_true", help="only the built-in host device")
    p.set_defaults(func=_devices)
    try:
        from ._tools import bench as _bench
    except ImportError:  # pragma: no cover - the bench module is optional
        pass
    else:
        _bench.add_parser(sub)
    _add_plugin_commands(sub)
    return parser


def _add_plugin_commands(sub: Any) -> None:
    """Subcommands from the entry point group ``aioep.commands`` (a broken one is skipped)."""
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group="aioep.commands"), key=lambda e: e.name):
        try:
            ep.load()(sub)
        except Exception as exc:  # a broken plugin must not break the other commands
            print(f"aioep: command {ep.name!r} ({ep.value}) is unavailable: {exc}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m aioep`` and the ``aioep`` console script."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
