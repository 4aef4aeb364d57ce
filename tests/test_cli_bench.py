"""``python -m aioep bench``: quick runs of the copy/wake micro-benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aioep import InvalidArgument
from aioep._bench import (
    BenchReport,
    format_report,
    parse_backend_options,
    plot_report,
    run_bench,
)

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    """The bench compares against asyncio's own primitives: it runs under asyncio only."""
    return "asyncio"


def test_parse_backend_options() -> None:
    assert parse_backend_options(["sim.bandwidth_gbps=8", "sim.latency_us=20", "host.x=1"]) == {
        "sim": {"bandwidth_gbps": "8", "latency_us": "20"},
        "host": {"x": "1"},
    }
    with pytest.raises(InvalidArgument, match=r"BACKEND\.KEY=VALUE"):
        parse_backend_options(["bandwidth_gbps=8"])


async def test_quick_run_on_host_has_every_section() -> None:
    report = await run_bench(device="host", quick=True, sizes=[4096, 65536])
    assert report.devices == ["host (host)"]
    assert [(p.pair, p.nbytes) for p in report.bandwidth] == [
        ("host->host", 4096),
        ("host->host", 65536),
    ]
    assert all(p.aioep_gbps > 0 and p.baseline_gbps > 0 for p in report.bandwidth)
    assert [q.name for q in report.copy_latency] == ["host->host"]
    assert [q.name for q in report.wake_latency] == ["host"]
    text = format_report(report)
    for heading in ("copy bandwidth", "numpy.copyto", "to_thread", "call_soon_threadsafe"):
        assert heading in text
    assert json.loads(json.dumps(report.to_json()))["bandwidth"][0]["pair"] == "host->host"


async def test_unknown_device_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="no such device"):
        await run_bench(device="no-such-device", quick=True)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from aioep._bench import BandwidthPoint

    report = BenchReport(
        bandwidth=[
            BandwidthPoint("host->host", 4096, 1.0, 2.0),
            BandwidthPoint("host->host", 1 << 20, 5.0, 9.0),
        ]
    )
    out = tmp_path / "bw.png"
    plot_report(report, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_quick_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aioep", "bench", "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    pairs = {p["pair"] for p in data["bandwidth"]}
    assert "host->host" in pairs
    if any(d.startswith("sim:") for d in data["devices"]):
        assert {"host->sim:0", "sim:0->host"} <= pairs
    assert data["quick"] is True


def test_cli_quick_table_with_sim_options() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aioep",
            "bench",
            "--quick",
            "--device",
            "host",
            "-o",
            "sim.latency_us=5",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "copy bandwidth" in proc.stdout
    assert "host->host" in proc.stdout
