"""Event-driven simulation of a schedule: timeline, makespan, bubble, peak memory.

Pure Python (no torch import). Each rank runs its program in order; an action starts
when its rank is free and its dependencies are done, plus ``comm`` for a dependency that
ran on another rank.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeGuard, cast

from conveyor.errors import ConfigError
from conveyor.schedules.core import (
    Action,
    B,
    F,
    Kind,
    Schedule,
    W,
    dependencies,
    execution_order,
)

Cost = tuple[float, float, float]
"""Durations (F, B, W) of one micro-batch, checked: finite floats >= 0."""
CostSpec = Sequence[float] | Sequence[Sequence[float]]
"""(F, B, W) for one rank's whole share, or one (F, B, W) per stage."""


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


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` found. Times are in cost units (the unit of ``cost``).

    Attributes:
        schedule: The simulated schedule.
        cost: The costs, checked (:func:`normalize_cost`): one (F, B, W) for one rank's
            share, or a tuple of one per stage.
        comm: Latency of one transfer between ranks.
        events: One :class:`Event` per action, grouped by rank, in program order.
        makespan: First start to last end over all ranks.
        span: The largest, over ranks, of that rank's last end minus its first start.
        bubble: The idle share of all ranks over the makespan, 1 - (busy time of all
            ranks) / (ranks x makespan), which is 1 - M(F+B+W)/makespan for per-rank
            costs and stays meaningful for per-stage costs.
        peak_activations: Per rank, the most micro-batch activations held at once
            (:func:`peak_activations`).
    """

    schedule: Schedule
    cost: Cost | tuple[Cost, ...]
    comm: float
    events: tuple[Event, ...]
    makespan: float
    span: float
    bubble: float
    peak_activations: tuple[float, ...]

    def to_json_dict(self) -> dict[str, object]:
        """The ``conveyor simulate --json`` object (keys as in DESIGN.md).

        Returns:
            ``schedule`` (its name), ``ranks``, ``chunks``, ``microbatches``, ``cost``,
            ``comm``, ``makespan``, ``span``, ``bubble`` (rounded to 4 places) and
            ``peak_activations``: plain JSON values.
        """
        cost = [list(c) for c in self.cost] if is_per_stage(self.cost) else list(self.cost)
        return {
            "schedule": self.schedule.name,
            "ranks": self.schedule.ranks,
            "chunks": self.schedule.chunks,
            "microbatches": self.schedule.microbatches,
            "cost": cost,
            "comm": self.comm,
            "makespan": _tidy(self.makespan),
            "span": _tidy(self.span),
            "bubble": round(self.bubble, 4),
            "peak_activations": [round(p, 4) for p in self.peak_activations],
        }


def is_per_stage(cost: Cost | tuple[Cost, ...]) -> TypeGuard[tuple[Cost, ...]]:
    """Whether a normalized cost is one (F, B, W) per stage rather than one per rank.

    Args:
        cost: A cost as :func:`normalize_cost` returns it.

    Returns:
        True for a tuple of per-stage costs.
    """
    return isinstance(cost[0], tuple)


def _tidy(value: float) -> float:
    """Drop float noise from sums of fractional costs (e.g. 32.99999999 -> 33.0)."""
    return round(value, 9)


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


def action_durations(
    schedule: Schedule, cost: Cost | tuple[Cost, ...]
) -> list[dict[Kind, float]]:
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


def peak_activations(schedule: Schedule) -> tuple[float, ...]:
    """Per rank, the most micro-batch activations held at once.

    A (stage, micro-batch) is held from its F until the last of its B / W; one chunk
    counts 1/V of a micro-batch through the rank's whole share.

    Args:
        schedule: The schedule.

    Returns:
        One peak per rank, in micro-batches of the rank's whole share.
    """
    release = W if schedule.split_backward else B
    peaks = []
    for program in schedule.actions:
        held = peak = 0
        for action in program:
            if action.kind == F:
                held += 1
                peak = max(peak, held)
            elif action.kind == release:
                held -= 1
        peaks.append(peak / schedule.chunks)
    return tuple(peaks)


def simulate(schedule: Schedule, cost: CostSpec = (1.0, 1.0, 1.0), comm: float = 0.0) -> SimResult:
    """Run ``schedule`` in simulated time.

    Each rank runs its program in order; an action starts when its rank is free and its
    dependencies have ended, plus ``comm`` for each dependency that ran on another rank.

    Args:
        schedule: The schedule; not validated here (see
            :func:`~conveyor.schedules.core.validate`).
        cost: (F, B, W) durations for one rank's whole share of the model and one
            micro-batch, or a list of (F, B, W), one per stage, in any time unit.
        comm: The latency of one transfer between ranks, in the unit of ``cost``.

    Returns:
        The timeline and its summary.

    Raises:
        ScheduleError: If the schedule deadlocks.
        ConfigError: For bad costs or a ``comm`` that is not a finite number >= 0.
    """
    if not (math.isfinite(comm) and comm >= 0):
        raise ConfigError(f"comm must be a finite number >= 0, got {comm}")
    costs = normalize_cost(schedule, cost)
    durations = action_durations(schedule, costs)
    placement = schedule.placement
    free = [0.0] * schedule.ranks
    first_start = [math.inf] * schedule.ranks
    end: dict[Action, float] = {}
    timed: list[list[Event]] = [[] for _ in range(schedule.ranks)]
    for rank, action in execution_order(schedule):
        start = free[rank]
        for dep in dependencies(schedule, action):
            ready_at = end[dep] + (comm if placement[dep.stage] != rank else 0.0)
            start = max(start, ready_at)
        finish = start + durations[action.stage][action.kind]
        end[action] = finish
        free[rank] = finish
        first_start[rank] = min(first_start[rank], start)
        timed[rank].append(Event(rank, action, start, finish))
    events = tuple(e for rank_events in timed for e in rank_events)
    active = [r for r in range(schedule.ranks) if timed[r]]
    makespan = (
        max(free[r] for r in active) - min(first_start[r] for r in active) if active else 0.0
    )
    span = max((free[r] - first_start[r] for r in active), default=0.0)
    busy = sum(e.end - e.start for e in events)
    bubble = 1.0 - busy / (schedule.ranks * makespan) if makespan > 0 else 0.0
    return SimResult(
        schedule=schedule,
        cost=costs,
        comm=float(comm),
        events=events,
        makespan=makespan,
        span=span,
        bubble=bubble,
        peak_activations=peak_activations(schedule),
    )


def _label(action: Action, schedule: Schedule) -> str:
    """``F3`` for micro-batch 3; with chunks, a letter for the chunk: ``F3a``, ``F3b``."""
    label = f"{action.kind}{action.microbatch}"
    if schedule.chunks > 1:
        chunk = schedule.stages_of(schedule.placement[action.stage]).index(action.stage)
        label += chr(ord("a") + chunk) if chunk < 26 else f"~{chunk}"
    return label


def _box(action: Action, schedule: Schedule, cells: int) -> str:
    """One action's box: its label and a gap when they fit, else its kind letter."""
    label = _label(action, schedule)
    return label.ljust(cells) if len(label) < cells else action.kind * cells


def _cuts(inside: list[int], cells: int, room: int) -> list[int]:
    """Where to cut ``cells`` columns into parts of at most ``room``: at the latest column
    in the second half of each part that no box straddles (``inside[c]`` counts the boxes
    straddling column c), else where the fewest do."""
    cuts = [0]
    while cells - cuts[-1] > room:
        left = cuts[-1]
        window = range(left + room, left + room // 2, -1)
        cuts.append(min(window, key=lambda c: inside[c]))  # min keeps the latest of equals
    return [*cuts, cells]


def ascii_timeline(result: SimResult, width: int = 120, max_parts: int = 8) -> str:
    """The timeline as text: one row per rank, time left to right, idle as ``.``.

    Each action is a box starting with its label (kind and micro-batch, plus a chunk
    letter when ranks hold several chunks), or only its kind letter where the label does
    not fit. Time is scaled so the shortest action fits its label; rows wider than
    ``width`` characters are cut into up to ``max_parts`` parts, one under the other
    (cut between boxes where possible). A timeline that would need more parts is
    squeezed into ``width`` instead, its short boxes losing their labels.

    Args:
        result: What :func:`simulate` returned.
        width: Characters per rank line; longer rows are cut into parts (at least 20
            is used).
        max_parts: The most parts a row may be cut into.

    Returns:
        The picture: a line saying what one cell is, then per part a ``rank N |...|``
        line per rank (headed by its time range when there are several parts); only
        empty rank lines when no action takes time.
    """
    schedule = result.schedule
    events = [e for e in result.events if e.end > e.start]
    if not events:
        return "\n".join(f"rank {r:>2} ||" for r in range(schedule.ranks))
    origin = min(e.start for e in events)
    longest = max(len(_label(e.action, schedule)) for e in events)
    shortest = min(e.end - e.start for e in events)
    room = max(width - 10, 10)
    scale = (longest + 1) / shortest
    if result.makespan * scale > room * max_parts:
        scale = min(scale, room / result.makespan)
    if shortest * scale >= 1:
        # Whole cells for the shortest action keep equal actions equally wide.
        scale = math.floor(shortest * scale + 1e-9) / shortest
    cells = max(1, round(result.makespan * scale))
    rows = [["."] * cells for _ in range(schedule.ranks)]
    inside = [0] * (cells + 1)
    for event in events:
        left = round((event.start - origin) * scale)  # the box's first and past-last cells
        right = max(left + 1, round((event.end - origin) * scale))
        rows[event.rank][left:right] = _box(event.action, schedule, right - left)
        for c in range(left + 1, min(right, cells)):
            inside[c] += 1
    legend = "F/B/W + micro-batch" + (", letter = chunk" if schedule.chunks > 1 else "")
    lines = [f"one cell = {1 / scale:.3g} time units; {legend}; '.' = idle"]
    cuts = _cuts(inside, cells, room)
    for left, right in itertools.pairwise(cuts):
        if len(cuts) > 2:
            lines.append(f"time {left / scale:.4g} to {right / scale:.4g}:")
        lines += [f"rank {r:>2} |{''.join(row[left:right])}|" for r, row in enumerate(rows)]
    return "\n".join(lines)
