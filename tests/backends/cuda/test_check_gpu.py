"""``python -m aioep check-gpu`` (aioep-cuda's entry point to the checkout's harness,
``tools/check_gpu``): the whole run on the emulated driver, the checkout it runs from, the
no-GPU answer, and how figures are judged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cuda_emulator import compiler, probe_real_gpu

pytest.importorskip("aioep_cuda")

from check_gpu.benchmarks import run_benchmark
from check_gpu.check import TESTS
from check_gpu.judge import FIGURES, judge
from check_gpu.progress import Progress
from check_gpu.runner import run_tests

ROOT = Path(__file__).resolve().parents[3]


def _check_gpu(
    *args: str, timeout: float = 300, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aioep", "check-gpu", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        check=False,
    )


def test_the_command_is_added_through_the_entry_point() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "aioep", "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0
    assert "check-gpu" in done.stdout


def test_the_checkout_is_the_current_directory_by_default(tmp_path: Path) -> None:
    # Run from elsewhere, it does not look for a checkout: the current directory is none.
    done = _check_gpu("--emulator", "--out", str(tmp_path / "s.json"), cwd=tmp_path)
    assert done.returncode == 2
    assert f"check-gpu: {tmp_path.resolve()} is not an aioep checkout" in done.stderr
    assert "--checkout PATH" in done.stderr
    assert not (tmp_path / "s.json").exists()


@pytest.mark.parametrize(
    ("what", "said"),
    [
        ("nonexistent", "does not exist"),
        ("a-file", "is not a directory"),
        ("empty-folder", "is not an aioep checkout: it has no tools/check_gpu/cli.py"),
    ],
)
def test_a_path_that_is_not_a_checkout_is_refused(tmp_path: Path, what: str, said: str) -> None:
    path = tmp_path / what
    if what == "a-file":
        path.write_text("")
    elif what == "empty-folder":
        path.mkdir()
    done = _check_gpu("--emulator", "--checkout", str(path), "--out", str(tmp_path / "s.json"))
    assert done.returncode == 2, done.stderr
    assert f"check-gpu: {path.resolve()} {said}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "s.json").exists()


def test_a_checkout_without_the_tests_is_refused_by_the_harness(tmp_path: Path) -> None:
    # A folder with the harness but without the tests and benchmarks: the harness says what
    # is missing, before running anything.
    (tmp_path / "tools").symlink_to(ROOT / "tools")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "aioep"\n')
    done = _check_gpu("--checkout", str(tmp_path), "--out", str(tmp_path / "s.json"))
    assert done.returncode == 2, done.stderr
    missing = "is not an aioep checkout: it has no benchmarks/cuda_copy.py"
    assert f"check-gpu: {tmp_path.resolve()} {missing}" in done.stderr
    assert TESTS[0] in done.stderr
    assert not (tmp_path / "s.json").exists()


def test_check_gpu_help_shows_the_harness_options() -> None:
    done = _check_gpu("--help")
    assert done.returncode == 0, done.stderr
    for option in ("--checkout PATH", "--budget", "--emulator", "--test-timeout", "--isolate"):
        assert option in done.stdout


@pytest.mark.skipif(compiler() is None, reason="no C compiler to build the CUDA emulator")
def test_check_gpu_on_the_emulator_writes_one_summary(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    done = _check_gpu("--emulator", "--out", str(out), "--", "-k", "bit_exact and pinned")
    assert out.is_file(), done.stderr
    summary = json.loads(out.read_text())
    assert done.returncode == 0, (done.stderr, summary)
    assert summary["status"] == "ok"
    assert summary["ok"] is True
    assert summary["emulated"] is True
    driver = summary["driver"]
    assert driver["library"].endswith("libcuda.so.1")
    assert "emulator" in driver["devices"][0]["name"]
    tests = summary["tests"]
    assert tests["passed"] >= 8  # bit-exact copies, pinned host, both loops
    assert tests["failed"] == tests["errors"] == tests["crashed"] == tests["hung"] == 0
    assert {t["outcome"] for t in tests["tests"]} <= {"pass", "skip"}
    assert len(tests["children"]) == 1  # nothing crashed: one process ran every test
    bench = summary["cuda_copy"]
    assert bench["sizes"] == "quick"
    assert bench["errors"] == {}
    assert bench["bandwidth"]["h2d_gbps"] > 0
    latency = bench["latency_us"]
    for key in ("aioep_default", "aioep_hostfn", "aioep_poll", "to_thread_event_sync"):
        assert latency[key] > 0
    for key in ("future_streamed", "future_unstreamed", "await_stream"):
        assert latency[key] > 0
    assert bench["awaiters"]["constant"] is True
    assert "pairs" in summary["arena"]
    assert "skipped" in summary["dlpack"]["status"]
    figures = summary["figures"]
    assert set(figures) == {figure.key for figure in FIGURES}
    assert all(f["met"] is None for f in figures.values())  # the emulator: not judged
    assert all(f["ok"] for f in figures.values())
    assert "not counted" in figures["arena_vs_cupy_pool"]["why"]  # CuPy needs a real GPU
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


def _results(**latency: float) -> dict[str, Any]:
    return {
        "cuda_copy": {
            "bandwidth": {"baseline": "cupy", "h2d_ratio": 0.97, "d2h_ratio": 0.9},
            "latency_us": {
                "ratio_vs_to_thread": 0.3,
                "future_vs_await_stream": 1.1,
                "future_vs_to_thread": 0.6,
                "aioep_default": 17.0,
                "aioep_hostfn": 26.0,
                "aioep_poll": 17.4,
                **latency,
            },
            "loop_lag": {"max_lag_ms": 2.5},
            "awaiters": {"constant": True},
            "errors": {},
        },
        "arena": {"gpu": {"skipped": "CuPy is not installed"}},
    }


def test_figures_are_judged_against_their_targets() -> None:
    figures = judge(_results(), judged=True)
    assert figures["pinned_h2d_vs_cupy"]["met"] is True
    assert figures["pinned_d2h_vs_cupy"]["met"] is False
    assert "misses the target >= 0.95" in figures["pinned_d2h_vs_cupy"]["why"]
    assert figures["wake_vs_to_thread"]["met"] is True
    assert figures["future_vs_await_stream"]["met"] is True
    assert figures["future_vs_to_thread"]["met"] is False
    assert figures["default_wake_vs_best"]["met"] is True  # 17.0 / min(26.0, 17.4)
    assert figures["loop_lag_ms"]["met"] is False
    assert figures["awaiters_threads_constant"]["met"] is True
    # A judged figure that was not measured is not ok, and says why.
    assert figures["pageable_loop_lag_ms"]["met"] is False
    assert figures["pageable_loop_lag_ms"]["ok"] is False
    assert "not measured" in figures["pageable_loop_lag_ms"]["why"]
    # The arena's figure is reported, never judged: unmeasured, it says why and counts not.
    arena = figures["arena_vs_cupy_pool"]
    assert (arena["met"], arena["ok"], arena["target"]) == (None, True, None)
    assert "CuPy is not installed" in arena["why"]
    assert "reported only" in arena["why"]
    unjudged = judge(_results(), judged=False)
    assert all(f["met"] is None for f in unjudged.values())
    assert unjudged["pinned_d2h_vs_cupy"]["ok"] is True  # measured: fine when not judged


def test_the_arena_figure_is_reported_not_judged() -> None:
    """Far below CuPy's pool (0.19x on an H200), the arena's pair rate is shown, and the run
    does not fail for it."""
    results = _results()
    results["arena"] = {"gpu": {"ratio": 0.19}}
    arena = judge(results, judged=True)["arena_vs_cupy_pool"]
    assert arena["value"] == 0.19
    assert (arena["met"], arena["ok"], arena["target"]) == (None, True, None)
    assert arena["why"] == "reported, not judged"


def test_a_failed_benchmark_step_costs_only_its_own_figures() -> None:
    results = _results()
    latency = results["cuda_copy"]["latency_us"]
    for key in ("ratio_vs_to_thread", "future_vs_to_thread"):
        del latency[key]
    results["cuda_copy"]["errors"] = {"to_thread": "AttributeError: no attribute 'value'"}
    figures = judge(results, judged=True)
    for key in ("wake_vs_to_thread", "future_vs_to_thread"):
        assert figures[key]["ok"] is False
        assert "to_thread step failed: AttributeError" in figures[key]["why"]
    assert figures["future_vs_await_stream"]["met"] is True
    assert figures["pinned_h2d_vs_cupy"]["met"] is True
    # A benchmark that died: the figures it had not reached say where it ended.
    died = {"cuda_copy": {"running": "loop_lag", "exit_status": -11, "errors": {}}}
    why = judge(died, judged=True)["loop_lag_ms"]["why"]
    assert "ended during its loop_lag step" in why
    # On the emulator only what it can measure counts.
    emulated = {**_results(), "emulated": True}
    figures = judge(emulated, judged=False)
    assert figures["arena_vs_cupy_pool"]["ok"] is True
    assert "not counted" in figures["arena_vs_cupy_pool"]["why"]


_FAKE_TESTS = """
import os, signal, threading, time
import pytest

