"""``python -m aioep bench``: quick runs of the copy/wake micro-benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aioep import InvalidArgument
from aioep._tools.bench import (
    BenchReport,
    format_report,
    parse_backend_options,
    plot_report,
    run_bench,
)

ROOT = Path(__file__).resolve().parents[2]
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
    for heading in (
        "copy bandwidth",
        "numpy.copyto",
        "fair floor",
        "to_thread",
        "call_soon_threadsafe",
        "persistent thread",
    ):
        assert heading in text
    assert json.loads(json.dumps(report.to_json()))["bandwidth"][0]["pair"] == "host->host"


async def test_unknown_device_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="no such device"):
        await run_bench(device="no-such-device", quick=True)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from aioep._tools.bench import BandwidthPoint

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


async def test_statistics_come_from_pyperf(tmp_path: Path) -> None:
    pyperf = pytest.importorskip("pyperf")
    report = await run_bench(device="host", quick=True, sizes=[65536])
    path = tmp_path / "bench.json"
    report.dump_pyperf(str(path))
    suite = {b.get_name(): b for b in pyperf.BenchmarkSuite.load(str(path)).get_benchmarks()}
    copy = suite["copy 64 KiB: host->host"]
    assert copy.get_unit() == "second"
    assert copy.get_nvalue() >= 2
    (point,) = report.bandwidth
    assert point.aioep_gbps == pytest.approx(65536 / min(copy.get_values()) / 1e9)
    (latency,) = report.copy_latency
    assert latency.aioep_us == pytest.approx(suite["latency 4 KiB: host->host"].median() * 1e6)
    # A 4 KiB host copy runs inline: its fair floor is the same copy with no hop either.
    assert latency.baseline == "numpy.copyto + sleep(0)"
    assert latency.baseline_us == pytest.approx(
        suite["latency 4 KiB: numpy.copyto + sleep(0) (beside host->host)"].median() * 1e6
    )
    assert latency.naive_us == pytest.approx(
        suite["latency 4 KiB: to_thread (beside host->host)"].median() * 1e6
    )
    assert "wake: call_soon_threadsafe (beside host)" in suite
    assert "benchmarks" not in report.to_json()


def test_cli_quick_table_with_sim_options(tmp_path: Path) -> None:
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
            "--pyperf",
            str(tmp_path / "bench.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "copy bandwidth" in proc.stdout
    assert "host->host" in proc.stdout
    assert f"pyperf suite written to {tmp_path / 'bench.json'}" in proc.stdout
    assert json.loads((tmp_path / "bench.json").read_text())["benchmarks"]
