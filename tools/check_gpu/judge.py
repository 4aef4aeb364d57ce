"""The figures check-gpu reads from the benchmarks' JSON, their targets and the verdicts.

A figure with a target is *judged* on a GPU at full sizes: the run is ok only if it was
measured and met. A *reported* figure (no target) is measured and shown, never judged:
the arena's pair rate against CuPy's pool is one (a reference for the arena's work, not a
gate for the CUDA backend). On the emulated driver, or at quick sizes, nothing is judged;
a figure the emulator cannot measure (a CuPy or PyTorch baseline) is not counted there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["FIGURES", "Figure", "judge"]

Comparison = Literal[">=", "<=", "=="]


def _get(data: Mapping[str, Any], *path: str) -> Any:
    value: Any = data
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


def _path(*path: str) -> Callable[[Mapping[str, Any]], Any]:
    def read(results: Mapping[str, Any]) -> Any:
        return _get(results, *path)

    return read


def _best_wake(r: Mapping[str, Any]) -> float | None:
    lat = _get(r, "cuda_copy", "latency_us") or {}
    default = lat.get("aioep_default")
    others = [lat.get(k) for k in ("aioep_hostfn", "aioep_poll")]
    known = [float(v) for v in others if isinstance(v, (int, float)) and v > 0]
    if not isinstance(default, (int, float)) or len(known) < len(others):
        return None
    return float(default) / min(known)


def _staging_within_bound(r: Mapping[str, Any]) -> float | None:
    stats = _get(r, "cuda_pageable", "aioep_staged", "staging") or {}
    peak, bound = stats.get("peak_bytes"), stats.get("bound_bytes")
    if not isinstance(peak, int) or not isinstance(bound, int):
        return None
    return 1.0 if peak <= bound else 0.0


@dataclass(frozen=True)
class Figure:
    """One figure: its key in the summary, what it is, how to read it from the results,
    its target (``None``: reported, never judged), and whether the emulated driver can
    measure it (not the figures whose baseline is CuPy or PyTorch on the real driver)."""

    key: str
    what: str
    read: Callable[[Mapping[str, Any]], Any]
    target: tuple[Comparison, float] | None
    on_emulator: bool = True
    steps: tuple[str, ...] = ()
    """The steps of ``benchmarks/cuda_copy.py`` it needs (their names in its ``errors``)."""

    def met(self, value: float) -> bool:
        """Whether ``value`` meets the target (call only for a figure with one)."""
        assert self.target is not None
        op, target = self.target
        if op == ">=":
            return value >= target
        if op == "<=":
            return value <= target
        return value == target

    @property
    def target_text(self) -> str | None:
        """``">= 0.95"``; None for a reported figure."""
        return None if self.target is None else f"{self.target[0]} {self.target[1]:g}"


_LATENCY = ("latency", "to_thread")

FIGURES: tuple[Figure, ...] = (
    Figure(
        "pinned_h2d_vs_cupy",
        "pinned 1 GiB host-to-device bandwidth / CuPy's",
        _path("cuda_copy", "bandwidth", "h2d_ratio"),
        (">=", 0.95),
        steps=("bandwidth",),
    ),
    Figure(
        "pinned_d2h_vs_cupy",
        "pinned 1 GiB device-to-host bandwidth / CuPy's",
        _path("cuda_copy", "bandwidth", "d2h_ratio"),
        (">=", 0.95),
        steps=("bandwidth",),
    ),
    Figure(
        "wake_vs_to_thread",
        "`await stream` after a 4 KiB copy (default wake) / to_thread(cuEventSynchronize)",
        _path("cuda_copy", "latency_us", "ratio_vs_to_thread"),
        ("<=", 0.5),
        steps=_LATENCY,
    ),
    Figure(
        "future_vs_await_stream",
        "awaiting the future of a 4 KiB pinned copy / `await stream` after the same copy",
        _path("cuda_copy", "latency_us", "future_vs_await_stream"),
        ("<=", 1.2),
        steps=_LATENCY,
    ),
    Figure(
        "future_vs_to_thread",
        "awaiting the future of a 4 KiB pinned copy / to_thread(cuEventSynchronize)",
        _path("cuda_copy", "latency_us", "future_vs_to_thread"),
        ("<=", 0.5),
        steps=_LATENCY,
    ),
    Figure(
        "default_wake_vs_best",
        "default wake latency / the faster of wake='hostfn' and wake='poll' (10% for noise)",
        _best_wake,
        ("<=", 1.1),
        steps=("latency", "latency_hostfn", "latency_poll"),
    ),
    Figure(
        "loop_lag_ms",
        "event-loop lag with 8 GiB of copies in flight (ms)",
        _path("cuda_copy", "loop_lag", "max_lag_ms"),
        ("<=", 2.0),
        steps=("loop_lag",),
    ),
    Figure(
        "awaiters_threads_constant",
        "1000 awaiters on 8 streams: thread count constant",
        _path("cuda_copy", "awaiters", "constant"),
        ("==", 1.0),
        steps=("awaiters",),
    ),
    Figure(
        "pageable_h2d_vs_cupy",
        "pageable (numpy) 1 GiB host-to-device, staged / CuPy's ndarray.set",
        _path("cuda_pageable", "ratios", "h2d_vs_cupy"),
        (">=", 2.5),
        on_emulator=False,
    ),
    Figure(
        "pageable_h2d_vs_torch",
        "pageable (numpy) 1 GiB host-to-device, staged / PyTorch's .cuda()",
        _path("cuda_pageable", "ratios", "h2d_vs_torch"),
        (">=", 2.5),
        on_emulator=False,
    ),
    Figure(
        "pageable_d2h_vs_cupy",
        "pageable (numpy) 1 GiB device-to-host, staged / CuPy's get",
        _path("cuda_pageable", "ratios", "d2h_vs_cupy"),
        (">=", 1.4),
        on_emulator=False,
    ),
    Figure(
        "pageable_loop_lag_ms",
        "event-loop lag during the staged pageable copies (ms)",
        _path("cuda_pageable", "aioep_staged", "max_lag_ms"),
        ("<=", 2.0),
    ),
    Figure(
        "pageable_staging_within_bound",
        "peak pinned staging memory within its configured bound (1: yes)",
        _staging_within_bound,
        ("==", 1.0),
    ),
    Figure(
        "arena_vs_cupy_pool",
        "arena alloc+free pair rate on the GPU / CuPy's memory pool",
        _path("arena", "gpu", "ratio"),
        None,
        on_emulator=False,
    ),
)
"""Every figure, in the order the summary lists them."""


def _exit_text(part: Mapping[str, Any]) -> str:
    if not part:
        return "its step did not run"
    if part.get("error"):
        return str(part["error"])
    rc = part.get("exit_status")
    tail = str(part.get("output_tail") or "").strip().splitlines()
    last = tail[-1] if tail else ""
    return f"the benchmark exited with status {rc}" + (f": {last}" if last else "")


def _why_missing(results: Mapping[str, Any], figure: Figure) -> str:
    """Why a figure has no value: the benchmark's own error for its section, or its end."""
    key = figure.key
    if key == "arena_vs_cupy_pool":
        arena = results.get("arena") or {}
        skipped = _get(arena, "gpu", "skipped")
        return f"not measured: {skipped or _exit_text(arena)}"
    if key.startswith("pageable_"):
        pageable = results.get("cuda_pageable") or {}
        for name in ("cupy", "torch"):
            skipped = _get(pageable, name, "skipped")
            if skipped and name in key:
                return f"not measured: the {name} baseline was skipped: {skipped}"
        return "not measured: " + _exit_text(pageable)
    bench = results.get("cuda_copy") or {}
    errors = bench.get("errors") or {}
    failed = [f"the {name} step failed: {errors[name]}" for name in figure.steps if name in errors]
    if failed:
        return "not measured: " + "; ".join(failed)
    if bench.get("running"):
        return f"not measured: the benchmark ended during its {bench['running']} step ({_exit_text(bench)})"
    return "not measured: " + _exit_text(bench)


