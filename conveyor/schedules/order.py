"""The one walk of a schedule: what the ranks run, together, in one valid order.

Each rank's program reads as typed instructions (:func:`instructions`): a
:class:`Compute` (one action, or an overlapped pair already grouped as one unit) or a
pipeline-wide pass (a :class:`~conveyor.schedules.core.Pass` at its slot).
:func:`walk` runs the ranks' instructions against each other: sends never block and
receives do, so a rank advances while its next compute's dependencies
(:func:`~conveyor.schedules.core.requires`) are done, and a pass runs once every rank has
reached it (a barrier: it holds collectives of the whole pipeline group). The simulator,
the runtime's programs and ticks, :func:`~conveyor.schedules.checks.validate` and
:func:`execution_order` all consume this walk (the simulator and ``validate`` walk a
schedule without vocabulary passes by the same rule on integer indices:
:mod:`~conveyor.schedules.fast_sim`).

Pure Python (no torch import).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from conveyor.errors import ScheduleError
from conveyor.schedules.core import Action, Pass, Schedule, requires


class Compute(NamedTuple):
    """One unit of a rank's compute: ``action``, or the overlapped pair of the F
    ``action`` and the B ``paired`` of another micro-batch (interleaved at their expert
    all-to-alls; :attr:`~conveyor.schedules.core.Schedule.pairs`). Written ``F2,5`` or,
    for a pair, ``F2,5+B2,3``.

    Attributes:
        rank: The pipeline rank that runs it.
        action: The action (a pair's F).
        paired: A pair's B; None for a single action.
    """

    rank: int
    action: Action
    paired: Action | None = None

    @property
    def actions(self) -> tuple[Action, ...]:
        """The unit's actions in program order: one, or a pair's F then its B."""
        return (self.action,) if self.paired is None else (self.action, self.paired)

    def __str__(self) -> str:
        """The unit as a schedule table writes it: ``F2,5`` or ``F2,5+B2,3``."""
        return "+".join(map(str, self.actions))


Instruction = Compute | Pass
"""One instruction of the walk: a rank's :class:`Compute`, or a pipeline-wide pass that
every rank runs (a :class:`~conveyor.schedules.core.Pass`)."""


def instructions(schedule: Schedule, rank: int) -> tuple[Instruction, ...]:
    """``rank``'s program as instructions: its actions in program order, each overlapped
    pair as one :class:`Compute`, and each pass at the rank's slot for it.

    Args:
        schedule: A schedule whose pairs and vocabulary slots are well formed (as
            :func:`~conveyor.schedules.checks.validate` checks them).
        rank: A pipeline rank.

    Returns:
        The instructions, in the order the rank runs them.

    Raises:
        ScheduleError: If a pass's slot falls inside one of the rank's pairs.
    """
    program = schedule.actions[rank]
    starts = schedule.pair_starts(rank)
    slots = schedule.vocab_slots[rank] if schedule.vocab else ()
    if not starts and not slots:
        return tuple([Compute(rank, a) for a in program])
    out: list[Instruction] = []
    k = 0  # the next pass
    i = 0  # the next action
    while True:
        while k < len(slots) and slots[k] <= i:
            out.append(schedule.vocab[k])
            k += 1
        if i >= len(program):
            return tuple(out)
        if i in starts:
            f, b = program[i], program[i + 1]
            if k < len(slots) and slots[k] == i + 1:
                raise ScheduleError(
                    f"schedule {schedule.name!r}: rank {rank} runs the pass "
                    f"{schedule.vocab[k]} inside its pair {f}+{b}; run the pass before or "
                    f"after the pair, or leave the two unpaired"
                )
            out.append(Compute(rank, f, b))
            i += 2
        else:
            out.append(Compute(rank, program[i]))
            i += 1


def advance(schedule: Schedule) -> tuple[tuple[Instruction, ...], tuple[Instruction | None, ...]]:
    """The walk without its error: every instruction the ranks could run, in the order
    :func:`walk` gives, and per rank the instruction it stopped at (None: it finished).

    The simulator, the checks and the programs of one step each walk the same schedule:
    the last few walks are kept (a schedule is immutable; equal schedules walk alike).

    Args:
        schedule: A schedule whose pairs and vocabulary slots are well formed.

    Returns:
        ``(order, stopped)``; the walk completed when every entry of ``stopped`` is None.
    """
    try:
        hash(schedule)
    except TypeError:  # a schedule built by hand with lists: walk it every time
        return _advance(schedule)
    return _advance_cached(schedule)


def _advance(schedule: Schedule) -> tuple[tuple[Instruction, ...], tuple[Instruction | None, ...]]:
    """:func:`advance`, uncached."""
    programs = [instructions(schedule, r) for r in range(schedule.ranks)]
    stages = schedule.stages
    position = [0] * schedule.ranks
    waiting: list[Action | None] = [None] * schedule.ranks  # what each rank last waited for
    done: set[Action] = set()
    order: list[Instruction] = []
    while True:
        progressed = True
        while progressed:  # round-robin over the ranks: each runs what it can
            progressed = False
            for rank, program in enumerate(programs):
                if waiting[rank] is not None and waiting[rank] not in done:
                    continue  # still waiting: no need to ask again
                waiting[rank] = None
                i = start = position[rank]
                while i < len(program) and waiting[rank] is None:
                    step = program[i]
                    if not isinstance(step, Compute):
                        break  # a pass: every rank must reach it first
                    actions = step.actions
                    for action in actions:
                        for dependency in requires(action, stages):
                            if dependency not in done:
                                waiting[rank] = dependency
                                break
                    if waiting[rank] is None:
                        done.update(actions)
                        i += 1
                if i > start:
                    order.extend(program[start:i])
                    position[rank] = i
                    progressed = True
        stopped = tuple(
            p[i] if i < len(p) else None for p, i in zip(programs, position, strict=True)
        )
        if stopped and all(isinstance(step, Pass) for step in stopped):
            # Every rank waits at the same pass (each lists the passes in one order).
            order.append(stopped[0])  # type: ignore[arg-type]
            position = [i + 1 for i in position]
        else:
            return tuple(order), stopped


_advance_cached = functools.lru_cache(maxsize=32)(_advance)


def walk(schedule: Schedule) -> tuple[Instruction, ...]:
    """The schedule run by its ranks together: every instruction once, in a valid order.

    Sends never block and receives do: each rank runs its instructions
    (:func:`instructions`) in order, a compute once the dependencies of its actions
    are done (both actions of a pair at once), a pass once every rank has reached it.
    The ranks advance round-robin, which is also the order the one-process world runs.

    Args:
        schedule: A schedule whose actions are complete and in range and whose pairs
            and vocabulary slots are well formed (as
            :func:`~conveyor.schedules.checks.validate` checks them).

    Returns:
        The instructions: each rank's in its program order, each compute after the
        computes it depends on, each pass after every instruction before it on every
        rank and before every one after it.

    Raises:
        ScheduleError: If the ranks deadlock; the message names every stuck rank and
            what it waits on.
    """
    order, stopped = advance(schedule)
    if any(step is not None for step in stopped):
        raise ScheduleError(_deadlock(schedule, order, stopped))
    return order


def _deadlock(
    schedule: Schedule, order: tuple[Instruction, ...], stopped: tuple[Instruction | None, ...]
) -> str:
    """The one deadlock message: each stuck rank and what it waits on (a compute: the
    missing dependencies and their ranks; a pass: the ranks that have not reached it)."""
    done = {a for step in order if isinstance(step, Compute) for a in step.actions}
    stuck = []
    for rank, step in enumerate(stopped):
        if isinstance(step, Compute):
            missing = [
                d for a in step.actions for d in requires(a, schedule.stages) if d not in done
            ]
            stuck.append(
                f"rank {rank} at {step} waits for "
                + ", ".join(f"{d} on rank {schedule.placement[d.stage]}" for d in missing)
            )
        elif step is not None:
            stuck.append(f"rank {rank} waits at the pass {step} for every rank")
    what = "the actions or the passes" if schedule.vocab else "the actions"
    return (
        f"schedule {schedule.name!r} deadlocks: {'; '.join(stuck)}; reorder {what} so "
        f"every wait is on work that can finish first"
    )


def execution_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """Every ``(rank, action)`` in the order of :func:`walk` (a pair's F then its B,
    passes left out): a valid global order of all actions.

    Args:
        schedule: A schedule as :func:`~conveyor.schedules.checks.validate` checks it.

    Returns:
        Every ``(rank, action)`` pair, in an order that respects
        :func:`~conveyor.schedules.core.dependencies`.

    Raises:
        ScheduleError: If the programs deadlock; the message names every stuck rank and
            the action it waits on.
    """
    return [
        (step.rank, a) for step in walk(schedule) if isinstance(step, Compute) for a in step.actions
    ]


def merged_order(schedule: Schedule) -> list[Action | Pass]:
    """Every action and pass once, in the order of :func:`walk` with each
    pair's two actions one after the other: an action runs after its dependencies, a
    pass after everything placed before its slot on every rank and before everything
    placed after it. (The rank of an action is ``schedule.placement[action.stage]``.)

    Raises:
        ScheduleError: If the programs deadlock; names each stuck rank and its wait.
    """
    return [
        a
        for step in walk(schedule)
        for a in (step.actions if isinstance(step, Compute) else (step,))
    ]
