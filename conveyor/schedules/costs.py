"""The costs the simulator takes, checked: compute (F, B, W), expert all-to-all time and
vocabulary passes, per rank's share or per stage, and each action's duration from them.

Pure Python (no torch import).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Literal, TypeGuard, cast

from conveyor.errors import ConfigError
from conveyor.schedules.core import B, F, Kind, Schedule, W

Cost = tuple[float, float, float]
"""Durations (F, B, W) of one micro-batch, checked: finite floats >= 0."""
CostSpec = Sequence[float] | Sequence[Sequence[float]]
"""(F, B, W) for one rank's whole share, or one (F, B, W) per stage."""
A2A = tuple[float, float]
"""Expert all-to-all time (F, B) of one micro-batch through one rank's whole share,
checked: finite floats >= 0."""
A2ASpec = float | Sequence[float]
"""One all-to-all time for both F and B, or a pair (F, B)."""
VocabKind = Literal["E", "S", "T", "G"]
"""A vocabulary pass's kind (every pipeline rank takes part):
``"E"`` the embedding lookup of the rank's rows, summed onto the first stage's rank;
``"S"`` the output layer's forward: the last stage's hidden states broadcast, the rank's
logits shard and its softmax statistics, gathered from every rank (the loss);
``"T"`` the output layer's backward: the logits' gradient, the rank's weight gradient,
and the input gradient summed onto the last stage's rank;
``"G"`` the embedding's gradient: the first stage's input gradient broadcast, each rank
adds its rows'."""
VOCAB_KINDS: tuple[VocabKind, ...] = ("E", "S", "T", "G")
"""Every vocabulary pass, in the order they run for one micro-batch."""
VocabCost = tuple[float, float, float, float]
"""Durations (E, S, T, G) of the vocabulary passes of one micro-batch on one rank's share
of the vocabulary layers, checked: finite floats >= 0."""
VocabSpec = float | Sequence[float] | None
"""One duration for all four passes, four (E, S, T, G), or None (no cost)."""


def is_per_stage(cost: Cost | tuple[Cost, ...]) -> TypeGuard[tuple[Cost, ...]]:
    """Whether a normalized cost is one (F, B, W) per stage rather than one per rank.

    Args:
        cost: A cost as :func:`normalize_cost` returns it.

    Returns:
        True for a tuple of per-stage costs.
    """
    return isinstance(cost[0], tuple)


def _as_cost(values: Sequence[float], what: str) -> Cost:
    """``values`` as a :data:`Cost`; ConfigError naming ``what`` unless 3 numbers >= 0."""
    if len(values) != 3:
        raise ConfigError(f"{what} must be three numbers F,B,W, got {list(values)}")
    try:
        f, b, w = (float(v) for v in values)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be three numbers F,B,W, got {list(values)}") from None
    if not all(math.isfinite(v) and v >= 0 for v in (f, b, w)):
        raise ConfigError(f"{what} must be finite and >= 0, got {list(values)}")
    return (f, b, w)


def normalize_a2a(a2a: A2ASpec) -> A2A:
    """Check ``a2a`` and return it as a pair (F, B).

    Args:
        a2a: One number (the same for F and B) or two, (F, B).

    Returns:
        The pair, as floats.

    Raises:
        ConfigError: Unless one or two finite numbers >= 0.
    """
    values = a2a if isinstance(a2a, Sequence) else [a2a]
    pair = tuple(float(v) for v in values if isinstance(v, numbers.Real))
    in_range = all(math.isfinite(v) and v >= 0 for v in pair)
    if len(pair) != len(values) or len(pair) not in (1, 2) or not in_range:
        raise ConfigError(
            f"a2a must be a finite number >= 0, or a pair (F, B) of them, got {a2a!r}"
        )
    return (pair[0], pair[-1])


def normalize_vocab(vocab: VocabSpec) -> VocabCost:
    """Check ``vocab`` and return it as four durations (E, S, T, G).

    Args:
        vocab: None (no cost), one number for all four passes, or four (E, S, T, G).

    Returns:
        The four durations, as floats.

    Raises:
        ConfigError: Unless None, one or four finite numbers >= 0.
    """
    if vocab is None:
        return (0.0, 0.0, 0.0, 0.0)
    values = vocab if isinstance(vocab, Sequence) else [vocab]
    four = tuple(
        float(v) for v in values if isinstance(v, numbers.Real) and not isinstance(v, bool)
    )
    in_range = all(math.isfinite(v) and v >= 0 for v in four)
    if len(four) != len(values) or len(four) not in (1, 4) or not in_range:
        raise ConfigError(
            f"vocab must be a finite number >= 0, or four (E, S, T, G) of them, got {vocab!r}"
        )
    return (four[0], four[1], four[2], four[3]) if len(four) == 4 else (four[0],) * 4


def normalize_cost(schedule: Schedule, cost: CostSpec) -> Cost | tuple[Cost, ...]:
    """Check ``cost`` and return it as one (F, B, W) or a tuple of one per stage.

    Args:
        schedule: The schedule the cost is for (for its stage count).
        cost: Three numbers (F, B, W), or one such triple per stage of ``schedule``.

    Returns:
        One :data:`Cost`, or a tuple of one per stage.

    Raises:
        ConfigError: For a wrong count of stages, or costs that are not three finite
            numbers >= 0.
    """
    if len(cost) == 0 or not all(isinstance(c, Sequence) for c in cost):
        return _as_cost(cast(Sequence[float], cost), "cost")
    stages = cast(Sequence[Sequence[float]], cost)
    if len(stages) != schedule.stages:
        raise ConfigError(
            f"got costs for {len(stages)} stages, but the schedule has "
            f"{schedule.stages}; give one (F, B, W) per stage"
        )
    return tuple(_as_cost(c, f"cost of stage {s}") for s, c in enumerate(stages))


def action_durations(schedule: Schedule, cost: Cost | tuple[Cost, ...]) -> list[dict[Kind, float]]:
    """Per stage, the duration of its F, B and W actions.

    One (F, B, W) is one rank's whole share, so each of its V chunks costs 1/V of it.
    Without split backward, B is the whole backward and costs B + W (and W costs 0).

    Args:
        schedule: The schedule.
        cost: A cost as :func:`normalize_cost` returns it.

    Returns:
        One ``{kind: duration}`` per stage.
    """
    if is_per_stage(cost):
        stage_costs = list(cost)
    else:
        f, b, w = (c / schedule.chunks for c in cast(Cost, cost))
        stage_costs = [(f, b, w)] * schedule.stages
    if schedule.split_backward:
        return [{F: f, B: b, W: w} for f, b, w in stage_costs]
    return [{F: f, B: b + w, W: 0.0} for f, b, w in stage_costs]
