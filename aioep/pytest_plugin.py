"""A pytest plugin for code that uses aioep: environment and device fixtures, a GPU marker.

Installing aioep registers an entry point in the ``pytest11`` group, but the
plugin stays **off** until you enable it, so aioep never changes a test suite
that did not ask for it. Enable it in one of these ways::

    pytest --aioep                               # on the command line
    [tool.pytest.ini_options]                    # or in pyproject.toml / pytest.ini
    aioep = true
    pytest -p aioep.pytest_plugin                # or load the module explicitly
    pytest_plugins = ["aioep.pytest_plugin"]     # (in your root conftest.py)

The entry point is a small switch object (:data:`entry_point`) that only adds
the ``--aioep`` option and the ini keys; when the plugin is enabled it registers
this module, which holds the fixtures and hooks. Loading the module explicitly
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
import sys
import warnings
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from ._device import EpDevice
from ._environment import Environment

__all__ = ["entry_point", "gpu_available"]

_MODULE = __name__
SIM_EP_NAME = "SimExecutionProvider"
_MARKERS = (
    "aioep_backends(*names, options=None): backends (and their options) for the aioep_env fixture",
    "aioep_gpu: needs an NVIDIA GPU that cuInit finds; skipped without one",
)


def _add_options(parser: pytest.Parser) -> None:
    # Both the entry-point switch and this module call this; add the options once.
    if getattr(parser, "_aioep_options_added", False):
        return
    parser._aioep_options_added = True  # type: ignore[attr-defined]
    group = parser.getgroup("aioep", "aioep fixtures and markers")
    group.addoption(
        "--aioep",
        action="store_true",
        default=False,
        help="enable the aioep pytest plugin (fixtures aioep_env, sim_device; marker aioep_gpu)",
    )
    parser.addini("aioep", "enable the aioep pytest plugin", type="bool", default=False)
    parser.addini(
        "aioep_backends",
        "backends for the aioep_env fixture when a test has no aioep_backends marker "
        "(default: every installed backend)",
        type="linelist",
        default=[],
    )


def _add_markers(config: pytest.Config) -> None:
    if getattr(config, "_aioep_markers_added", False):
        return
    config._aioep_markers_added = True  # type: ignore[attr-defined]
    for line in _MARKERS:
        config.addinivalue_line("markers", line)


def _ini(config: pytest.Config, name: str, default: Any) -> Any:
    try:
        return config.getini(name)
    except ValueError:  # the entry point is disabled and nobody added the ini key
        return default


class _EntryPoint:
    """The ``pytest11`` entry point: adds the options and enables the plugin on request."""

    def pytest_addoption(self, parser: pytest.Parser) -> None:
        _add_options(parser)

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        _add_markers(config)
        enabled = bool(config.getoption("aioep", False)) or bool(_ini(config, "aioep", False))
        if enabled and not config.pluginmanager.has_plugin(_MODULE):
            config.pluginmanager.register(sys.modules[_MODULE], _MODULE)


entry_point = _EntryPoint()
"""What the ``pytest11`` entry point ``aioep`` names; inert until the plugin is enabled."""


# -- the plugin proper (active once this module is registered) ------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--aioep`` and the ini keys (once, whoever registers first)."""
    _add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``aioep_backends`` and ``aioep_gpu`` markers."""
    _add_markers(config)


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
    configured = [str(n) for n in _ini(request.config, "aioep_backends", [])]
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
