"""Memory-bounded zero-bubble scheduling fitted to measured costs (the paper's ZB-1p/2p).

:func:`zero_bubble_auto` follows the automatic scheduler of Qi et al. ("Zero Bubble
Pipeline Parallelism", ICLR 2024, section 3.1): a list scheduler runs the pipeline in
simulated time with the real costs (B first, then F while memory allows, W to fill the
gaps and to free memory: :func:`~conveyor.schedules.greedy.greedy_run`), once per
setting of the few choices the paper searches over: how many forwards each rank runs
before its first B (as many as fill the time until that B arrives, one more, 1F1B's or
ZB-H2's count, or no limit) and whether a W may run in a gap it does not fit. The
hand-made schedules of the same shape (ZB-H1 and ZB-H2; zbv, v-half and v-min for a V)
join the candidates where they fit the cap; every candidate is simulated and the fastest
kept. A heuristic search, not an exact solver: an ILP (the paper's own refinement step,
or scipy's ``milp``) over 3 x 32 x 256 actions with their start times is far beyond the
10 s a schedule may take, while a run of the list scheduler takes about 0.2 s there,
and on the paper's twelve Table 9 settings the search already matches or beats the
paper's ZB-1p and ZB-2p (docs: "Checked against the papers").

Memory is counted in micro-batches of a rank's whole share, held from F until W. After
its B a micro-batch still holds ``w_memory`` of that (what its W needs: the inputs and
output gradients of its GEMMs); by default :data:`~conveyor.schedules.simulation.W_MEMORY`,
what conveyor's runtime holds of a transformer layer; the paper's accounting (its Table 1)
is M_W / M_B.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from conveyor.errors import ConfigError, ScheduleError
from conveyor.schedules.core import (
    Action,
    B,
    F,
    Schedule,
    check_sizes,
    loop_placement,
    requires,
    v_placement,
)
from conveyor.schedules.greedy import FILLS, StageCost, greedy_run
from conveyor.schedules.simulation import (
    W_MEMORY,
    CostSpec,
    action_durations,
    normalize_cost,
    peak_activations,
    simulate,
)
from conveyor.schedules.v_shape import v_half, v_min
from conveyor.schedules.zbv import zbv
from conveyor.schedules.zero_bubble import zb_h1, zb_h2

SHAPES = (1, 2)
"""The ``chunks`` :func:`zero_bubble_auto` builds: one stage per rank, or a V of two."""


def _memory_cap(ranks: int, microbatches: int, cap: float | None) -> float:
    """``microbatch_cap`` checked (default ``ranks``), at most m."""
    if cap is None:
        return float(min(ranks, microbatches))
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not cap >= 1:  # NaN too
        raise ConfigError(f"microbatch_cap must be a number of micro-batches >= 1, got {cap!r}")
    return float(min(cap, microbatches))  # no rank can hold more than m


def _check_w_memory(w_memory: float) -> float:
    """``w_memory`` as a float in [0, 1]; ConfigError otherwise."""
    number = isinstance(w_memory, int | float) and not isinstance(w_memory, bool)
    if not (number and 0.0 <= w_memory <= 1.0):  # NaN too
        raise ConfigError(f"w_memory must be a share in [0, 1], got {w_memory!r}")
    return float(w_memory)


def _first_b_warmup(
    placement: Sequence[int], durations: Sequence[StageCost], comm: float
) -> list[int]:
    """Per rank, how many forwards end before its first B can arrive (at least 1).

    One micro-batch alone crosses the pipeline (F up, B back down, ``comm`` between
    ranks); a rank that keeps running forwards from its first F until then never waits
    for that B. This is the paper's warm-up: as many F as fill the gap, or (a choice the
    search makes) one more, which may delay the B a little.
    """
    ranks = max(placement) + 1
    stages = len(placement)
    end: dict[Action, float] = {}
    for kind in (F, B):
        order = range(stages) if kind == F else range(stages - 1, -1, -1)
        for s in order:
            action = Action(kind, s, 0)
            start = 0.0
            for dep in requires(action, stages):
                far = placement[dep.stage] != placement[s]
                start = max(start, end[dep] + (comm if far else 0.0))
            end[action] = start + durations[s][0 if kind == F else 1]
    warmup = []
    for rank in range(ranks):
        own = [s for s in range(stages) if placement[s] == rank]
        first_f = min(end[Action(F, s, 0)] - durations[s][0] for s in own)
        first_b = min(end[Action(B, s, 0)] - durations[s][1] for s in own)
        f_time = max(min(durations[s][0] for s in own), 1e-12)
        warmup.append(max(1, math.floor((first_b - first_f) / f_time + 1e-9)))
    return warmup


def _warmups(
    chunks: int, ranks: int, placement: Sequence[int], durations: Sequence[StageCost], comm: float
) -> list[list[int] | None]:
    """The warm-up limits searched: forwards a rank may run ahead of its backwards."""
    limits: list[list[int] | None] = [None]  # memory alone limits the forwards
    until_b = _first_b_warmup(placement, durations, comm)
    limits += [[count + extra for count in until_b] for extra in (0, 1)]
    if chunks == 1:
        limits.append([ranks - r for r in range(ranks)])  # 1F1B's
        limits += [[2 * (ranks - r) - 1 + extra for r in range(ranks)] for extra in (0, 1, 2)]
    unique: list[list[int] | None] = []
    for limit in limits:  # equal costs often make two of them the same
        if limit not in unique:
            unique.append(limit)
    return unique


@functools.lru_cache(maxsize=16)
def _references(chunks: int, ranks: int, microbatches: int) -> tuple[Schedule, ...]:
    """The hand-made schedules of the same shape, candidates where they fit the cap
    (kept for the next call: a search over costs or caps asks for the same ones)."""
    if chunks == 1:
        return (zb_h1(ranks, microbatches), zb_h2(ranks, microbatches))
    return (zbv(ranks, microbatches), v_half(ranks, microbatches), v_min(ranks, microbatches))


def zero_bubble_auto(
    ranks: int,
    microbatches: int,
    cost: CostSpec = (1.0, 1.0, 1.0),
    microbatch_cap: float | None = None,
    comm: float = 0.0,
    chunks: int = 1,
    *,
    w_memory: float = W_MEMORY,
) -> Schedule:
    """A split-backward schedule fitted to ``cost`` under a memory cap (``zb-auto``).

    The candidates are the hand-made schedules of the shape (ZB-H1 and ZB-H2, or zbv,
    v-half and v-min) and the list scheduler's, one per warm-up and fill setting; those
    whose peak exceeds the cap are dropped and the rest simulated. So the result is never
    slower than ZB-H1 at a cap of ``ranks``, ZB-H2 at ``2 * ranks - 1``, or zbv / v-half
    at theirs.

    Args:
        ranks: Pipeline ranks.
        microbatches: Micro-batches per step.
        cost: (F, B, W) durations of one rank's whole share for one micro-batch, or one
            (F, B, W) per stage (``ranks * chunks`` of them), in any time unit.
        microbatch_cap: The most micro-batch activations any rank may hold, counted in
            micro-batches through its whole share. Default: ``ranks``, 1F1B's peak. (Not
            bytes: ``Pipeline``'s ``memory_limit`` is bytes.)
        comm: Latency of one transfer between ranks, in the unit of ``cost``.
        chunks: 1 for one stage per rank; 2 for a V (rank r holds stages r and
            2p-1-r, zbv's placement).
        w_memory: The share of a micro-batch's activations still held between its B and
            its W (what its weight GEMMs read). Default
            :data:`~conveyor.schedules.simulation.W_MEMORY` (0.76), conveyor's runtime on
            a transformers Llama layer; pass your model's, measured
            (``pipe.last_step_memory()``: ``held_after_b / forward``), for a tighter
            schedule. The Zero Bubble paper counts M_W / M_B (about 0.3-0.45 for its GPT
            models).

    Returns:
        The candidate with the smallest simulated makespan, then the smallest span (the
        longest any rank is busy or waiting), then the smallest peak, named
        ``"zb-auto"``.

    Raises:
        ConfigError: For sizes below 1, ``chunks`` other than 1 or 2, bad costs, a
            ``microbatch_cap`` that is not a number >= 1, or a ``w_memory`` outside [0, 1].
    """
    check_sizes(ranks, microbatches, chunks)
    if chunks not in SHAPES:
        raise ConfigError(
            f"zb-auto builds one stage per rank (chunks=1) or a V of two (chunks=2), got "
            f"chunks={chunks}; use interleaved-1f1b for more chunks per rank"
        )
    cap = _memory_cap(ranks, microbatches, microbatch_cap)
    share = _check_w_memory(w_memory)
    references = _references(chunks, ranks, microbatches)
    per_kind = action_durations(references[0], normalize_cost(references[0], cost))
    durations: list[StageCost] = [(d[F], d[B], d["W"]) for d in per_kind]
    placement = loop_placement(ranks, 1) if chunks == 1 else v_placement(ranks)
    # (schedule, makespan, span, peak) of each candidate within the cap: the hand-made
    # ones simulated, the list scheduler's timed by its own run (which the simulator
    # never finds slower).
    timed: list[tuple[Schedule, float, float, float]] = []
    for reference in references:
        peak = max(peak_activations(reference, w_memory=share))
        if peak <= cap + 1e-9:
            result = simulate(reference, list(durations), comm)
            timed.append((reference, result.makespan, result.span, peak))
    stage_cap = [cap * chunks] * ranks  # the list scheduler counts one stage's activations
    # A run that cannot beat the best (makespan, span) so far stops early (None).
    bound = min(((m, s) for _, m, s, _ in timed), default=(math.inf, math.inf))
    for fill in FILLS:
        for warmup in _warmups(chunks, ranks, placement, durations, comm):
            try:
                run = greedy_run(
                    placement, microbatches, durations, stage_cap, warmup, comm, fill, share,
                    bound,
                )  # fmt: skip
            except ScheduleError:
                # A V's ranks can fill their cap with first-chunk forwards and then wait
                # on each other for good: that setting is no candidate.
                continue
            if run is None:
                continue
            bound = min(bound, (run.makespan, run.span))
            actions = tuple(tuple(program) for program in run.programs)
            schedule = Schedule("zb-auto", ranks, microbatches, placement, actions, True)
            peak = max(peak_activations(schedule, w_memory=share))  # within the cap
            timed.append((schedule, run.makespan, run.span, peak))
    if not timed:
        least = min(max(peak_activations(r, w_memory=share)) for r in references)
        raise ConfigError(
            f"no V schedule of {ranks} ranks fits microbatch_cap={microbatch_cap}; "
            f"v-min holds {least:g} micro-batches: raise the cap to that, or use chunks=1"
        )
    # Rounded: sums of the same costs in another order differ in the last bits.
    best = min(
        range(len(timed)),
        key=lambda i: (round(timed[i][1], 9), round(timed[i][2], 9), timed[i][3], i),
    )
    return dataclasses.replace(timed[best][0], name="zb-auto")
