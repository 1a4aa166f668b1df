"""``conveyor.simulate``: the simulator, which lives beside the schedule data it reads
(:mod:`conveyor.schedules.simulate`); this module keeps the public name."""

from conveyor.schedules.simulate import (
    Cost,
    CostSpec,
    Event,
    SimResult,
    action_durations,
    ascii_timeline,
    is_per_stage,
    normalize_cost,
    peak_activations,
    simulate,
)

__all__ = [
    "Cost",
    "CostSpec",
    "Event",
    "SimResult",
    "action_durations",
    "ascii_timeline",
    "is_per_stage",
    "normalize_cost",
    "peak_activations",
    "simulate",
]
