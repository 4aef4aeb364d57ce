"""The ``pytest11`` entry point of aioep: a switch that stays inert until the plugin is enabled.

While the plugin is off, the switch stands in for its fixtures: using ``aioep_env`` or
``sim_device`` fails with how to enable the plugin, not with pytest's bare "fixture
'aioep_env' not found". The stand-ins live here, so the fixtures module stays unimported;
they run only when a test asks for them, and a project's own fixture of that name wins.

It lives apart from `aioep.pytest_plugin` so that installing aioep never imports the
fixtures module into a test run that did not ask for it. ``pytest_plugins =
["aioep.pytest_plugin"]`` in a conftest then imports it fresh; pytest before 9.2 warned
"Module already imported so cannot be rewritten" (an error under ``-W error``) when the
entry point had imported it first.
"""

from __future__ import annotations

import importlib
from typing import Any, NoReturn

import pytest

__all__ = ["add_markers", "add_options", "entry_point", "ini"]

PLUGIN_MODULE = "aioep.pytest_plugin"
HOW_TO_ENABLE = (
    "run pytest --aioep, or set aioep = true under [tool.pytest.ini_options] (pytest.ini: "
    '[pytest]), or add pytest_plugins = ["aioep.pytest_plugin"] to your root conftest.py'
)
_MARKERS = (
    "aioep_backends(*names, options=None): backends (and their options) for the aioep_env fixture",
    "aioep_gpu: needs an NVIDIA GPU that cuInit finds; skipped without one",
)


def add_options(parser: pytest.Parser) -> None:
    """Add ``--aioep`` and the ini keys, once (the switch and the plugin module both ask)."""
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
    parser.addini(
        "aioep_leaks",
        "what aioep_env does with streams, sessions and buffers still alive when it closes: "
        "error (fail the test's teardown, the default) or warn (a ResourceWarning)",
        default="error",
    )


def add_markers(config: pytest.Config) -> None:
    """Register the ``aioep_backends`` and ``aioep_gpu`` markers, once."""
    if getattr(config, "_aioep_markers_added", False):
        return
    config._aioep_markers_added = True  # type: ignore[attr-defined]
    for line in _MARKERS:
        config.addinivalue_line("markers", line)


def ini(config: pytest.Config, name: str, default: Any) -> Any:
    """The ini value ``name``, or ``default`` where nobody added the key."""
    try:
        return config.getini(name)
    except ValueError:  # the entry point is disabled and nobody added the ini key
        return default


def _plugin_off(fixture: str) -> NoReturn:
    pytest.fail(
        f"fixture {fixture!r} is aioep's pytest plugin's, which is off: {HOW_TO_ENABLE}",
        pytrace=False,
    )


class _FixturesWhileOff:
    """Registered in place of the plugin's fixtures while it is off."""

    @pytest.fixture
    def aioep_env(self) -> NoReturn:
        """aioep's pytest plugin is off: enable it with ``--aioep`` (see its guide)."""
        _plugin_off("aioep_env")

    @pytest.fixture
    def sim_device(self) -> NoReturn:
        """aioep's pytest plugin is off: enable it with ``--aioep`` (see its guide)."""
        _plugin_off("sim_device")


class _EntryPoint:
    """The ``pytest11`` entry point: adds the options and enables the plugin on request."""

    def pytest_addoption(self, parser: pytest.Parser) -> None:
        add_options(parser)

    @pytest.hookimpl(tryfirst=True)
    def pytest_configure(self, config: pytest.Config) -> None:
        add_markers(config)
        enabled = bool(config.getoption("aioep", False)) or bool(ini(config, "aioep", False))
        pm = config.pluginmanager
        if pm.has_plugin(PLUGIN_MODULE):  # loaded with -p or a conftest's pytest_plugins
            return
        if enabled:
            pm.register(importlib.import_module(PLUGIN_MODULE), PLUGIN_MODULE)
        else:
            pm.register(_FixturesWhileOff(), "aioep-fixtures-while-off")


entry_point = _EntryPoint()
"""What the ``pytest11`` entry point ``aioep`` names; inert until the plugin is enabled."""
