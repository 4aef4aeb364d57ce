"""What ``python -m aioep bench`` measured (`BenchReport`: bandwidth and latency points,
pyperf series) and how it is shown: plain-text tables (`format_report`) and a bandwidth
plot (`plot_report`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyperf

__all__ = [
    "BandwidthPoint",
    "BenchReport",
    "LatencyPoint",
    "format_report",
    "plot_report",
    "size_label",
]

KiB, MiB = 1 << 10, 1 << 20
LATENCY_BYTES = 4 * KiB
"""The size of the copies whose latency ``bench`` measures."""


@dataclass(frozen=True)
class BandwidthPoint:
    """Best-of-N copy bandwidth for one device pair and size, with the numpy.copyto baseline."""

    pair: str
    nbytes: int
    aioep_gbps: float
    baseline_gbps: float


@dataclass(frozen=True)
class LatencyPoint:
    """Median latency in microseconds of aioep, of its fair baseline (the same work with
    the same thread hops) and, where there is one, of the naive alternative."""

    name: str
    aioep_us: float
    baseline_us: float
    baseline: str
    naive_us: float = math.nan
    naive: str = ""


@dataclass
class BenchReport:
    """Everything one ``bench`` run measured."""

    bandwidth: list[BandwidthPoint] = field(default_factory=list)
    copy_latency: list[LatencyPoint] = field(default_factory=list)
    wake_latency: list[LatencyPoint] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    load_errors: dict[str, str] = field(default_factory=dict)
    quick: bool = False
    benchmarks: list[pyperf.Benchmark] = field(default_factory=list, repr=False, compare=False)
    """Every timing series as a pyperf benchmark (``--pyperf`` writes them)."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the summary (``--json`` prints it; ``benchmarks`` left out)."""
        data = asdict(replace(self, benchmarks=[]))
        del data["benchmarks"]
        return data

    def dump_pyperf(self, path: str) -> None:
        """Write every timing series as a pyperf benchmark suite (JSON) to ``path``."""
        import pyperf

        pyperf.BenchmarkSuite(self.benchmarks).dump(path, replace=True)


def size_label(n: int) -> str:
    """``4096`` -> ``"4 KiB"``, ``1 << 20`` -> ``"1 MiB"``."""
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def format_report(report: BenchReport) -> str:
    """The plain-text tables: aioep and the baseline side by side, with their ratio."""
    lines = ["devices: " + ", ".join(report.devices)]
    if report.load_errors:
        lines.append(
            "backends offering nothing: "
            + "; ".join(f"{k}: {v}" for k, v in report.load_errors.items())
        )
    lines += [
        "",
        f"{'copy bandwidth (GB/s, best)':<32}{'aioep':>10}{'numpy.copyto':>14}{'ratio':>8}",
    ]
    for p in report.bandwidth:
        ratio = p.aioep_gbps / p.baseline_gbps if p.baseline_gbps else math.nan
        lines.append(
            f"  {p.pair:<20}{size_label(p.nbytes):>10}{p.aioep_gbps:>10.2f}{p.baseline_gbps:>14.2f}{ratio:>8.2f}"
        )
    if report.copy_latency:
        title = f"copy latency, {LATENCY_BYTES // KiB} KiB (us, median)"
        lines += [
            "",
            f"{title:<32}{'aioep':>8}{'fair floor':>12}{'ratio':>8}{'to_thread':>11}{'ratio':>8}",
        ]
        for q in report.copy_latency:
            fair = q.aioep_us / q.baseline_us if q.baseline_us else math.nan
            naive = q.aioep_us / q.naive_us if q.naive_us else math.nan
            lines.append(
                f"  {q.name:<30}{q.aioep_us:>8.1f}{q.baseline_us:>12.1f}{fair:>8.2f}"
                f"{q.naive_us:>11.1f}{naive:>8.2f}"
            )
        floors = sorted({q.baseline for q in report.copy_latency})
        lines.append("  fair floor: the same copy with the same thread hops, for")
        lines.extend(
            f"    {', '.join(q.name for q in report.copy_latency if q.baseline == f)}: {f}"
            for f in floors
        )
    if report.wake_latency:
        title = "wake latency (us, median)"
        base = report.wake_latency[0].baseline
        lines += ["", f"{title:<32}{'aioep':>10}{base:>22}{'ratio':>8}"]
        for q in report.wake_latency:
            ratio = q.aioep_us / q.baseline_us if q.baseline_us else math.nan
            lines.append(f"  {q.name:<30}{q.aioep_us:>10.1f}{q.baseline_us:>22.1f}{ratio:>8.2f}")
        lines.append("  baseline: a persistent thread's call_soon_threadsafe after the same memcpy")
    return "\n".join(lines)


def plot_report(report: BenchReport, path: str) -> None:
    """Write a PNG of bandwidth against transfer size, one line per device pair.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (``pip install "aioep[plot]"``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    pairs = sorted({p.pair for p in report.bandwidth})
    for pair in pairs:
        pts = sorted((p for p in report.bandwidth if p.pair == pair), key=lambda p: p.nbytes)
        ax.plot([p.nbytes for p in pts], [p.aioep_gbps for p in pts], marker="o", label=pair)
    base: dict[int, float] = {}
    for p in report.bandwidth:
        base[p.nbytes] = max(base.get(p.nbytes, 0.0), p.baseline_gbps)
    sizes = sorted(base)
    ax.plot(sizes, [base[s] for s in sizes], "k--", label="numpy.copyto (host)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [size_label(s) for s in sizes])
    ax.set_xlabel("transfer size")
    ax.set_ylabel("GB/s")
    ax.set_title("aioep copy bandwidth by device pair")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
