"""Values worked out from a schedule once and kept while it lives: :class:`PerSchedule`.

A :class:`~conveyor.schedules.core.Schedule` is immutable, so what is computed from it
(the simulator's plan, its peak activations) holds for as long as that object exists.
Keyed by identity (hashing a schedule walks every action), and dropped with the schedule.

Pure Python (no torch import).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from conveyor.schedules.core import Schedule

T = TypeVar("T")


class PerSchedule(Generic[T]):
    """``make(schedule)``, made on first use for each schedule and kept while it lives."""

    def __init__(self, make: Callable[[Schedule], T]) -> None:
        self.make = make
        self.kept: dict[int, tuple[weakref.ref[Schedule], T]] = {}

    def __call__(self, schedule: Schedule) -> T:
        """The value for ``schedule``."""
        key = id(schedule)  # not reused while the schedule lives, and forgotten after
        found = self.kept.get(key)
        if found is not None:
            return found[1]
        value = self.make(schedule)

        def forget(_: object) -> None:
            self.kept.pop(key, None)

        self.kept[key] = (weakref.ref(schedule, forget), value)
        return value


__all__ = ["PerSchedule"]
