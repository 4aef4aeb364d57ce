"""Summarize several runs of one benchmark: the min and the median of each ratio's per-run
values (each run's ratio is already a ratio of medians measured in one phase).

Usage: ``python benchmarks/summarize.py results/streams-1.json results/streams-2.json ...``
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def ratios(node: Any, path: str = "") -> Iterator[tuple[str, float, Any]]:
    """(section/ratio name, value, target) for every ratio in a result; a section's target
    belongs to its first ratio (the one against the fair baseline)."""
    if isinstance(node, dict):
        target = node.get("target", node.get("target_ratio"))
        for i, (name, value) in enumerate((node.get("ratios") or {}).items()):
            yield f"{path}: {name}", float(value), target if i == 0 else None
        for key, child in node.items():
            if key != "ratios":
                yield from ratios(child, f"{path}/{key}" if path else key)


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__)
        return 2
    values: dict[str, list[float]] = {}
    targets: dict[str, Any] = {}
    for path in paths:
        for name, value, target in ratios(json.loads(Path(path).read_text())):
            values.setdefault(name, []).append(value)
            targets[name] = target
    print(f"{len(paths)} runs: min and median of the runs' ratios (each a ratio of medians)")
    for name, vals in values.items():
        target = f"  target {targets[name]}" if targets[name] is not None else ""
        runs = ", ".join(f"{v:.2f}" for v in vals)
        print(
            f"  {name}\n      min {min(vals):.2f}x  median {statistics.median(vals):.2f}x"
            f"  (runs: {runs}){target}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
