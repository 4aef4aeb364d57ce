"""No dataclass in aioep or its backends has a mutable or unhashable default.

Python 3.11 refuses a dataclass whose field default is unhashable (``ValueError: mutable
default ... use default_factory``) when the class is *defined*, so one such default makes
``import aioep`` fail there while 3.10 (no check) and 3.12+ (a hashable ``mappingproxy``
type) import fine. This checks every field default on whichever Python runs the suite.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from types import ModuleType

import pytest

_PACKAGES = ["aioep", "aioep_sim", "aioep_cuda", "aioep_ort"]


def _modules() -> list[ModuleType]:
    found = []
    for name in _PACKAGES:
        try:
            package = importlib.import_module(name)
        except ImportError:  # a backend that is not installed
            continue
        found.append(package)
        for info in pkgutil.walk_packages(package.__path__, prefix=f"{name}."):
            if info.name.endswith("__main__"):
                continue
            found.append(importlib.import_module(info.name))
    return found


def _dataclasses() -> list[type]:
    classes = {}
    for module in _modules():
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and dataclasses.is_dataclass(value)
                and value.__module__ == module.__name__
            ):
                classes[f"{value.__module__}.{value.__qualname__}"] = value
    return [classes[name] for name in sorted(classes)]


def test_the_walk_finds_the_dataclasses() -> None:
    names = {f"{c.__module__}.{c.__qualname__}" for c in _dataclasses()}
    assert "aioep._session.plan.PlanStep" in names
    assert len(names) >= 10


@pytest.mark.parametrize("cls", _dataclasses(), ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_every_field_default_is_hashable(cls: type) -> None:
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING:
            continue
        try:
            hash(f.default)
        except TypeError:
            pytest.fail(
                f"{cls.__qualname__}.{f.name} defaults to an unhashable "
                f"{type(f.default).__name__} (Python 3.11 refuses the class): use default_factory"
            )
