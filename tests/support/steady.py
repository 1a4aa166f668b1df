"""Planner profiles with fixed unit times, for tests whose plans must not follow load."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from conveyor.planning import planner
from conveyor.planning.costs import UnitCost


def steady_profile(
    monkeypatch: pytest.MonkeyPatch, unit_time: Callable[[UnitCost], float] = lambda _: 1e-3
) -> None:
    """Make the planner's profiles keep their measured memory but give each unit the
    forward time ``unit_time(unit)`` (its backward twice that), so that plans made one
    after another choose the same cuts whatever the machine's load."""
    measured = planner.profile

    def steady(*args: Any, **kwargs: Any) -> Any:
        prof = measured(*args, **kwargs)
        layers = []
        for unit in prof.layers:
            t = unit_time(unit)
            layers.append(dataclasses.replace(unit, forward=t, forward_plain=t,
                                              backward_input=t, backward_weight=t,
                                              backward=2 * t))  # fmt: skip
        return dataclasses.replace(prof, layers=tuple(layers))

    monkeypatch.setattr(planner, "profile", steady)