def judge(results: Mapping[str, Any], *, judged: bool) -> dict[str, dict[str, Any]]:
    """Each figure's value, target, whether it is met and why.

    ``met``: True or False when judged, None when not (the emulator, quick sizes, a
    reported figure). ``ok``: False when a judged figure that should have been measured
    was not (on the emulator only the figures it can measure count), or missed its target.
    """
    out: dict[str, dict[str, Any]] = {}
    emulated = bool(results.get("emulated"))
    for figure in FIGURES:
        value = figure.read(results)
        entry: dict[str, Any] = {"what": figure.what, "value": value}
        entry["target"] = figure.target_text
        gate = judged and figure.target is not None
        expected = (figure.on_emulator or not emulated) and figure.target is not None
        if value is None:
            entry["met"] = False if gate else None
            entry["ok"] = not expected
            entry["why"] = _why_missing(results, figure)
            if figure.target is None:
                entry["why"] += " (reported only: not counted)"
            elif not expected:
                entry["why"] += " (the emulator cannot measure it: not counted)"
        elif gate:
            met = figure.met(float(value))
            entry["met"] = entry["ok"] = met
            entry["why"] = (
                "met" if met else f"{float(value):.4g} misses the target {entry['target']}"
            )
        else:
            entry["met"] = None
            entry["ok"] = True
            if figure.target is None:
                entry["why"] = "reported, not judged"
            else:
                place = "the emulated driver" if emulated else "quick sizes"
                entry["why"] = f"measured, not judged ({place})"
        baseline = _get(results, "cuda_copy", "bandwidth", "baseline")
        if figure.key.endswith("_vs_cupy") and baseline not in (None, "cupy"):
            entry["note"] = "CuPy is not installed: the baseline is raw cuda.bindings copies"
        out[figure.key] = entry
    return out
