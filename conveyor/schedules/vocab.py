"""Vocabulary passes in a schedule: where each pipeline rank runs them, and checks.

Vocabulary parallelism (Yeung et al., "Balancing Pipeline Parallelism with Vocabulary
Parallelism", MLSys 2025) spreads the input embedding and the output layer over every
pipeline rank by vocabulary rows. Each micro-batch then has four passes
(:class:`~conveyor.schedules.core.Pass`, of the kinds :data:`VOCAB_KINDS`) that every rank
runs at once: ``E`` (embedding), ``S`` (output forward and its statistics: the loss),
``T`` (output backward) and ``G`` (embedding gradient). Each holds collectives over the
pipeline group, so every rank runs the passes in one order (:attr:`Schedule.vocab`) and
each rank's program says where (:attr:`Schedule.vocab_slots`). What a pass computes is
the vocabulary layers' stage ends' (:mod:`conveyor.vocab.runner`).

:func:`with_vocab` places them by one rule for every schedule, from the schedule
simulated without passes: ``S`` and ``T`` of micro-batch ``m`` as the last stage's forward
of ``m`` ends (where every rank meets), ``E`` of ``m`` at the last such meeting before
stage 0's forward of ``m`` starts (or at the step's start), ``G`` of ``m`` at the first
one after stage 0's backward of ``m`` ends (or at the step's end): one meeting of the
ranks per micro-batch instead of three. On each rank a pass goes before the first action
that starts at its time or later. Every dependency then runs forward in one total order
(time, then passes before actions), so the programs cannot deadlock, and ``S`` and ``T``
run back to back: the logits of one micro-batch are alive only between them (at most one
extra micro-batch of activations, the paper's one-barrier rule). On 1F1B that is the
paper's placement of the output passes right after the last stage's forward; on V-Half
and V-Min, whose first and last stages share rank 0, the passes take a common slot on
every rank.

:func:`check_vocab` checks the passes (:func:`~conveyor.schedules.checks.validate` runs
it); :func:`merged_order` (every action and pass in the order of the one walk,
:func:`~conveyor.schedules.order.walk`) lives in :mod:`conveyor.schedules.order` and is
exported here too.

Pure Python (no torch import).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence

from conveyor.errors import ScheduleError
from conveyor.schedules.core import Action, B, F, Pass, Schedule
from conveyor.schedules.costs import VOCAB_KINDS, VocabKind
from conveyor.schedules.order import merged_order, walk

__all__ = ["VOCAB_KINDS", "VocabKind", "check_vocab", "merged_order", "vocab_collectives",
           "with_vocab"]  # fmt: skip

_TINY = 1e-6  # the smallest duration an action is simulated with (strict time order)


def with_vocab(schedule: Schedule, cost: Sequence[float] = (1.0, 1.0, 1.0)) -> Schedule:
    """``schedule`` with its vocabulary passes placed (see the module doc).

    Args:
        schedule: A valid schedule without passes; overlapped pairs are dropped.
        cost: (F, B, W) of one rank's share for one micro-batch: the times that place
            the passes (durations below 1e-6 count as 1e-6).

    Returns:
        The schedule with :attr:`Schedule.vocab` and :attr:`Schedule.vocab_slots` set.
    """
    from conveyor.schedules.simulation import simulate

    base = dataclasses.replace(schedule, pairs=(), vocab=(), vocab_slots=())
    timed = simulate(base, tuple(max(float(c), _TINY) for c in cost))
    start = {e.action: e.start for e in timed.events}
    end = {e.action: e.end for e in timed.events}
    last = schedule.stages - 1
    m_all = range(schedule.microbatches)
    # Where every rank meets anyway: the output passes, as the last stage's forwards end.
    meets = sorted(end[Action(F, last, m)] for m in m_all)
    when: list[tuple[float, int, int, Pass]] = []
    for m in m_all:
        out = end[Action(F, last, m)]
        # E at the last meeting before stage 0's forward starts (or at the step's start),
        # G at the first one after stage 0's backward ends (or at its end): one meeting
        # of the ranks per micro-batch instead of three.
        before = bisect.bisect_right(meets, start[Action(F, 0, m)]) - 1
        after = bisect.bisect_left(meets, end[Action(B, 0, m)])
        for kind, at in (
            ("E", meets[before] if before >= 0 else 0.0),
            ("S", out),
            ("T", out),
            ("G", meets[after] if after < len(meets) else math.inf),
        ):
            when.append((at, VOCAB_KINDS.index(kind), m, Pass(kind, m)))
    when.sort()
    slots: list[tuple[int, ...]] = []
    for program in base.actions:
        starts = [start[a] for a in program]
        row, i = [], 0
        for at, *_ in when:
            while i < len(program) and starts[i] < at:
                i += 1
            row.append(i)
        slots.append(tuple(row))
    return dataclasses.replace(base, vocab=tuple(v for *_, v in when), vocab_slots=tuple(slots))


def vocab_collectives(schedule: Schedule) -> list[tuple[str, int]]:
    """The collectives over the pipeline group one step posts, in order, the same on
    every rank: per pass, ``(collective, micro-batch)`` (``E``: reduce; ``S``: broadcast,
    all-gather; ``T``: reduce; ``G``: broadcast)."""
    names = {"E": ("reduce",), "S": ("broadcast", "all_gather"), "T": ("reduce",),
             "G": ("broadcast",)}  # fmt: skip
    return [(c, v.microbatch) for v in schedule.vocab for c in names[v.kind]]


def check_vocab(schedule: Schedule) -> None:
    """Check the vocabulary passes of ``schedule``: each of E, S, T, G once per
    micro-batch, in an order that keeps each micro-batch's E, S, T, G in that order; one
    slot per pass on every rank, never decreasing, none inside a pair; each pass where
    its data is (E before stage 0's forward, S after the last stage's forward, T before
    the last stage's backward, G after stage 0's backward, on their ranks); and no
    deadlock (:func:`~conveyor.schedules.order.walk`).

    Raises:
        ScheduleError: Naming the pass and rank at fault.
    """
    check_vocab_places(schedule)
    walk(schedule)


def check_vocab_places(schedule: Schedule) -> None:
    """:func:`check_vocab` but the walk (:func:`~conveyor.schedules.checks.validate` walks
    the schedule itself)."""
    name, p = schedule.name, schedule.ranks
    strange = [v for v in schedule.vocab if v.kind not in VOCAB_KINDS]
    if strange:
        raise ScheduleError(
            f"schedule {name!r}: its pass {strange[0]} is of no kind the schedule knows; "
            f"the passes are vocabulary parallelism's E, S, T and G of each micro-batch"
        )
    seen = {(v.kind, v.microbatch) for v in schedule.vocab}
    wanted = {(k, m) for k in VOCAB_KINDS for m in range(schedule.microbatches)}
    if len(schedule.vocab) != len(wanted) or seen != wanted:
        missing = sorted(wanted - seen)
        what = f"lacks {missing[0][0]}{missing[0][1]}" if missing else "repeats a pass"
        raise ScheduleError(
            f"schedule {name!r}: its vocabulary passes {what}; give E, S, T and G of every "
            f"micro-batch once (conveyor.schedules.vocab.with_vocab places them)"
        )
    index = {(v.kind, v.microbatch): k for k, v in enumerate(schedule.vocab)}
    for m in range(schedule.microbatches):
        ks = [index[(kind, m)] for kind in VOCAB_KINDS]
        if ks != sorted(ks):
            raise ScheduleError(
                f"schedule {name!r}: micro-batch {m}'s vocabulary passes run out of order; "
                f"run E, S, T, G of a micro-batch in that order"
            )
    if len(schedule.vocab_slots) != p or any(
        len(row) != len(schedule.vocab) for row in schedule.vocab_slots
    ):
        raise ScheduleError(
            f"schedule {name!r}: vocab_slots needs one slot per pass for each of {p} ranks"
        )
    for r, row in enumerate(schedule.vocab_slots):
        n = len(schedule.actions[r])
        if any(not 0 <= i <= n for i in row) or list(row) != sorted(row):
            raise ScheduleError(
                f"schedule {name!r}: rank {r}'s vocabulary slots {row} must be positions "
                f"0..{n} of its program, never decreasing"
            )
    last = schedule.stages - 1
    for k, v in enumerate(schedule.vocab):
        m = v.microbatch
        rules = {
            "E": (Action(F, 0, m), False, "before"),
            "S": (Action(F, last, m), True, "after"),
            "T": (Action(B, last, m), False, "before"),
            "G": (Action(B, 0, m), True, "after"),
        }
        action, after, word = rules[v.kind]
        rank = schedule.placement[action.stage]
        i = schedule.actions[rank].index(action)
        slot = schedule.vocab_slots[rank][k]
        if (slot <= i) if after else (slot > i):
            raise ScheduleError(
                f"schedule {name!r}: rank {rank} runs {v} {'before' if after else 'after'} "
                f"{action}; it must run {word} it"
            )
