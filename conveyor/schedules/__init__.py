"""Pipeline schedules as data (pure Python, no torch import)."""

from __future__ import annotations

from conveyor.schedules.core import (
    Action,
    B,
    F,
    Schedule,
    W,
    dependencies,
    execution_order,
    loop_placement,
    make_schedule,
    v_placement,
    validate,
)

__all__ = [
    "Action",
    "B",
    "F",
    "Schedule",
    "W",
    "dependencies",
    "execution_order",
    "loop_placement",
    "make_schedule",
    "v_placement",
    "validate",
]