def test_passes():
    assert True

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.parametrize("n", [0, 1])
def test_crashes(n):
    if n == 1:
        os.kill(os.getpid(), signal.SIGSEGV)

def test_hangs():
    threading.Thread(target=time.sleep, args=(3600,), name="stuck-helper", daemon=True).start()
    time.sleep(3600)

@pytest.mark.parametrize("n", range(4))
def test_always_crashes(n):
    os.abort()

def test_after_the_trouble():
    assert True

@pytest.mark.skip(reason="not today")
def test_skipped():
    pass
"""


def _bare_env() -> dict[str, str]:
    # The fake tests need no plugin: children start faster without them.
    return {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def test_a_crash_or_a_hang_hides_no_other_test(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_fake.py").write_text(_FAKE_TESTS)
    (tmp_path / "tests" / "test_more.py").write_text("def test_in_another_file():\n    pass\n")
    lines: list[str] = []
    summary = run_tests(
        checkout=tmp_path,
        env=_bare_env(),
        files=["tests/test_fake.py", "tests/test_more.py", "tests/test_missing.py"],
        budget=120,
        test_timeout=2,
        max_deaths_per_function=2,
        log=lines.append,
    )
    outcomes = {t["nodeid"].split("::")[1]: t for t in summary["tests"]}
    assert outcomes["test_passes"]["outcome"] == "pass"
    assert outcomes["test_fails"]["outcome"] == "fail"
    assert "one is not two" in outcomes["test_fails"]["message"]
    assert outcomes["test_crashes[0]"]["outcome"] == "pass"
    crash = outcomes["test_crashes[1]"]
    assert crash["outcome"] == "crash"
    assert crash["signal"] == "SIGSEGV"
    assert "test_crashes" in crash["stacks"]  # the stack of the thread that crashed
    assert crash["isolated"]["outcome"] == "crash"  # alone, too: its own crash
    hang = outcomes["test_hangs"]
    assert hang["outcome"] == "hang"
    assert "test_hangs" in hang["stacks"]
    assert hang["stacks"].count("Thread 0x") >= 2  # every thread, the stuck helper too
    # Two cases of a function crashed: its other cases are not run, saying why.
    always = [outcomes[f"test_always_crashes[{n}]"] for n in range(4)]
    assert [a["outcome"] for a in always] == ["crash", "crash", "not-run", "not-run"]
    assert always[0]["signal"] == "SIGABRT"
    assert "2 cases of this function crashed" in always[2]["message"]
    assert "isolated" in always[1]  # the first two cases run again alone
    assert "isolated" not in always[2]
    assert outcomes["test_after_the_trouble"]["outcome"] == "pass"
    assert outcomes["test_in_another_file"]["outcome"] == "pass"
    assert outcomes["test_skipped"]["outcome"] == "skip"
    assert "not today" in outcomes["test_skipped"]["message"]
    assert (summary["crashed"], summary["hung"], summary["failed"]) == (3, 1, 1)
    assert summary["functions"]["tests/test_fake.py::test_crashes"] == "crash"
    assert summary["isolated"] == {
        "tests/test_fake.py::test_crashes": "crash",
        "tests/test_fake.py::test_always_crashes": "crash",
        "tests/test_fake.py::test_hangs": "hang",
    }
    assert summary["missing_files"] == ["tests/test_missing.py"]
    assert summary["ok"] is False
    assert "test_crashes[1] (crash)" in summary["why"]
    assert any("crash: tests/test_fake.py::test_crashes[1]" in line for line in lines)


def test_tests_that_cannot_be_collected_say_why_on_the_console(tmp_path: Path) -> None:
    # Without the test extra a test file cannot import hypothesis: pytest stops before any
    # test, and the console (not only the JSON) says which file and why.
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_fine.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "tests" / "test_needs_extra.py").write_text(
        "import aioep_no_such_test_dependency\n\ndef test_b():\n    pass\n"
    )
    lines: list[str] = []
    summary = run_tests(
        checkout=tmp_path,
        env=_bare_env(),
        files=["tests/test_fine.py", "tests/test_needs_extra.py"],
        budget=120,
        log=lines.append,
    )
    why = (
        "pytest stopped at 1 collection error(s): tests/test_needs_extra.py: "
        "ModuleNotFoundError: No module named 'aioep_no_such_test_dependency'"
    )
    assert [t["outcome"] for t in summary["tests"]] == ["not-run"]
    assert summary["tests"][0]["message"].startswith(why)
    assert why in summary["why"]
    console = "\n".join(lines)
    assert f"1 not run: {why}" in console, console
    assert "pip install -e '.[test]'" in console
    assert "cannot collect tests/test_needs_extra.py: ModuleNotFoundError" in console


def test_the_test_run_shows_its_progress(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_one.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "tests" / "test_two.py").write_text("def test_b():\n    pass\n")
    lines: list[str] = []
    run_tests(
        checkout=tmp_path,
        env=_bare_env(),
        files=["tests/test_one.py", "tests/test_two.py"],
        budget=120,
        log=lines.append,
    )
    starts = [line for line in lines if line.endswith(".py ...")]
    assert len(starts) == 2, lines
    assert starts[0].startswith("  [0/2 tests, ")
    assert "tests/test_one.py" in starts[0]
    assert starts[1].startswith("  [1/2 tests, ")
    assert "tests/test_two.py" in starts[1]


def test_a_long_test_file_reports_that_it_is_still_running() -> None:
    lines: list[str] = []
    progress = Progress(lines.append, every=0.0)  # a line at every poll
    progress.record({"event": "collected", "nodeids": ["t.py::a", "t.py::b"]})
    progress.record({"event": "start", "nodeid": "t.py::a"})
    progress.record({"event": "done", "nodeid": "t.py::a"})
    progress.record({"event": "start", "nodeid": "t.py::b"})
    lines.clear()
    progress.record({"event": "poll"})
    assert len(lines) == 1
    assert lines[0].startswith("  [1/2 tests, ")
    assert lines[0].endswith("still running: t.py::b")


def test_the_time_budget_bounds_the_run(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_slow.py").write_text(
        "import time\n\ndef test_a():\n    time.sleep(3600)\n\ndef test_b():\n    pass\n"
    )
    summary = run_tests(
        checkout=tmp_path,
        env=_bare_env(),
        files=["tests/test_slow.py"],
        budget=6,
        test_timeout=60,
        isolate="none",
        log=lambda line: None,
    )
    outcomes = {t["nodeid"].split("::")[1]: t["outcome"] for t in summary["tests"]}
    assert outcomes["test_a"] == "hang"  # the budget, not the per-test timeout, ended it
    assert "60 s" not in summary["tests"][0]["message"]
    assert outcomes["test_b"] == "not-run"
    assert summary["ok"] is False


_FAKE_BENCH = """
import json, os, signal, sys
path = sys.argv[sys.argv.index("--json") + 1]
data = {"sizes": "quick", "errors": {}, "done": [], "running": None}
if "--resume" in sys.argv:
    data = json.load(open(path))
    data["errors"][data["running"]] = "the process died during this step"
    data["done"].append(data["running"])
for step in ("a", "b", "c"):
    if step in data["done"]:
        continue
    data["running"] = step
    json.dump(data, open(path, "w"))
    if step == "b":
        os.kill(os.getpid(), signal.SIGSEGV)
    data[step] = 1.0
    data["running"] = None
    data["done"].append(step)
json.dump(data, open(path, "w"))
sys.exit(1)
"""


def test_a_benchmark_that_dies_in_a_step_is_resumed_after_it(tmp_path: Path) -> None:
    (tmp_path / "bench.py").write_text(_FAKE_BENCH)
    data = run_benchmark(
        "bench.py",
        py=sys.executable,
        env=dict(os.environ),
        checkout=tmp_path,
        scratch=tmp_path,
        quick=True,
        timeout=60,
        resumable=True,
    )
    assert data["a"] == data["c"] == 1.0  # before and after the step it died in
    assert "b" not in data
    assert data["errors"]["b"] == "the benchmark process died of SIGSEGV during this step"
    assert data["deaths"] == ["b: the process died of SIGSEGV"]
    assert data["exit_status"] == 1
