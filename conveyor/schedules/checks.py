"""Checks of a schedule: complete, well formed, in order, and deadlock free.

:func:`validate` runs them all (every generator, table and ``Pipeline`` schedule passes
through it); the vocabulary passes' own checks are
:func:`~conveyor.schedules.vocab.check_vocab`. Each error names the
rank and the action or pass at fault and how to fix it.

Pure Python (no torch import).
"""

from __future__ import annotations

from conveyor.errors import ScheduleError
from conveyor.schedules.core import Action, B, F, Kind, Schedule, W, dependencies
from conveyor.schedules.fast_sim import plan_of
from conveyor.schedules.order import walk
from conveyor.schedules.vocab import check_vocab_places


def _check_shape(schedule: Schedule) -> None:
    """Raise ScheduleError unless sizes, program count and placement fit together."""
    p, m = schedule.ranks, schedule.microbatches
    if p < 1 or m < 1:
        raise ScheduleError(f"schedule {schedule.name!r}: ranks and microbatches must be >= 1")
    if len(schedule.actions) != p:
        raise ScheduleError(
            f"schedule {schedule.name!r} has programs for {len(schedule.actions)} ranks, "
            f"expected {p}; give one action list per rank"
        )
    if not schedule.placement or any(not 0 <= r < p for r in schedule.placement):
        raise ScheduleError(
            f"schedule {schedule.name!r}: placement {schedule.placement} must map every "
            f"stage to a rank in 0..{p - 1}"
        )
    for r in range(p):
        if not schedule.stages_of(r):
            raise ScheduleError(f"schedule {schedule.name!r}: rank {r} holds no stage")


def _bad_action(schedule: Schedule, rank: int, action: Action, kinds: tuple[Kind, ...]) -> str:
    """Why ``action`` may not appear in ``rank``'s program, or '' when it may."""
    kind, s, mb = action
    if kind not in kinds:
        return (
            f"rank {rank}: action {action} has kind {kind!r}; this schedule allows "
            f"{'/'.join(kinds)} (set split_backward=True to use W)"
        )
    if not (0 <= s < schedule.stages and 0 <= mb < schedule.microbatches):
        return (
            f"rank {rank}: action {action} is out of range "
            f"(stages 0..{schedule.stages - 1}, microbatches 0..{schedule.microbatches - 1})"
        )
    if schedule.placement[s] != rank:
        return (
            f"rank {rank}: action {action} runs stage {s}, which is placed on rank "
            f"{schedule.placement[s]}; move it to that rank's program"
        )
    return ""


def _check_complete(schedule: Schedule) -> None:
    """Raise ScheduleError unless every action is allowed and appears exactly once."""
    kinds = (F, B, W) if schedule.split_backward else (F, B)
    stages, m = schedule.stages, schedule.microbatches
    seen: set[Action] = set()
    for rank, program in enumerate(schedule.actions):
        own = set(schedule.stages_of(rank))
        for action in program:
            kind, s, mb = action
            # Plain comparisons first: this loop runs for every action of every schedule.
            if kind not in kinds or s not in own or not 0 <= mb < m or not 0 <= s < stages:
                raise ScheduleError(_bad_action(schedule, rank, action, kinds))
        # A stage lives on one rank, so a repeated action repeats within one program.
        before = len(seen)
        seen.update(program)
        if len(seen) - before != len(program):
            counted: set[Action] = set()
            for action in program:
                if action in counted:
                    raise ScheduleError(f"rank {rank}: action {action} appears twice; keep one")
                counted.add(action)
    if len(seen) == stages * m * len(kinds):
        return  # every action seen is distinct, in range and of an allowed kind
    for s in range(stages):
        for mb in range(m):
            for kind in kinds:
                if Action(kind, s, mb) not in seen:
                    raise ScheduleError(
                        f"rank {schedule.placement[s]}: action {Action(kind, s, mb)} is "
                        f"missing; every stage needs {'/'.join(kinds)} of every micro-batch"
                    )


def _check_pairs(schedule: Schedule) -> None:
    """Raise ScheduleError unless each pair is an F then a B of another micro-batch."""
    if not schedule.pairs:
        return
    if len(schedule.pairs) != schedule.ranks:
        raise ScheduleError(
            f"pairs has {len(schedule.pairs)} entries for {schedule.ranks} ranks; give one "
            f"tuple of indices per rank (empty for none)"
        )
    for rank, starts in enumerate(schedule.pairs):
        program = schedule.actions[rank]
        previous = -2
        for i in starts:
            ok = 0 <= i < len(program) - 1 and i > previous + 1
            if ok:
                f, b = program[i], program[i + 1]
                ok = f.kind == F and b.kind == B and f.microbatch != b.microbatch
            if not ok:
                raise ScheduleError(
                    f"rank {rank}: pair at index {i} is not an F followed by a B of another "
                    f"micro-batch (pairs are increasing and do not share an action)"
                )
            previous = i


def _check_local_order(schedule: Schedule) -> None:
    """Raise ScheduleError if a rank's program puts an action before one it needs."""
    for rank, program in enumerate(schedule.actions):
        index = {a: i for i, a in enumerate(program)}
        for i, action in enumerate(program):
            for dep in dependencies(schedule, action):
                j = index.get(dep)
                if j is not None and j > i:
                    raise ScheduleError(
                        f"rank {rank}: action {action} comes before {dep}, which it needs; "
                        f"swap them"
                    )


def validate(schedule: Schedule) -> Schedule:
    """Check that ``schedule`` is complete, in dependency order and deadlock free.

    Complete: the placement maps every stage to a rank, every rank holds a stage, each
    rank's program runs only its own stages, and every F and B (and W with
    ``split_backward``) of every stage and micro-batch appears exactly once. Each
    overlapped pair (:attr:`Schedule.pairs`) is an F followed by a B of another
    micro-batch. Vocabulary passes, if any, as
    :func:`~conveyor.schedules.vocab.check_vocab` says. Deadlock free:
    the walk (:func:`~conveyor.schedules.order.walk`) runs every instruction (without
    vocabulary passes, the simulator's plan walks it by the same rule:
    :func:`~conveyor.schedules.fast_sim.plan_of`).

    Args:
        schedule: The schedule to check.

    Returns:
        ``schedule`` itself, unchanged, so calls can be chained.

    Raises:
        ScheduleError: Naming the rank and action at fault and how to fix it.
    """
    _check_shape(schedule)
    _check_complete(schedule)
    _check_pairs(schedule)
    if schedule.vocab or schedule.vocab_slots:
        check_vocab_places(schedule)
    if plan_of(schedule) is not None:
        return schedule  # its ranks ran it: the simulator's walk, on a plain schedule
    try:
        walk(schedule)
    except ScheduleError:
        # A rank that orders its own actions wrongly also deadlocks; name the swap instead.
        _check_local_order(schedule)
        raise
    return schedule
