"""``aioep_env``'s machinery: open the environment a test asks for, check what it leaked.

Shared by `aioep.pytest_plugin` (anyio and synchronous tests) and
`aioep._tools.asyncio_fixtures` (pytest-asyncio), so that neither imports the other.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest

from .._environment.environment import Environment
from .pytest_entry import ini

__all__ = [
    "CALL_FAILED",
    "LOOP_SCOPES",
    "check_backends",
    "env_arguments",
    "environment_for",
    "leak_check",
    "quiet_backend_failures",
]

LOOP_SCOPES = ("function", "class", "module", "package", "session")
"""pytest-asyncio's event-loop scopes; ``aioep_env`` has one private fixture per scope."""
CALL_FAILED = pytest.StashKey[bool]()
"""Set on an item whose test call failed: its traceback keeps its locals alive."""


def env_arguments(request: pytest.FixtureRequest) -> tuple[list[str] | None, dict[str, Any]]:
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


def check_backends(env: Environment, names: list[str] | None) -> None:
    """Fail the test for a backend that is not installed; skip it for one that cannot start."""
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


@contextmanager
def quiet_backend_failures() -> Iterator[None]:
    # A backend that cannot start is reported in env.load_errors; check_backends decides.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


@contextmanager
def leak_check(request: pytest.FixtureRequest, env: Environment) -> Iterator[None]:
    """Fail the test for what ``env`` found still alive when it closed (its close report).

    Warnings raised while it closes (a backend whose close failed) are caught, so the close
    always runs to the end, even under ``-W error`` (``warnings.catch_warnings`` also covers
    the worker thread that releases the environment), then re-emitted as they were.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    report = env.close_report
    if report is None or report.clean or request.node.stash.get(CALL_FAILED, False):
        return  # a failed test's traceback holds its locals: that is not a leak
    if ini(request.config, "aioep_leaks", "error") == "warn":
        for line in report.lines():
            warnings.warn(f"{request.node.nodeid}: {line}", ResourceWarning, stacklevel=1)
        return
    found = "\n".join(f"  - {line}" for line in report.lines())
    pytest.fail(
        f"{request.node.nodeid} left aioep resources alive past its environment (aioep_env):\n"
        f"{found}\nclose streams and sessions and drop tensors before the test ends "
        "(ini aioep_leaks = warn reports this as a ResourceWarning instead)",
        pytrace=False,
    )


@asynccontextmanager
async def environment_for(request: pytest.FixtureRequest) -> AsyncIterator[Environment]:
    """The body of ``aioep_env`` for a test that runs on an event loop (anyio or pytest-asyncio).

    Opens the environment off the loop in the fixture's task, so that it is current in the
    test's context, and closes it after the test with the leak check.
    """
    names, options = env_arguments(request)
    env = Environment(backends=names, backend_options=options)
    with quiet_backend_failures():
        await env.__aenter__()
    try:
        check_backends(env, names)
        yield env
    finally:
        with leak_check(request, env):
            await env.aclose()
