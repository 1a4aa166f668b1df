"""The house of ``conveyor/planning``: every module under 400 lines, and no module's name
taken by something else on the package (``conveyor.planning.estimate`` was a module and
a function at once)."""

from __future__ import annotations

import importlib
import pkgutil
import types
from pathlib import Path

import conveyor.planning as planning


def test_every_module_is_small_and_no_module_is_rebound() -> None:
    names = [m.name for m in pkgutil.iter_modules(planning.__path__)]
    assert {"cluster", "devices", "machine", "prediction", "memory"} <= set(names)
    for name in names:
        module = importlib.import_module(f"conveyor.planning.{name}")
        lines = len(Path(str(module.__file__)).read_text().splitlines())
        assert lines < 400, (name, lines)
        bound = getattr(planning, name)
        assert isinstance(bound, types.ModuleType) and bound is module, name
