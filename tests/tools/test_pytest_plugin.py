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

# These user projects use anyio's plugin alone: pytest-asyncio (installed with aioep's test
# extra) is switched off for them, as it is absent from such a project.
ANYIO_ONLY = ("-p", "no:asyncio")

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
    assert [e.value for e in eps] == ["aioep._tools.pytest_entry:entry_point"]


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

        def test_uses_sim_device(sim_device):
            pass

        @pytest.mark.aioep_gpu
        def test_gpu_marker_is_inert():
            pass
        """
    )
    result = pytester.runpytest(*ANYIO_ONLY, "--strict-markers")
    result.assert_outcomes(passed=1, errors=2)
    # The error says how to turn the plugin on, not just that the fixture is missing.
    for fixture in ("aioep_env", "sim_device"):
        result.stdout.fnmatch_lines(
            [f"*fixture '{fixture}' is aioep's pytest plugin's, which is off: run pytest --aioep*"]
        )
    assert "not found" not in result.stdout.str()


def test_off_a_projects_own_fixture_of_that_name_wins(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture
        def aioep_env():
            return "mine"
        """
    )
    pytester.makepyfile("def test_mine(aioep_env):\n    assert aioep_env == 'mine'\n")
    result = pytester.runpytest(*ANYIO_ONLY)
    result.assert_outcomes(passed=1)


