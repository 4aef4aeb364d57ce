"""The API reference renders every public name once: the reference pages list their members
explicitly (in the order a reader needs them), so a name added to ``__all__`` must be added
to a page too."""

from __future__ import annotations

import re
from pathlib import Path

import aioep
import aioep.abc

ROOT = Path(__file__).resolve().parents[2]


def _members(page: str, module: str) -> list[str]:
    """The ``members:`` list of the page's ``::: module`` block."""
    text = (ROOT / "docs" / "reference" / page).read_text()
    block = re.search(rf"^::: {re.escape(module)}\n((?:    .*\n|\n)*)", text, flags=re.M)
    assert block is not None, f"{page} has no '::: {module}' block"
    listed = re.search(r"^      members:\n((?:        - .*\n)+)", block.group(1), flags=re.M)
    assert listed is not None, f"{page}: '::: {module}' lists no members"
    return re.findall(r"- (\w+)", listed.group(1))


def test_the_plugin_reference_lists_every_name_of_aioep_abc_once() -> None:
    listed = _members("abc.md", "aioep.abc")
    assert len(listed) == len(set(listed)), f"abc.md lists a name twice: {listed}"
    assert set(listed) == set(aioep.abc.__all__)


def test_the_user_reference_lists_every_name_of_aioep_but_the_backend_authors() -> None:
    listed = _members("aioep.md", "aioep")
    assert len(listed) == len(set(listed)), f"aioep.md lists a name twice: {listed}"
    backend_only = set(aioep.__all__) - set(listed)
    # What the user page leaves out is a backend author's, documented in aioep.abc.
    assert backend_only <= set(aioep.abc.__all__), backend_only - set(aioep.abc.__all__)
    assert set(listed) <= set(aioep.__all__), set(listed) - set(aioep.__all__)
    # The user's first names come first.
    assert listed[:3] == ["Environment", "current_environment", "copy_tensors"]
