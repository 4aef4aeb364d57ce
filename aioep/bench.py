"""The copy and wake micro-benchmarks of ``python -m aioep bench``, callable from code.

::

    from aioep.bench import format_report, run_bench

    report = await run_bench(device="sim", quick=True)  # under asyncio
    print(format_report(report))

See the command-line guide for what each table measures.
"""

from ._tools.bench import BandwidthPoint as BandwidthPoint
from ._tools.bench import BenchReport as BenchReport
from ._tools.bench import LatencyPoint as LatencyPoint
from ._tools.bench import format_report as format_report
from ._tools.bench import plot_report as plot_report
from ._tools.bench import run_bench as run_bench

__all__ = [
    "BandwidthPoint",
    "BenchReport",
    "LatencyPoint",
    "format_report",
    "plot_report",
    "run_bench",
]
