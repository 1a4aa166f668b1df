"""One configuration the planner weighs: :class:`Candidate`, made by :func:`evaluate` from
the one prediction (:mod:`~conveyor.planning.prediction`) on measured costs."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.planning.costs import Costs
from conveyor.planning.memory import Setting
from conveyor.planning.prediction import Sync, balanced, predict, refine
from conveyor.schedules import Schedule


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner simulated.

    Attributes:
        schedule: The schedule's name.
        chunks: Stages per rank.
        microbatches: Micro-batches per step.
        balance: Units per stage.
        predicted_step: Seconds per training step.
        peak_memory: Bytes per rank, as :mod:`~conveyor.planning.memory` counts them.
        fits: Whether every rank is within the memory limit.
        recompute: Whether every stage recomputes its forward at B.
        vocab: Whether the vocabulary layers are split over every rank
            (``vocab_parallel``; :mod:`~conveyor.planning.vocab`).
        bubble: The simulated bubble of that step: the idle share of every rank over the
            makespan (:attr:`~conveyor.simulate.SimResult.bubble`).
    """

    schedule: str
    chunks: int
    microbatches: int
    balance: tuple[int, ...]
    predicted_step: float
    peak_memory: tuple[int, ...]
    fits: bool
    recompute: bool = False
    vocab: bool = False
    bubble: float = 0.0


def evaluate(
    schedule: Schedule,
    costs: Costs,
    limit: float | None,
    setting: Setting,
    overhead: float = 0.0,
    sync: Sync | None = None,
) -> Candidate:
    """Balance ``schedule`` for ``costs`` (time min-max within ``limit``, refined by
    simulation) and predict its step and memory; ``overhead`` (a calibration's leftover)
    is added to the step.

    Raises:
        ConfigError: The schedule has more stages than there are units.
    """
    cut = balanced(schedule, costs, limit, setting)
    cut = refine(schedule, costs, cut, limit, setting)
    got = predict(schedule, costs, cut, setting, sync)
    return Candidate(
        schedule=schedule.name,
        chunks=schedule.chunks,
        microbatches=schedule.microbatches,
        balance=tuple(cut),
        predicted_step=got.step + overhead,
        peak_memory=tuple(round(p) for p in got.peak),
        fits=got.fits(limit),
        recompute=bool(setting.recompute),
        bubble=got.sim.bubble,
    )


__all__ = ["Candidate", "evaluate"]
