"""A pytest plugin for code that uses aioep: environment and device fixtures, a GPU marker.

Installing aioep registers an entry point in the ``pytest11`` group, but the
plugin stays **off** until you enable it, so aioep never changes a test suite
that did not ask for it. Enable it in one of these ways::

    pytest --aioep                               # on the command line
    [tool.pytest.ini_options]                    # or in pyproject.toml / pytest.ini
    aioep = true
    pytest -p aioep.pytest_plugin                # or load the module explicitly
    pytest_plugins = ["aioep.pytest_plugin"]     # (in your root conftest.py)

The entry point is a small switch object (:data:`entry_point`, kept in a module of
its own so that this one is imported only on request) that only adds the
``--aioep`` option and the ini keys; when the plugin is enabled it registers this
module, which holds the fixtures and hooks. Loading the module explicitly
registers it directly; both ways can be combined without conflict.

Once enabled you get:

* ``aioep_env``: an open :class:`aioep.Environment` per test (async fixture;
  mark the test with ``pytest.mark.anyio``). Backends come from the marker
  ``@pytest.mark.aioep_backends("sim", options={"sim": {...}})``, else from the
  ini key ``aioep_backends``, else every installed backend. A chosen backend
  that is installed but cannot start (no driver) skips the test; one that is
  not installed fails it.
* ``sim_device``: the first ``SimExecutionProvider`` device of ``aioep_env``
  (skips the test when the sim backend offers none).
* ``@pytest.mark.aioep_gpu``: skips the test unless ``cuInit`` finds an NVIDIA
  GPU (through ``cuda.bindings`` when it is importable).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from ._device import EpDevice
from ._environment import Environment
from ._pytest_entry import add_markers, add_options, entry_point, ini

__all__ = ["entry_point", "gpu_available"]

SIM_EP_NAME = "SimExecutionProvider"


# -- the plugin proper (active once this module is registered) ------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--aioep`` and the ini keys (once, whoever registers first)."""
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``aioep_backends`` and ``aioep_gpu`` markers."""
    add_markers(config)


@functools.lru_cache(maxsize=1)
def gpu_available() -> tuple[bool, str]:
    """Whether ``cuInit`` finds an NVIDIA GPU, and if not, why (cached for the session)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return False, "cuda.bindings is not installed (pip install cuda-bindings)"
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False, f"cuInit failed: {err.name}"
        err, count = driver.cuDeviceGetCount()
        if err != driver.CUresult.CUDA_SUCCESS or count < 1:
            return False, "cuInit found no CUDA device"
    except Exception as exc:  # no driver library at all
        return False, f"no CUDA driver: {type(exc).__name__}: {exc}"
    return True, f"{count} CUDA device(s)"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip ``aioep_gpu`` tests on machines without a GPU."""
    if item.get_closest_marker("aioep_gpu") is not None:
        ok, why = gpu_available()
        if not ok:
            pytest.skip(f"needs an NVIDIA GPU: {why}")


def _env_arguments(request: pytest.FixtureRequest) -> tuple[list[str] | None, dict[str, Any]]:
    marker = request.node.get_closest_marker("aioep_backends")
    if marker is not None:
        names = [str(n) for n in marker.args]
        options = marker.kwargs.get("options") or {}
        if not isinstance(options, Mapping):
            raise pytest.UsageError(
                f"aioep_backends marker on {request.node.nodeid}: options must be a mapping of "
                f"backend name -> options, got {options!r}"
            )
        return names, {str(k): dict(v) for k, v in options.items()}
    configured = [str(n) for n in ini(request.config, "aioep_backends", [])]
    return (configured or None), {}


@pytest.fixture
async def aioep_env(
    request: pytest.FixtureRequest, anyio_backend: object
) -> AsyncIterator[Environment]:
    """An open :class:`aioep.Environment` for one test, closed after it.

    Backends: the test's ``aioep_backends`` marker, else the ``aioep_backends``
    ini key, else every installed backend. The environment is current inside
    the test, so ``aioep.copy_tensors`` and ``aioep.current_environment()`` find it.
    """
    names, options = _env_arguments(request)
    env = Environment(backends=names, backend_options=options)
    with warnings.catch_warnings():
        # A backend that cannot start is reported in env.load_errors; decide below.
        warnings.simplefilter("ignore", RuntimeWarning)
        env.open()
    try:
        for name in names or ():
            why = env.load_errors.get(name)
            if why is None or name in env.libraries:
                continue
            if why.startswith("no backend named"):
                pytest.fail(
                    f"aioep backend {name!r} is not installed (entry-point group aioep.backends)",
                    pytrace=False,
                )
            pytest.skip(f"aioep backend {name!r} cannot start here: {why}")
        yield env
    finally:
        await env.aclose()


@pytest.fixture
def sim_device(aioep_env: Environment) -> EpDevice:
    """The first ``SimExecutionProvider`` device of ``aioep_env`` (skips when there is none)."""
    for dev in aioep_env.ep_devices():
        if dev.ep_name == SIM_EP_NAME:
            return dev
    why = aioep_env.load_errors.get("sim", "the sim backend is not in this environment")
    pytest.skip(f"no {SIM_EP_NAME} device: {why} (pip install aioep-sim)")
