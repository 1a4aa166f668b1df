"""Event-driven simulation of a schedule: timeline, makespan, bubble, peak memory.

Pure Python (no torch import). Each rank runs its program in order; an action starts
when its rank is free and its dependencies are done, plus ``comm`` for a dependency that
ran on another rank. ``a2a`` adds the expert all-to-alls of a mixture-of-experts model:
an action alone waits for its own, an overlapped forward / backward pair hides each one
behind the other's compute (:func:`simulate`). ``vocab`` gives the vocabulary passes of
a schedule with vocabulary parallelism their durations: each is a barrier that occupies
every rank. The simulation itself is in
:mod:`conveyor.schedules.simulation` (schedules search with it, so it sits beside them);
this module is its public face and draws its timeline as text.
"""

from __future__ import annotations

import itertools
import math

from conveyor.schedules.core import Action, Pass, Schedule
from conveyor.schedules.simulation import (
    A2A,
    A2ASpec,
    Cost,
    CostSpec,
    Event,
    SimResult,
    VocabCost,
    VocabEvent,
    VocabSpec,
    action_durations,
    is_per_stage,
    normalize_a2a,
    normalize_cost,
    normalize_vocab,
    peak_activations,
    simulate,
)

__all__ = [
    "A2A",
    "A2ASpec",
    "Cost",
    "CostSpec",
    "Event",
    "SimResult",
    "VocabCost",
    "VocabEvent",
    "VocabSpec",
    "action_durations",
    "ascii_timeline",
    "is_per_stage",
    "normalize_a2a",
    "normalize_cost",
    "normalize_vocab",
    "peak_activations",
    "simulate",
]


def _label(action: Action | Pass, schedule: Schedule) -> str:
    """``F3`` for micro-batch 3; with chunks, a letter for the chunk: ``F3a``, ``F3b``; a
    pass as its kind and micro-batch: ``E3``, ``S3``, ``T3`` or ``G3``."""
    if isinstance(action, Pass):
        return str(action)
    label = f"{action.kind}{action.microbatch}"
    if schedule.chunks > 1:
        chunk = schedule.stages_of(schedule.placement[action.stage]).index(action.stage)
        label += chr(ord("a") + chunk) if chunk < 26 else f"~{chunk}"
    return label


def _box(action: Action | Pass, schedule: Schedule, cells: int) -> str:
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
    not fit; a vocabulary pass is a box on every rank, labelled ``E``, ``S``, ``T`` or
    ``G`` and its micro-batch. Time is scaled so the shortest action fits its label; rows wider than
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
    boxes: list[Event | VocabEvent] = [*result.events, *result.vocab_events]
    events = [e for e in boxes if e.end > e.start]
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
    if result.vocab_events:
        legend += "; E/S/T/G = vocabulary passes (every rank)"
    lines = [f"one cell = {1 / scale:.3g} time units; {legend}; '.' = idle"]
    cuts = _cuts(inside, cells, room)
    for left, right in itertools.pairwise(cuts):
        if len(cuts) > 2:
            lines.append(f"time {left / scale:.4g} to {right / scale:.4g}:")
        lines += [f"rank {r:>2} |{''.join(row[left:right])}|" for r, row in enumerate(rows)]
    return "\n".join(lines)
