"""Vocabulary passes in a schedule: where each pipeline rank runs them, and checks.

Vocabulary parallelism (Yeung et al., "Balancing Pipeline Parallelism with Vocabulary
Parallelism", MLSys 2025) spreads the input embedding and the output layer over every
pipeline rank by vocabulary rows. Each micro-batch then has four passes that every rank
runs at once (:data:`~conveyor.schedules.core.VocabKind`): ``E`` (embedding), ``S``
(output forward and its statistics: the loss), ``T`` (output backward) and ``G``
(embedding gradient). Each holds collectives over the pipeline group, so every rank runs
the passes in one order (:attr:`Schedule.vocab`) and each rank's program says where
(:attr:`Schedule.vocab_slots`).

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

:func:`check_vocab` (which :func:`~conveyor.schedules.checks.validate` runs) lives in
:mod:`conveyor.schedules.checks` beside the other checks, and :func:`merged_order` (every
action and pass in the order of the one walk, :func:`~conveyor.schedules.order.walk`) in
:mod:`conveyor.schedules.order`; both are exported here too.

Pure Python (no torch import).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence

from conveyor.schedules.checks import check_vocab
from conveyor.schedules.core import VOCAB_KINDS, Action, B, F, Schedule, VocabAction
from conveyor.schedules.order import merged_order

__all__ = ["check_vocab", "merged_order", "vocab_collectives", "with_vocab"]

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
    when: list[tuple[float, int, int, VocabAction]] = []
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
            when.append((at, VOCAB_KINDS.index(kind), m, VocabAction(kind, m)))  # type: ignore[arg-type]
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
