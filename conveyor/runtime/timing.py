"""``Timing``: when one action (or one wait for a transfer) ran; pure Python."""

from __future__ import annotations

from typing import NamedTuple


class Timing(NamedTuple):
    """One action, or one wait for another rank's output, of a step on one rank.

    Attributes:
        rank: the pipeline rank that ran it.
        kind: ``"F"``, ``"B"`` or ``"W"`` (for a wait: the kind of the action whose output
            it waited for; in a picture, ``"wait"``).
        stage: the global stage index.
        microbatch: the micro-batch index.
        start: seconds from the step's start (for an action: when its inputs had arrived).
        end: seconds from the step's start.
    """

    rank: int
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float
