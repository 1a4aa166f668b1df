"""What the simulator records: one :class:`Event` per action, one :class:`VocabEvent`
per vocabulary pass and rank (:mod:`~conveyor.schedules.simulation`).

Pure Python (no torch import).
"""

from __future__ import annotations

from typing import NamedTuple

from conveyor.schedules.core import Action, Pass


class Event(NamedTuple):
    """One action as simulated: ``rank`` ran ``action`` from ``start`` to ``end``.

    Attributes:
        rank: The pipeline rank that ran it.
        action: The action.
        start: When it started, in cost units (the first action starts at 0).
        end: When it ended, in cost units.
    """

    rank: int
    action: Action
    start: float
    end: float


class VocabEvent(NamedTuple):
    """One vocabulary pass as simulated on one rank: every rank runs each pass at once.

    Attributes:
        rank: The pipeline rank.
        action: The pass (:class:`~conveyor.schedules.core.Pass`).
        start: When it started on every rank, in cost units.
        end: When it ended, in cost units.
    """

    rank: int
    action: Pass
    start: float
    end: float


__all__ = ["Event", "VocabEvent"]
