"""``python -m aioep check-gpu``: verify the CUDA backend on a GPU in one call, into one JSON file.

It runs, each in a child process (this process never loads the driver):

1. a driver probe: driver and cuda-bindings versions, the driver library's path, every
   GPU's name, UUID, compute capability and memory;
2. the CUDA tests of an aioep checkout (``tests/test_cuda.py``, ``tests/test_cuda_api.py``)
   with pytest, summarised from its JUnit XML (passed, failed, skipped and why);
3. ``benchmarks/cuda_copy.py`` (bandwidth, wake latency, loop lag, 1000 awaiters) and
   ``benchmarks/arena.py`` (the arena's pair rate against CuPy's pool, where CuPy exists);
4. a DLPack exchange with CuPy and PyTorch where they are installed (zero-copy, values).

The summary judges the figures against their targets. ``--emulator`` runs the same steps
on the emulated driver of the checkout's ``tests/cuda_emulator`` (a test double: the
figures are then not judged) so the command itself can be checked without a GPU.

Exit status: 0 when the tests pass and every judged figure meets its target, 1 otherwise,
2 when there is no GPU (and no ``--emulator``) or no checkout to take the tests from.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["FIGURES", "add_parser", "find_checkout", "judge", "main", "run_check"]

_TESTS = ("tests/test_cuda.py", "tests/test_cuda_api.py")
_BENCH = "benchmarks/cuda_copy.py"
_ARENA = "benchmarks/arena.py"


def _get(data: Mapping[str, Any], *path: str) -> Any:
    value: Any = data
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value


FIGURES: list[tuple[str, str, Callable[[Mapping[str, Any]], Any], str, float]] = [
    (
        "pinned_h2d_vs_cupy",
        "pinned 1 GiB host-to-device bandwidth / CuPy's",
        lambda r: _get(r, "cuda_copy", "bandwidth", "h2d_ratio"),
        ">=",
        0.95,
    ),
    (
        "pinned_d2h_vs_cupy",
        "pinned 1 GiB device-to-host bandwidth / CuPy's",
        lambda r: _get(r, "cuda_copy", "bandwidth", "d2h_ratio"),
        ">=",
        0.95,
    ),
    (
        "wake_vs_to_thread",
        "`await stream` wake latency / to_thread(event.synchronize)",
        lambda r: _get(r, "cuda_copy", "latency_us", "ratio_vs_to_thread"),
        "<=",
        0.5,
    ),
    (
        "loop_lag_ms",
        "event-loop lag with 8 GiB of copies in flight (ms)",
        lambda r: _get(r, "cuda_copy", "loop_lag", "max_lag_ms"),
        "<=",
        2.0,
    ),
    (
        "awaiters_threads_constant",
        "1000 awaiters on 8 streams: thread count constant",
        lambda r: _get(r, "cuda_copy", "awaiters", "constant"),
        "==",
        1.0,
    ),
    (
        "arena_vs_cupy_pool",
        "arena alloc+free pair rate on the GPU / CuPy's memory pool",
        lambda r: _get(r, "arena", "gpu", "ratio"),
        ">=",
        0.8,
    ),
]
"""(key, what, how to read it from the results, comparison, target)."""


def judge(results: Mapping[str, Any], *, judged: bool) -> dict[str, dict[str, Any]]:
    """Each figure's value, target and whether it is met (None: not measured or not judged)."""
    out: dict[str, dict[str, Any]] = {}
    for key, what, read, op, target in FIGURES:
        value = read(results)
        met: bool | None = None
        if value is not None and judged:
            v = float(value)
            met = v >= target if op == ">=" else v <= target if op == "<=" else v == target
        entry: dict[str, Any] = {"what": what, "value": value, "target": f"{op} {target:g}"}
        entry["met"] = met
        if key.endswith("_vs_cupy") and _get(results, "cuda_copy", "bandwidth", "baseline") not in (
            None,
            "cupy",
        ):
            entry["note"] = "CuPy is not installed: the baseline is raw cuda.bindings copies"
        if key == "arena_vs_cupy_pool" and _get(results, "arena", "gpu", "skipped"):
            entry["note"] = f"not measured: {_get(results, 'arena', 'gpu', 'skipped')}"
        out[key] = entry
    return out


