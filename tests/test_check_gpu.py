"""``python -m aioep check-gpu`` (aioep-cuda's one-call GPU verification): the whole run on the
emulated driver, the no-GPU answer, and how figures are judged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cuda_emulator import compiler, probe_real_gpu

pytest.importorskip("aioep_cuda")

from aioep_cuda._check import FIGURES, find_checkout, judge

ROOT = Path(__file__).resolve().parent.parent


def _check_gpu(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aioep", "check-gpu", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )


def test_the_command_is_added_through_the_entry_point() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "aioep", "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0
    assert "check-gpu" in done.stdout


def test_the_checkout_is_found() -> None:
    assert find_checkout() == ROOT


@pytest.mark.skipif(compiler() is None, reason="no C compiler to build the CUDA emulator")
def test_check_gpu_on_the_emulator_writes_one_summary(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    done = _check_gpu("--emulator", "--out", str(out), "--", "-k", "bit_exact and pinned")
    assert out.is_file(), done.stderr
    summary = json.loads(out.read_text())
    assert done.returncode == 0, (done.stderr, summary)
    assert summary["status"] == "ok"
    assert summary["emulated"] is True
    driver = summary["driver"]
    assert driver["library"].endswith("libcuda.so.1")
    assert "emulator" in driver["devices"][0]["name"]
    tests = summary["tests"]
    assert tests["passed"] >= 8  # bit-exact copies, pinned host, both loops
    assert tests["failed"] == tests["errors"] == 0
    bench = summary["cuda_copy"]
    assert bench["sizes"] == "quick"
    assert bench["bandwidth"]["h2d_gbps"] > 0
    assert bench["latency_us"]["aioep_hostfn"] > 0
    assert bench["awaiters"]["constant"] is True
    assert "pairs" in summary["arena"]
    assert "skipped" in summary["dlpack"]["status"]
    assert set(summary["figures"]) == {key for key, *_ in FIGURES}
    assert all(f["met"] is None for f in summary["figures"].values())  # the emulator: not judged
    assert "summary written" in done.stderr


def test_without_a_gpu_it_says_so(tmp_path: Path) -> None:
    real, said = probe_real_gpu()
    if real:
        pytest.skip(f"a GPU is present ({said})")
    out = tmp_path / "summary.json"
    done = _check_gpu("--out", str(out), "--no-tests", "--no-benchmarks")
    assert done.returncode == 2
    summary = json.loads(out.read_text())
    assert summary["status"] == "no-gpu"
    assert summary["ok"] is False
    assert summary["driver"].get("error") or summary["driver"].get("load_error")


def test_figures_are_judged_against_their_targets() -> None:
    results = {
        "cuda_copy": {
            "bandwidth": {"baseline": "cupy", "h2d_ratio": 0.97, "d2h_ratio": 0.9},
            "latency_us": {"ratio_vs_to_thread": 0.3},
            "loop_lag": {"max_lag_ms": 2.5},
            "awaiters": {"constant": True},
        },
        "arena": {"gpu": {"skipped": "CuPy is not installed"}},
    }
    figures = judge(results, judged=True)
    assert figures["pinned_h2d_vs_cupy"]["met"] is True
    assert figures["pinned_d2h_vs_cupy"]["met"] is False
    assert figures["wake_vs_to_thread"]["met"] is True
    assert figures["loop_lag_ms"]["met"] is False
    assert figures["awaiters_threads_constant"]["met"] is True
    assert figures["arena_vs_cupy_pool"]["met"] is None
    assert "CuPy is not installed" in figures["arena_vs_cupy_pool"]["note"]
    assert all(f["met"] is None for f in judge(results, judged=False).values())