def test_off_the_stand_ins_leave_the_plugin_module_unimported(pytester: pytest.Pytester) -> None:
    # Not even a test that asks for a stand-in imports the fixtures module (or its hooks).
    pytester.makepyfile(
        """
        import sys

        def test_asks(aioep_env):
            pass

        def test_untouched():
            assert "aioep.pytest_plugin" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess(*ANYIO_ONLY, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)


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
    result = pytester.runpytest_subprocess(*ANYIO_ONLY, "--strict-markers", "-W", "error", *args)
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
    result = pytester.runpytest(*ANYIO_ONLY, "--aioep")
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
    result = pytester.runpytest(*ANYIO_ONLY)
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
    result = pytester.runpytest(*ANYIO_ONLY, "--aioep")
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
    result = pytester.runpytest(*ANYIO_ONLY, "--aioep", "-rs")
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
    result = pytester.runpytest(*ANYIO_ONLY, "--aioep", "-rs")
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
    result = pytester.runpytest(*ANYIO_ONLY, "--aioep", "--strict-markers", "-rs")
    ok, _ = gpu_available()
    if ok:
        result.assert_outcomes(passed=2)
    else:
        result.assert_outcomes(passed=1, skipped=1)
        result.stdout.fnmatch_lines(["*needs an NVIDIA GPU*"])


# -- one user project, run by each async test plugin ------------------------------------------

PROJECT_CONFTEST = """
import pytest

@pytest.fixture(scope="session")
def seen():
    \"\"\"Every environment a test got, for test_sync.py to check.\"\"\"
    return []
"""

PROJECT_ASYNC_TESTS = """
import numpy as np
import pytest

import aioep

pytestmark = {mark}
kept = []

@pytest.mark.aioep_backends()
async def test_copy(aioep_env, seen):
    seen.append(aioep_env)
    assert aioep_env.state == "open"
    assert aioep.current_environment() is aioep_env
    src = np.arange(16, dtype=np.float32)
    dst = aioep_env.empty(src.shape, src.dtype)
    await aioep.copy_tensors([src], [dst])
    assert np.array_equal(dst.numpy(), src)

@pytest.mark.aioep_backends("sim")
async def test_round_trip(aioep_env, sim_device, seen):
    seen.append(aioep_env)
    host = np.arange(1024, dtype=np.float32)
    x = aioep_env.empty(host.shape, host.dtype, sim_device.memory_info())
    back = np.empty_like(host)
    async with aioep_env.create_sync_stream(sim_device) as stream:
        await aioep.copy_tensors([host], [x], stream=stream)
        await aioep.copy_tensors([x], [back], stream=stream)
    assert np.array_equal(back, host)

@pytest.mark.aioep_backends()
async def test_leaks_a_tensor(aioep_env, seen):
    seen.append(aioep_env)
    kept.append(aioep_env.empty((4,), np.float32))

@pytest.mark.aioep_gpu
async def test_on_gpu(aioep_env, seen):
    seen.append(aioep_env)
"""

PROJECT_SYNC_TESTS = """
import pytest

import aioep

@pytest.mark.aioep_backends()
def test_sync(aioep_env, seen):
    seen.append(aioep_env)
    assert aioep.current_environment() is aioep_env
    assert aioep_env.state == "open"

def test_one_environment_per_test_all_closed(seen):
    assert len(seen) == {expected}
    assert len({{id(env) for env in seen}}) == len(seen)
    assert {{env.state for env in seen}} == {{"closed"}}
"""

ASYNCIO_INI = (
    "[pytest]\naioep = true\nasyncio_mode = {mode}\nasyncio_default_fixture_loop_scope = function\n"
)


def _run_project(
    pytester: pytest.Pytester, *, mark: str, loops: int, ini: str, args: tuple[str, ...]
) -> pytest.RunResult:
    """Run the project; check what every mode shares; ``loops``: runs of each async test."""
    gpu, _ = gpu_available()
    envs_per_loop = 3 + int(gpu)  # copy, round trip, leak (+ the GPU test on a GPU machine)
    pytester.makeini(ini)
    pytester.makeconftest(PROJECT_CONFTEST)
    pytester.makepyfile(
        test_async=PROJECT_ASYNC_TESTS.format(mark=mark),
        test_sync=PROJECT_SYNC_TESTS.format(expected=loops * envs_per_loop + 1),
    )
    result = pytester.runpytest(
        "-p", "no:cacheprovider", "-W", "error", "--setup-show", "-rs", *args
    )
    if SIM_INSTALLED:
        result.assert_outcomes(
            passed=loops * (3 + int(gpu)) + 2, errors=loops, skipped=loops * (1 - int(gpu))
        )
    else:  # test_round_trip errors: the sim backend is not installed
        result.assert_outcomes(
            passed=loops * (2 + int(gpu)),
            failed=1,
            errors=2 * loops,
            skipped=loops * (1 - int(gpu)),
        )
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaks_a_tensor*",
            "*test_leaks_a_tensor* left aioep resources alive past its environment (aioep_env):",
            "*1 live buffer(s) (16 bytes) when the environment closed*",
        ]
    )
    result.stdout.fnmatch_lines(["*SETUP    F _aioep_env_sync*"])
    if not gpu:
        result.stdout.fnmatch_lines(["*SKIPPED*needs an NVIDIA GPU*"])
    return result


def test_project_on_anyio(pytester: pytest.Pytester) -> None:
    result = _run_project(
        pytester,
        mark="pytest.mark.anyio",
        loops=2,
        ini="[pytest]\naioep = true\n",
        args=(*ANYIO_ONLY, "-p", "anyio"),
    )
    result.stdout.fnmatch_lines(["*SETUP    F _aioep_env_anyio*"])
    assert "_aioep_env_asyncio" not in result.stdout.str()


@pytest.mark.parametrize("loop_scope", ["function", "module", "session"])
def test_project_on_pytest_asyncio_strict(pytester: pytest.Pytester, loop_scope: str) -> None:
    result = _run_project(
        pytester,
        mark=f"pytest.mark.asyncio(loop_scope={loop_scope!r})",
        loops=1,
        ini=ASYNCIO_INI.format(mode="strict"),
        args=(),
    )
    result.stdout.fnmatch_lines([f"*SETUP    F _aioep_env_asyncio_{loop_scope}*"])
    assert "_aioep_env_anyio" not in result.stdout.str()


@pytest.mark.parametrize("loop_scope", ["function", "module", "session"])
def test_project_on_pytest_asyncio_auto(pytester: pytest.Pytester, loop_scope: str) -> None:
    # No markers at all; the loop scope comes from pytest-asyncio's ini key.
    result = _run_project(
        pytester,
        mark="[]",
        loops=1,
        ini=ASYNCIO_INI.format(mode="auto") + f"asyncio_default_test_loop_scope = {loop_scope}\n",
        args=(),
    )
    result.stdout.fnmatch_lines([f"*SETUP    F _aioep_env_asyncio_{loop_scope}*"])


def test_anyio_and_pytest_asyncio_in_one_session(pytester: pytest.Pytester) -> None:
    # pytest-asyncio's strict mode leaves anyio's tests (asyncio and trio) to anyio.
    pytester.makeini(ASYNCIO_INI.format(mode="strict"))
    pytester.makeconftest(CONFTEST_BOTH_LOOPS)
    pytester.makepyfile(
        test_anyio=ENV_TEST,
        test_asyncio=ENV_TEST.replace("pytest.mark.anyio", "pytest.mark.asyncio"),
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-W", "error", "--setup-show")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        ["*test_anyio.py::test_env[[]asyncio[]]*", "*test_anyio.py::test_env[[]trio[]]*"]
    )
    result.stdout.fnmatch_lines(["*SETUP    F _aioep_env_asyncio_function*"])


ANYIO_ON_ASYNCIO = """
import pytest

@pytest.fixture
def anyio_backend():
    return "asyncio"
"""

LEAK_ON_FAILURE = """
import numpy as np
import pytest

pytestmark = pytest.mark.anyio

@pytest.mark.aioep_backends()
async def test_fails_holding_a_tensor(aioep_env):
    x = aioep_env.empty((4,), np.float32)
    assert x.shape == (5,)
"""


def test_a_failed_test_is_not_also_reported_as_a_leak(pytester: pytest.Pytester) -> None:
    # Its traceback keeps its locals alive: that is not a leak.
    pytester.makeconftest(ANYIO_ON_ASYNCIO)
    pytester.makepyfile(LEAK_ON_FAILURE)
    result = pytester.runpytest(*ANYIO_ONLY, "--aioep", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert "left aioep resources alive" not in result.stdout.str()


LEAKS_OF_EACH_KIND = """
import numpy as np
import pytest

kept = []

@pytest.mark.anyio
@pytest.mark.aioep_backends()
async def test_leaves_a_stream_open(aioep_env):
    (host,) = aioep_env.ep_devices()
    kept.append(aioep_env.create_sync_stream(host))

@pytest.mark.aioep_backends()
def test_sync_keeps_a_tensor(aioep_env):
    kept.append(aioep_env.empty((8,), np.uint8))

@pytest.mark.anyio
@pytest.mark.aioep_backends()
async def test_tensor_in_a_local_is_no_leak(aioep_env):
    x = aioep_env.empty((8,), np.uint8)
    x.numpy()[:] = 1
"""


def test_the_leak_check_reads_the_close_report(pytester: pytest.Pytester) -> None:
    # Leaks fail the test's teardown, under -W error, without any warning: the environment
    # records them in env.close_report, which the plugin reads. A tensor in a local dies with
    # the test's frame: no leak.
    pytester.makeconftest(ANYIO_ON_ASYNCIO)
    pytester.makepyfile(LEAKS_OF_EACH_KIND)
    result = pytester.runpytest(*ANYIO_ONLY, "--aioep", "-p", "no:cacheprovider", "-W", "error")
    result.assert_outcomes(passed=3, errors=2, warnings=0)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaves_a_stream_open*",
            "*  - <SyncStream host:* open> was still open when the environment closed",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_sync_keeps_a_tensor*",
            "*  - <HostAllocator 'Cpu' live=1> of library 'host' still had 1 live buffer(s) (8 *",
        ]
    )


def test_leaks_can_be_warnings(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\naioep = true\naioep_leaks = warn\n")
    pytester.makeconftest(PROJECT_CONFTEST + ANYIO_ON_ASYNCIO)
    pytester.makepyfile(PROJECT_ASYNC_TESTS.format(mark="pytest.mark.anyio"))
    # (-W: in-process, this suite's filterwarnings=error would apply to the inner run too)
    result = pytester.runpytest(
        *ANYIO_ONLY, "-p", "no:cacheprovider", "-W", "always::ResourceWarning", "-k", "a_tensor"
    )
    result.assert_outcomes(passed=1, warnings=1, deselected=3)
    result.stdout.fnmatch_lines(["*ResourceWarning*1 live buffer(s)*"])
    pytester.makeini("[pytest]\naioep = true\naioep_leaks = maybe\n")
    result = pytester.runpytest(*ANYIO_ONLY, "-p", "no:cacheprovider")
    result.stderr.fnmatch_lines(["*aioep_leaks: expected error or warn, got 'maybe'*"])
