"""``aioep_env``'s fixtures for tests that pytest-asyncio runs, one per event-loop scope.

`aioep.pytest_plugin` registers this module only when pytest-asyncio is active, and
``aioep_env`` picks the fixture whose ``loop_scope`` is the test's, so the environment
opens and closes on the very loop that runs the test (pytest-asyncio then carries the
context variable that makes it current into the test). Each is function-scoped: one
environment per test, whatever the loop's scope.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from .._environment.environment import Environment
from .pytest_env import LOOP_SCOPES, environment_for

__all__: list[str] = []


def _fixture_for(loop_scope: Any) -> Callable[..., Any]:
    async def env_on_loop(request: pytest.FixtureRequest) -> AsyncIterator[Environment]:
        async with environment_for(request) as env:
            yield env

    env_on_loop.__doc__ = f"``aioep_env`` for a pytest-asyncio test in a {loop_scope}-scoped loop."
    return pytest_asyncio.fixture(
        env_on_loop, loop_scope=loop_scope, name=f"_aioep_env_asyncio_{loop_scope}"
    )


for _scope in LOOP_SCOPES:
    globals()[f"_aioep_env_asyncio_{_scope}"] = _fixture_for(_scope)
