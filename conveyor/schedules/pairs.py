"""Overlapped forward / backward pairs: which a schedule marks, and which may run.

A pair (:attr:`~conveyor.schedules.core.Schedule.pairs`) is an F directly followed by a
B of another micro-batch in one rank's program, run interleaved at their expert
all-to-alls: one unit of the walk (:class:`~conveyor.schedules.order.Compute`), so both
wait for the dependencies of both. A pair whose B waits on its own F's consequences (an
F of 1F1B's warm-up with the first B), or that a vocabulary pass splits, cannot run as a
unit; the functions here mark only pairs that can.

Pure Python (no torch import).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from conveyor.schedules.core import B, F, Schedule
from conveyor.schedules.order import Compute, advance, walk


def forward_backward_pairs(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """Per rank, every F directly followed by a B of another micro-batch (the steady
    state of 1F1B, DualPipeV's overlapped slots): the pairs :func:`paired` marks."""
    return tuple(
        tuple(
            i
            for i in range(len(program) - 1)
            if program[i].kind == F
            and program[i + 1].kind == B
            and program[i].microbatch != program[i + 1].microbatch
        )
        for program in schedule.actions
    )


def paired(schedule: Schedule) -> Schedule:
    """``schedule`` with its forward / backward pairs marked (:func:`forward_backward_pairs`):
    where a pipeline shards experts, each pair runs interleaved at the expert all-to-alls.

    Args:
        schedule: A valid schedule.

    Returns:
        The same programs with :attr:`Schedule.pairs` set.

    Raises:
        ScheduleError: If ``schedule`` itself deadlocks. (A pair that would deadlock, e.g.
            an F of 1F1B's warm-up with the first B, is left unpaired.)
    """
    return paired_with_vocab(schedule, forward_backward_pairs(schedule))


def paired_with_vocab(schedule: Schedule, pairs: Sequence[Iterable[int]]) -> Schedule:
    """``schedule`` with those of ``pairs`` marked that run deadlock-free as units,
    around its vocabulary passes if it has any.

    A pair that a pass splits runs apart; so does each pair the walk stops at
    (:func:`~conveyor.schedules.order.advance`), and the walk is repeated until it
    completes.

    Args:
        schedule: A valid schedule, with or without vocabulary passes.
        pairs: Per rank, the indices of its program that start a candidate pair (each
            an F followed by a B of another micro-batch).

    Returns:
        The schedule with :attr:`Schedule.pairs` set to the pairs kept.

    Raises:
        ScheduleError: If the schedule deadlocks even without the pairs the walk stops
            at (the walk's message).
    """
    marks: list[set[int]] = [set(p) for p in pairs] or [set() for _ in schedule.actions]
    if schedule.vocab:
        for rank, row in enumerate(schedule.vocab_slots):
            marks[rank] -= {slot - 1 for slot in row}  # a pass right after the pair's F
    while True:
        marked = dataclasses.replace(schedule, pairs=tuple(tuple(sorted(p)) for p in marks))
        _, stopped = advance(marked)
        stuck = [s for s in stopped if isinstance(s, Compute) and s.paired is not None]
        if all(s is None for s in stopped):
            return marked
        if not stuck:
            walk(marked)  # raises: the programs deadlock without any pair's help
        for step in stuck:
            marks[step.rank].discard(schedule.actions[step.rank].index(step.action))


def unpaired(schedule: Schedule) -> Schedule:
    """``schedule`` with no overlapped pairs: every action runs on its own."""
    return dataclasses.replace(schedule, pairs=())
