"""Memory-bounded zero-bubble scheduling fitted to measured costs (the paper's auto idea).

:func:`zero_bubble_auto` runs the greedy B > F > W list scheduler
(:func:`~conveyor.schedules.greedy.greedy_programs`) with the real per-stage costs under
a memory cap, in a few variants (W only where it fits the gap or wherever a rank would
idle; with or without 1F1B's / ZB-H2's limit on forwards ahead of backwards), simulates
them beside ZB-H1 and ZB-H2 (where their memory fits the cap) and keeps the fastest.
Keeping ZB-H1 among the candidates makes the result never slower than ZB-H1 at a cap of
``ranks`` micro-batches; the greedy variants win where stage costs are uneven.
"""

from __future__ import annotations

import dataclasses
from typing import cast

from conveyor.errors import ConfigError
from conveyor.schedules.core import Schedule, check_sizes, loop_placement
from conveyor.schedules.greedy import FILLS, StageCost, greedy_programs
from conveyor.schedules.simulation import (
    CostSpec,
    is_per_stage,
    normalize_cost,
    peak_activations,
    simulate,
)
from conveyor.schedules.zero_bubble import zb_h1, zb_h2


def _memory_cap(ranks: int, microbatches: int, cap: float | None) -> int:
    """``microbatch_cap`` as whole micro-batches (default ``ranks``), checked, at most m."""
    if cap is None:
        return ranks
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not cap >= 1:  # NaN too
        raise ConfigError(f"microbatch_cap must be a number of micro-batches >= 1, got {cap!r}")
    return int(min(cap, microbatches))  # no rank can hold more than m


def zero_bubble_auto(
    ranks: int,
    microbatches: int,
    cost: CostSpec = (1.0, 1.0, 1.0),
    microbatch_cap: float | None = None,
    comm: float = 0.0,
) -> Schedule:
    """A split-backward schedule fitted to ``cost`` under a memory cap (``zb-auto``).

    One stage per rank. The candidates are ZB-H1, ZB-H2 and the greedy variants; those
    whose peak exceeds the cap are dropped, and the rest are simulated.

    Args:
        ranks: Pipeline ranks.
        microbatches: Micro-batches per step.
        cost: (F, B, W) durations of one rank's stage for one micro-batch, or one
            (F, B, W) per stage (``ranks`` of them), in any time unit.
        microbatch_cap: The most micro-batch activations any rank may hold, counted in
            whole micro-batches (a fraction is rounded down). Default: ``ranks``,
            1F1B's peak. (Not bytes: ``Pipeline``'s ``memory_limit`` is bytes.)
        comm: Latency of one transfer between ranks, in the unit of ``cost``.

    Returns:
        The candidate with the smallest simulated makespan, then the smallest peak,
        named ``"zb-auto"``.

    Raises:
        ConfigError: For sizes below 1, bad costs, or a ``microbatch_cap`` that is not a
            number >= 1.
    """

    check_sizes(ranks, microbatches)
    cap = _memory_cap(ranks, microbatches, microbatch_cap)
    h1 = zb_h1(ranks, microbatches)
    normalized = normalize_cost(h1, cost)
    if is_per_stage(normalized):
        durations = list(normalized)
    else:
        durations = [cast(StageCost, normalized)] * ranks
    placement = loop_placement(ranks, 1)
    candidates = [h1, zb_h2(ranks, microbatches)]
    one_f_one_b_inflight = [ranks - r for r in range(ranks)]
    h2_warmup = [2 * (ranks - r) - 1 for r in range(ranks)]
    for fill in FILLS:
        for inflight in (None, one_f_one_b_inflight, h2_warmup):
            programs = greedy_programs(
                placement, microbatches, durations, [cap] * ranks, inflight, comm, fill
            )
            candidates.append(
                Schedule(
                    name="zb-auto",
                    ranks=ranks,
                    microbatches=microbatches,
                    placement=placement,
                    actions=tuple(tuple(program) for program in programs),
                    split_backward=True,
                )
            )
    best: tuple[float, float, int] | None = None
    chosen = h1
    for index, candidate in enumerate(candidates):
        peak = max(peak_activations(candidate))
        if peak > cap:
            continue
        score = (simulate(candidate, durations, comm).makespan, peak, index)
        if best is None or score < best:
            best, chosen = score, candidate
    return dataclasses.replace(chosen, name="zb-auto")
