"""The user-facing pytest plugin (aioep.pytest_plugin), driven through pytester."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from aioep.pytest_plugin import gpu_available

pytest_plugins = ["pytester"]

SIM_INSTALLED = any(
    e.name == "sim" for e in importlib.metadata.entry_points(group="aioep.backends")
)

CONFTEST_BOTH_LOOPS = """
import pytest

@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param
"""

ENV_TEST = """
import numpy as np
import pytest

import aioep

pytestmark = pytest.mark.anyio

@pytest.mark.aioep_backends()
async def test_env(aioep_env):
    assert aioep_env.state == "open"
    assert aioep.current_environment() is aioep_env
    src = np.arange(16, dtype=np.float32)
    dst = aioep_env.empty(src.shape, src.dtype)
    await aioep.copy_tensors([src], [dst])
    assert np.array_equal(dst.numpy(), src)
"""


def test_entry_point_is_registered() -> None:
    eps = [e for e in importlib.metadata.entry_points(group="pytest11") if e.name == "aioep"]
    assert [e.value for e in eps] == ["aioep._pytest_entry:entry_point"]


def test_the_entry_point_leaves_the_plugin_module_unimported() -> None:
    # So that `pytest_plugins = ["aioep.pytest_plugin"]` imports it fresh, and pytest can
    # rewrite its asserts (pytest < 9.2 warned otherwise; see test_enabled[conftest]).
    code = (
        "import sys, importlib.metadata as m; "
        "(ep,) = [e for e in m.entry_points(group='pytest11') if e.name == 'aioep']; "
        "ep.load(); print('aioep.pytest_plugin' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_off_by_default(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST_BOTH_LOOPS)
    pytester.makepyfile(
        """
        import pytest

        def test_uses_env(aioep_env):
            pass

        @pytest.mark.aioep_gpu
        def test_gpu_marker_is_inert():
            pass
        """
    )
    result = pytester.runpytest("--strict-markers")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*fixture 'aioep_env' not found*"])


@pytest.mark.parametrize(
    ("how", "args"),
    [
        ("--aioep", ["--aioep"]),
        ("-p", ["-p", "aioep.pytest_plugin"]),
        ("ini", []),
        ("conftest", []),
    ],
)
def test_enabled(pytester: pytest.Pytester, how: str, args: list[str]) -> None:
    conftest = CONFTEST_BOTH_LOOPS
    if how == "ini":
        pytester.makeini("[pytest]\naioep = true\n")
    if how == "conftest":
        conftest += '\npytest_plugins = ["aioep.pytest_plugin"]\n'
    pytester.makeconftest(conftest)
    pytester.makepyfile(ENV_TEST)
    # In a subprocess, as a user's run: in-process, this suite has already imported
    # aioep.pytest_plugin, and pytest < 9.2 warns that it cannot rewrite it again.
    result = pytester.runpytest_subprocess("--strict-markers", "-W", "error", *args)
    result.assert_outcomes(passed=2)


def test_environment_is_closed_after_each_test(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST_BOTH_LOOPS)
    pytester.makepyfile(
        """
        import pytest

        pytestmark = pytest.mark.anyio
        seen = []

        @pytest.mark.aioep_backends()
        async def test_one(aioep_env):
            seen.append(aioep_env)

        def test_closed():
            assert len(seen) == 2
            assert seen[0] is not seen[1]
            assert [env.state for env in seen] == ["closed", "closed"]
        """
    )
    result = pytester.runpytest("--aioep")
    result.assert_outcomes(passed=3)


def test_ini_backends_and_marker_options(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\naioep = true\naioep_backends =\n    host\n")
    pytester.makeconftest(CONFTEST_BOTH_LOOPS)
    pytester.makepyfile(
        """
        import pytest

        pytestmark = pytest.mark.anyio

        async def test_from_ini(aioep_env):
            assert aioep_env.libraries == ("host",)

        @pytest.mark.aioep_backends(options={"host": {"copy_threads": 1}})
        async def test_marker_options(aioep_env):
            assert aioep_env.libraries == ("host",)
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=4)


def test_unknown_backend_fails_with_a_clear_message(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST_BOTH_LOOPS)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.anyio
        @pytest.mark.aioep_backends("no_such_backend")
        async def test_env(aioep_env):
            pass
        """
    )
    result = pytester.runpytest("--aioep")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*aioep backend 'no_such_backend' is not installed*"])


def test_sim_device(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST_BOTH_LOOPS)
    pytester.makepyfile(
        """
        import numpy as np
        import pytest

        import aioep

        pytestmark = pytest.mark.anyio

        @pytest.mark.aioep_backends("sim")
        async def test_round_trip(aioep_env, sim_device):
            assert sim_device.ep_name == "SimExecutionProvider"
            host = np.arange(1024, dtype=np.float32)
            x = aioep_env.empty(host.shape, host.dtype, sim_device.memory_info())
            back = np.empty_like(host)
            async with aioep_env.create_sync_stream(sim_device) as stream:
                await aioep.copy_tensors([host], [x], stream=stream)
                await aioep.copy_tensors([x], [back], stream=stream)
            assert np.array_equal(back, host)
        """
    )
    result = pytester.runpytest("--aioep", "-rs")
    if SIM_INSTALLED:
        result.assert_outcomes(passed=2)
    else:
        result.assert_outcomes(errors=2)
        result.stdout.fnmatch_lines(["*aioep backend 'sim' is not installed*"])


def test_sim_device_skips_without_sim(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST_BOTH_LOOPS)
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.anyio
        @pytest.mark.aioep_backends()
        async def test_needs_sim(sim_device):
            pass
        """
    )
    result = pytester.runpytest("--aioep", "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*no SimExecutionProvider device*"])


def test_gpu_marker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.aioep_gpu
        def test_on_gpu():
            pass

        def test_anywhere():
            pass
        """
    )
    result = pytester.runpytest("--aioep", "--strict-markers", "-rs")
    ok, _ = gpu_available()
    if ok:
        result.assert_outcomes(passed=2)
    else:
        result.assert_outcomes(passed=1, skipped=1)
        result.stdout.fnmatch_lines(["*needs an NVIDIA GPU*"])
