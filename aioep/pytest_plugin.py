"""A pytest plugin for code that uses aioep: environment and device fixtures, a GPU marker.

Installing aioep registers an entry point in the ``pytest11`` group, but the
plugin stays **off** until you enable it, so aioep never changes a test suite
that did not ask for it. Enable it in one of these ways::

    pytest --aioep                               # on the command line
    [tool.pytest.ini_options]                    # or in pyproject.toml / pytest.ini
    aioep = true
    pytest -p aioep.pytest_plugin                # or load the module explicitly
    pytest_plugins = ["aioep.pytest_plugin"]     # (in your root conftest.py)

The entry point is a small switch object ([`entry_point`][aioep.pytest_plugin.entry_point], kept in
a module of its own so that this one is imported only on request) that only adds the
``--aioep`` option and the ini keys; when the plugin is enabled it registers this
module, which holds the fixtures and hooks. Loading the module explicitly
registers it directly; both ways can be combined without conflict.

Once enabled you get:

* ``aioep_env``: an open [`aioep.Environment`][aioep.Environment] per test, opened and closed
  on the event loop that runs the test: anyio's (``pytest.mark.anyio``, asyncio
  or trio), pytest-asyncio's (``pytest.mark.asyncio`` or its auto mode, in the
  test's loop scope), or none for a synchronous test. Backends come from the
  marker ``@pytest.mark.aioep_backends("sim", options={"sim": {...}})``, else from
  the ini key ``aioep_backends``, else every installed backend. A chosen backend
  that is installed but cannot start (no driver) skips the test; one that is not
  installed fails it. Streams, sessions or buffers still alive when the
  environment closes fail the test's teardown (ini ``aioep_leaks = warn`` turns
  that into a `ResourceWarning`).
* ``sim_device``: the first ``SimExecutionProvider`` device of ``aioep_env``
  (skips the test when the sim backend offers none).
* ``@pytest.mark.aioep_gpu``: skips the test unless ``cuInit`` finds an NVIDIA
  GPU (through ``cuda.bindings`` when it is importable).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import AsyncIterator, Generator, Iterator

import pytest

from ._environment.environment import Environment
from ._plugin.device import EpDevice
from ._tools.pytest_entry import add_markers, add_options, entry_point, ini
from ._tools.pytest_env import (
    CALL_FAILED,
    LOOP_SCOPES,
    check_backends,
    env_arguments,
    environment_for,
    leak_check,
    quiet_backend_failures,
)

__all__ = ["entry_point", "gpu_available"]

SIM_EP_NAME = "SimExecutionProvider"
_ASYNCIO_FIXTURES = "aioep._tools.asyncio_fixtures"
_PYTEST_ASYNCIO_NAMES = ("asyncio", "pytest_asyncio.plugin", "pytest_asyncio")


# -- the plugin proper (active once this module is registered) ------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add ``--aioep`` and the ini keys (once, whoever registers first)."""
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers, and ``aioep_env``'s pytest-asyncio fixtures where it is active."""
    add_markers(config)
    leaks = ini(config, "aioep_leaks", "error")
    if leaks not in ("error", "warn"):
        raise pytest.UsageError(f"ini aioep_leaks: expected error or warn, got {leaks!r}")
    pm = config.pluginmanager
    if any(pm.has_plugin(n) for n in _PYTEST_ASYNCIO_NAMES) and not pm.has_plugin(
        _ASYNCIO_FIXTURES
    ):
        # Imported only here: pytest_asyncio is then already imported (and rewritten) by pytest.
        pm.register(importlib.import_module(_ASYNCIO_FIXTURES), _ASYNCIO_FIXTURES)


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Note a failed test call: its traceback keeps its locals (and their tensors) alive."""
    report = yield
    if report.when == "call" and report.failed:
        item.stash[CALL_FAILED] = True
    return report


# -- aioep_env: one environment per test, on the loop that runs the test ---------------------


@pytest.fixture
async def _aioep_env_anyio(
    request: pytest.FixtureRequest, anyio_backend: object
) -> AsyncIterator[Environment]:
    """``aioep_env`` for a test that anyio's plugin runs (asyncio or trio)."""
    async with environment_for(request) as env:
        yield env


@pytest.fixture
def _aioep_env_sync(request: pytest.FixtureRequest) -> Iterator[Environment]:
    """``aioep_env`` for a synchronous test: opened and closed with the blocking calls."""
    names, options = env_arguments(request)
    env = Environment(backends=names, backend_options=options)
    with quiet_backend_failures():
        env.open()
    try:
        check_backends(env, names)
        yield env
    finally:
        with leak_check(request, env):
            env.close()


def _runs_on_pytest_asyncio(item: pytest.Item) -> bool:
    if not item.config.pluginmanager.has_plugin(_ASYNCIO_FIXTURES):
        return False
    from pytest_asyncio import is_async_test

    return bool(is_async_test(item))


def _env_fixture_name(request: pytest.FixtureRequest) -> str:
    """Which of ``aioep_env``'s private fixtures opens the environment for this test."""
    item = request.node
    if _runs_on_pytest_asyncio(item):
        marker = item.get_closest_marker("asyncio")
        kwargs = marker.kwargs if marker is not None else {}
        scope = kwargs.get("loop_scope") or kwargs.get("scope")
        scope = scope or request.config.getini("asyncio_default_test_loop_scope") or "function"
        if scope not in LOOP_SCOPES:
            raise pytest.UsageError(f"{item.nodeid}: unknown pytest-asyncio loop scope {scope!r}")
        return f"_aioep_env_asyncio_{scope}"
    if "anyio_backend" in request.fixturenames:
        return "_aioep_env_anyio"
    obj = getattr(item, "obj", None)
    if inspect.iscoroutinefunction(obj):
        pytest.fail(
            f"{item.nodeid} is async but no plugin runs it: mark it with pytest.mark.anyio or "
            "pytest.mark.asyncio (pytest-asyncio), or use an auto mode",
            pytrace=False,
        )
    return "_aioep_env_sync"


@pytest.fixture
def aioep_env(request: pytest.FixtureRequest) -> Environment:
    """An open [`aioep.Environment`][aioep.Environment] for one test, closed after it.

    It is opened on the event loop that runs the test (anyio's, pytest-asyncio's in
    the test's loop scope, or none for a synchronous test), so it is current inside
    the test: ``aioep.copy_tensors`` and ``aioep.current_environment()`` find it.
    Backends: the test's ``aioep_backends`` marker, else the ``aioep_backends`` ini
    key, else every installed backend. Streams, sessions and buffers the test leaves
    alive fail its teardown (or warn, with ini ``aioep_leaks = warn``).
    """
    env: Environment = request.getfixturevalue(_env_fixture_name(request))
    return env


@pytest.fixture
def sim_device(aioep_env: Environment) -> EpDevice:
    """The first ``SimExecutionProvider`` device of ``aioep_env`` (skips when there is none)."""
    for dev in aioep_env.ep_devices():
        if dev.ep_name == SIM_EP_NAME:
            return dev
    why = aioep_env.load_errors.get("sim", "the sim backend is not in this environment")
    pytest.skip(f"no {SIM_EP_NAME} device: {why} (pip install aioep-sim)")