def find_checkout(start: Sequence[Path] = ()) -> Path | None:
    """The aioep checkout whose CUDA tests and benchmark to run: the first of ``start``, the
    working directory and its parents, and the folders the installed packages live in that
    holds ``tests/test_cuda.py`` and ``benchmarks/cuda_copy.py``."""
    here = Path(__file__).resolve()
    candidates = [*start, Path.cwd(), *Path.cwd().parents, *here.parents]
    try:
        import aioep

        candidates += list(Path(aioep.__file__).resolve().parents)
    except ImportError:  # pragma: no cover - aioep_cuda depends on aioep
        pass
    for folder in candidates:
        if (folder / _TESTS[0]).is_file() and (folder / _BENCH).is_file():
            return folder
    return None


def _emulator_module(checkout: Path) -> Any:
    path = checkout / "tests" / "cuda_emulator" / "__init__.py"
    spec = importlib.util.spec_from_file_location("aioep_check_cuda_emulator", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load the CUDA emulator helper {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _run(
    cmd: Sequence[str], env: Mapping[str, str], cwd: Path, timeout: float
) -> tuple[int, str, float]:
    """Run a child; (exit status, the tail of its output, seconds). 124 on a timeout."""
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            list(cmd),
            env=dict(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else ""
        return 124, (out or "")[-4000:] + f"\n(timed out after {timeout:g} s)", timeout
    return done.returncode, (done.stdout + done.stderr)[-4000:], time.perf_counter() - t0


_PROBE = r"""
import json, sys
out = {}
try:
    import cuda.bindings
    out["bindings_version"] = getattr(cuda.bindings, "__version__", None)
    from aioep_cuda._driver import check, load_driver
    drv = load_driver()
    out["driver_version"] = int(check(drv.cuDriverGetVersion(), "cuDriverGetVersion"))
    out["device_count"] = int(check(drv.cuDeviceGetCount(), "cuDeviceGetCount"))
    import aioep
    env = aioep.Environment(backends=["cuda"]).open()
    try:
        out["devices"] = [dict(d.hardware.metadata)
                          for d in env.ep_devices(ep_name="CUDAExecutionProvider")]
        out["load_error"] = env.load_errors.get("cuda")
    finally:
        env.close()
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
with open("/proc/self/maps") as f:
    libs = sorted({line.split()[-1] for line in f if "/libcuda.so" in line})
out["library"] = libs[0] if libs else None
print(json.dumps(out))
"""

_DLPACK = r"""
import asyncio, json
import numpy as np
import aioep

async def main():
    out = {}
    async with aioep.Environment(backends=["cuda"]) as env:
        gpu = env.ep_devices(ep_name="CUDAExecutionProvider")[0]
        data = np.arange(1 << 20, dtype=np.float32)
        t = env.empty(data.shape, data.dtype, gpu.memory_info(aioep.MemoryType.DEFAULT))
        await env.copy_tensors([data], [t])
        for name in ("cupy", "torch"):
            try:
                lib = __import__(name)
            except ImportError:
                out[name] = {"status": "not installed"}
                continue
            entry = {"version": getattr(lib, "__version__", None)}
            try:
                if name == "cupy":
                    x = lib.from_dlpack(t)
                    ptr, values = x.data.ptr, x.get()
                    y = lib.asarray(t)  # the CUDA array interface
                    entry["cai_zero_copy"] = y.data.ptr == t.data_ptr
                else:
                    if not lib.cuda.is_available():
                        out[name] = {"status": "installed without CUDA", **entry}
                        continue
                    x = lib.from_dlpack(t)
                    ptr, values = x.data_ptr(), x.cpu().numpy()
                entry["zero_copy"] = ptr == t.data_ptr
                entry["values_equal"] = bool(np.array_equal(values, data))
                ok = entry["zero_copy"] and entry["values_equal"]
                entry["status"] = "ok" if ok else "mismatch"
                del x
            except Exception as exc:
                entry["status"] = "failed"
                entry["error"] = f"{type(exc).__name__}: {exc}"
            out[name] = entry
        del t
    return out

print(json.dumps(asyncio.run(main())))
"""


def _last_json(text: str) -> Any:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def _junit(path: Path) -> dict[str, Any]:
    """Counts, failures (with their message) and skip reasons from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    passed = failed = errors = skipped = 0
    failures: list[dict[str, str]] = []
    skips: dict[str, int] = {}
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure")
        error = case.find("error")
        skip = case.find("skipped")
        if problem is not None or error is not None:
            node = problem if problem is not None else error
            assert node is not None
            if problem is not None:
                failed += 1
            else:
                errors += 1
            failures.append({"test": name, "message": (node.get("message") or "")[:500]})
        elif skip is not None:
            skipped += 1
            reason = skip.get("message") or ""
            skips[reason] = skips.get(reason, 0) + 1
        else:
            passed += 1
    return {
        "passed": passed,
        "failed": failed,
        "errors": errors,
        "skipped": skipped,
        "failures": failures,
        "skip_reasons": skips,
    }


def run_check(
    *,
    checkout: Path,
    out: Path,
    emulator: bool = False,
    quick: bool = False,
    tests: bool = True,
    benchmarks: bool = True,
    pytest_args: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every step (see the module docstring), write the summary to ``out``, return it."""
    started = time.perf_counter()
    env = dict(os.environ)
    summary: dict[str, Any] = {
        "aioep_check_gpu": 1,
        "checkout": str(checkout),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "emulated": emulator,
        "sizes": "quick" if quick else "full",
    }
    if emulator:
        module = _emulator_module(checkout)
        library = module.build()
        env = module.child_env(library, env)
        summary["note"] = (
            "ran on the emulated CUDA driver (tests/cuda_emulator, a test double, not a GPU): "
            "the tests and the plumbing are checked, the figures are not judged"
        )
    else:
        env["AIOEP_CUDA_EMULATOR"] = "0"  # the tests must not fall back to the emulator
    py = sys.executable

    log("probing the driver ...")
    rc, text, _ = _run([py, "-c", _PROBE], env, checkout, 300)
    driver = _last_json(text) or {"error": text.strip()[-500:]}
    summary["driver"] = driver
    devices = driver.get("devices") or []
    if not devices:
        summary["ok"] = False
        summary["status"] = "no-gpu"
        summary["duration_s"] = round(time.perf_counter() - started, 2)
        _write(out, summary)
        log(f"no GPU: {driver.get('error') or driver.get('load_error') or 'no CUDA device'}")
        return summary
    names = ", ".join(d.get("name", "?") for d in devices)
    log(f"driver {driver.get('driver_version')} ({driver.get('library')}): {names}")

    with tempfile.TemporaryDirectory(prefix="aioep-check-gpu-") as tmp:
        scratch = Path(tmp)
        if tests:
            log("running the CUDA tests ...")
            junit = scratch / "junit.xml"
            cmd = [py, "-m", "pytest", *_TESTS, "-q", "-p", "no:cacheprovider"]
            cmd += [f"--junitxml={junit}", *pytest_args]
            rc, text, seconds = _run(cmd, env, checkout, 1800)
            result: dict[str, Any] = {"exit_status": rc, "seconds": round(seconds, 2)}
            if junit.is_file():
                result.update(_junit(junit))
            else:
                result["output_tail"] = text[-2000:]
            summary["tests"] = result
            log(
                f"  {result.get('passed', 0)} passed, {result.get('failed', 0)} failed, "
                f"{result.get('errors', 0)} errors, {result.get('skipped', 0)} skipped"
            )
        if benchmarks:
            log("running benchmarks/cuda_copy.py ...")
            bench_json = scratch / "cuda_copy.json"
            cmd = [py, _BENCH, "--json", str(bench_json), *(["--quick"] if quick else [])]
            rc, text, seconds = _run(cmd, env, checkout, 1800)
            if bench_json.is_file():
                summary["cuda_copy"] = json.loads(bench_json.read_text())
            else:
                summary["cuda_copy"] = {"exit_status": rc, "output_tail": text[-2000:]}
            log("running benchmarks/arena.py ...")
            arena_json = scratch / "arena.json"
            cmd = [py, _ARENA, "--json", str(arena_json), *(["--quick"] if quick else [])]
            rc, text, seconds = _run(cmd, env, checkout, 1800)
            if arena_json.is_file():
                summary["arena"] = json.loads(arena_json.read_text())
            else:
                summary["arena"] = {"exit_status": rc, "output_tail": text[-2000:]}
        if emulator:
            summary["dlpack"] = {
                "status": "skipped: CuPy and PyTorch need the real driver (their CUDA runtime "
                "does not run on the emulator)"
            }
        else:
            log("exchanging a tensor with CuPy and PyTorch over DLPack ...")
            rc, text, _ = _run([py, "-c", _DLPACK], env, checkout, 600)
            summary["dlpack"] = _last_json(text) or {"exit_status": rc, "output_tail": text[-2000:]}

    summary["figures"] = judge(summary, judged=not emulator and not quick)
    tests_ok = not tests or (
        summary["tests"].get("failed", 1) == 0
        and summary["tests"].get("errors", 1) == 0
        and summary["tests"].get("passed", 0) > 0
    )
    dlpack = summary.get("dlpack", {})
    dlpack_ok = all(
        not isinstance(v, Mapping) or v.get("status") not in ("failed", "mismatch")
        for v in dlpack.values()
    )
    figures_ok = all(f["met"] is not False for f in summary["figures"].values())
    summary["ok"] = bool(tests_ok and dlpack_ok and figures_ok)
    summary["status"] = "ok" if summary["ok"] else "failed"
    summary["duration_s"] = round(time.perf_counter() - started, 2)
    _write(out, summary)
    for key, fig in summary["figures"].items():
        verdict = {True: "met", False: "NOT MET", None: "not judged"}[fig["met"]]
        log(f"  {key}: {fig['value']} (target {fig['target']}): {verdict}")
    log(f"{summary['status']}: summary written to {out}")
    return summary


def _write(out: Path, summary: Mapping[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2, default=str) + "\n")


def _command(args: argparse.Namespace) -> int:
    extra = list(args.pytest_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    checkout = find_checkout([args.repo] if args.repo else [])
    if checkout is None:
        print(
            "check-gpu: no aioep checkout found (it needs tests/test_cuda.py and "
            "benchmarks/cuda_copy.py): run it from the checkout or pass --repo",
            file=sys.stderr,
        )
        return 2
    summary = run_check(
        checkout=checkout,
        out=args.out,
        emulator=args.emulator,
        quick=args.quick or args.emulator,
        tests=not args.no_tests,
        benchmarks=not args.no_benchmarks,
        pytest_args=extra,
        log=lambda line: print(line, file=sys.stderr),
    )
    if summary.get("status") == "no-gpu":
        return 2
    return 0 if summary["ok"] else 1


def add_parser(sub: Any) -> None:
    """Add ``check-gpu`` to the ``aioep`` command line (entry point group ``aioep.commands``)."""
    p = sub.add_parser(
        "check-gpu",
        help="verify the CUDA backend on a GPU: tests, benchmarks, DLPack; one JSON summary",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("check-gpu.json"),
        help="where to write the JSON summary (default: ./check-gpu.json)",
    )
    p.add_argument("--repo", type=Path, help="the aioep checkout (default: found from here)")
    p.add_argument(
        "--emulator",
        action="store_true",
        help="run on the emulated driver of tests/cuda_emulator (a test double; implies --quick)",
    )
    p.add_argument("--quick", action="store_true", help="small benchmark sizes (not judged)")
    p.add_argument("--no-tests", action="store_true", help="skip the pytest run")
    p.add_argument("--no-benchmarks", action="store_true", help="skip the benchmarks")
    p.add_argument(
        "pytest_args",
        nargs=argparse.REMAINDER,
        help="after --: extra pytest arguments (e.g. -- -k ordering)",
    )
    p.set_defaults(func=_command)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aioep_cuda._check [options]``: the same as ``python -m aioep check-gpu``."""
    parser = argparse.ArgumentParser(prog="aioep")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["check-gpu", *(sys.argv[1:] if argv is None else argv)])
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
