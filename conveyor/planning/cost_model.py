"""The planner's model of one candidate: its balance, step time and memory per rank.

A schedule's units are balanced by measured time, exact min-max under the memory limit
(:func:`~conveyor.partition.cuts.balance_within`), then refined by simulation: moving
one unit across a stage boundary is kept while the simulated step gets shorter. The step
time is the simulated makespan with the profiled per-stage (F, B, W) and transfer time,
plus a fixed per-action overhead.

The memory per rank (:func:`peak_memory`, what a memory limit is compared with) is the
bytes of the rank's stages' parameters, as many again for their gradients (one piece of
each when ``param_shards`` cuts them: FSDP, tensor parallelism), plus the most activation
bytes the schedule holds at once: per micro-batch in flight, what autograd saves for each
stage's backward (measured by :class:`~conveyor.runtime.memory.ActivationMeter`). Not
counted: optimizer state, buffers, the batch itself, tensors in transit between ranks,
temporaries inside one action and the allocator's cache.

With ``recompute`` (the planner's way out when no schedule fits) a stage keeps only its
input from F until B and re-runs its forward at B: B costs F more, and B holds the stage's
whole activations for its own duration (fused backward) or until W (split backward).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.errors import ConfigError
from conveyor.partition.cuts import balance as min_max_balance
from conveyor.partition.cuts import balance_within
from conveyor.planning.profile_data import Profile
from conveyor.schedules import Schedule
from conveyor.schedules.core import B, F, W
from conveyor.simulate import SimResult, simulate

# Engine bookkeeping per F/B action (tensor wrapping, pytree walks, the send/receive
# calls themselves), measured on CPU/gloo as (measured step - simulated step) / actions
# of 1F1B on the benchmark model; ``benchmarks/plan_accuracy.py`` re-checks it.
ACTION_OVERHEAD = 60e-6


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner simulated.

    Attributes:
        schedule: The schedule's name.
        chunks: Stages per rank.
        microbatches: Micro-batches per step.
        balance: Units per stage.
        predicted_step: Seconds per training step.
        peak_memory: Bytes per rank, as the module docstring counts them.
        fits: Whether every rank is within the memory limit.
        recompute: Whether every stage recomputes its forward at B.
        vocab: Whether the vocabulary layers are split over every rank
            (``vocab_parallel``; :mod:`~conveyor.planning.vocab`).
        bubble: The simulated bubble of that step: the idle share of every rank over the
            makespan (:attr:`~conveyor.simulate.SimResult.bubble`).
    """

    schedule: str
    chunks: int
    microbatches: int
    balance: tuple[int, ...]
    predicted_step: float
    peak_memory: tuple[int, ...]
    fits: bool
    recompute: bool = False
    vocab: bool = False
    bubble: float = 0.0


def stage_inputs(prof: Profile, balance: Sequence[int]) -> list[int]:
    """Bytes of each stage's input for one micro-batch: what recompute keeps from F to B.

    Stage 0's input is the caller's batch, which it holds anyway: counted 0.

    Args:
        prof: The per-unit bytes.
        balance: Units per stage.

    Returns:
        Bytes per stage.
    """
    ends = [sum(balance[: s + 1]) for s in range(len(balance))]
    return [0] + [prof.layers[end - 1].output for end in ends[:-1]]


def peak_memory(
    schedule: Schedule, prof: Profile, balance: Sequence[int], recompute: bool = False
) -> list[int]:
    """Bytes per rank at the schedule's peak, walked action by action.

    Args:
        schedule: What runs.
        prof: The per-unit bytes.
        balance: Units per stage.
        recompute: Count what recompute keeps (module docstring) instead.

    Returns:
        Per rank: parameters and their gradients (no optimizer state) plus the most
        activations held at once.

    Raises:
        ConfigError: ``balance`` does not cover the profiled units.
    """
    params = prof.parameter_bytes(balance)
    acts = prof.activation_bytes(balance)
    kept = stage_inputs(prof, balance) if recompute else acts
    split = schedule.split_backward
    out = []
    for rank, program in enumerate(schedule.actions):
        held = peak = 0
        for a in program:
            if a.kind == F:
                held += kept[a.stage]
            elif a.kind == B and recompute:
                # The forward runs again: its activations live through B (and until W).
                held += acts[a.stage] - kept[a.stage]
                peak = max(peak, held)
                held -= 0 if split else acts[a.stage]
            elif a.kind == (W if split else B):
                held -= acts[a.stage] if recompute else kept[a.stage]
            peak = max(peak, held)
        out.append(peak + 2 * sum(params[s] for s in schedule.stages_of(rank)))
    return out


def recomputed_shares(schedule: Schedule) -> list[float]:
    """Per stage, the share of its micro-batches whose B re-runs the forward under
    recompute: all but those whose B directly follows their F on the rank (the runtime
    keeps those activations; ``RankProgram.adjacent``)."""
    kept = [0] * schedule.stages
    for actions in schedule.actions:
        for a, b in itertools.pairwise(actions):
            if a.kind == F and b.kind == B and (a.stage, a.microbatch) == (b.stage, b.microbatch):
                kept[a.stage] += 1
    return [1.0 - k / schedule.microbatches for k in kept]


def predict_step(
    schedule: Schedule, prof: Profile, balance: Sequence[int], recompute: bool = False
) -> float:
    """Simulated seconds of one training step.

    Args:
        schedule: What runs.
        prof: The per-unit times and the link.
        balance: Units per stage.
        recompute: Charge B its stage's forward again where it re-runs it
            (:func:`recomputed_shares`).

    Returns:
        The simulated makespan, :data:`ACTION_OVERHEAD` charged to every F and B.

    Raises:
        ConfigError: ``balance`` does not cover the profiled units.
    """
    return simulated_step(schedule, prof, balance, recompute).makespan


def simulated_step(
    schedule: Schedule, prof: Profile, balance: Sequence[int], recompute: bool = False
) -> SimResult:
    """The simulation :func:`predict_step` reads its makespan from (same arguments)."""
    shares = recomputed_shares(schedule) if recompute else [0.0] * schedule.stages
    plain = prof.costs(balance, schedule.split_backward)
    costs = [
        (f + ACTION_OVERHEAD, b + ACTION_OVERHEAD + f * share, w)
        for (f, b, w), share in zip(plain, shares, strict=True)
    ]
    return simulate(schedule, costs, prof.comm(balance))


def balanced(
    schedule: Schedule, prof: Profile, limit: float | None, recompute: bool = False
) -> list[int]:
    """Time min-max balance within the memory limit, then refined by simulation.

    The limit is applied per stage; a rank with several stages is checked after, and its
    stages get an equal share of the limit when together they exceed it. With
    ``recompute`` the time balance is refined under the limit directly.

    Args:
        schedule: What runs.
        prof: The per-unit times and bytes.
        limit: Bytes per rank (the module docstring's count), or None for no limit.
        recompute: Whether every stage recomputes its forward at B.

    Returns:
        Units per stage (it may still not fit: see :func:`evaluate`).

    Raises:
        ConfigError: The schedule has more stages than there are units.
    """
    times = prof.times(schedule.split_backward)
    stages = schedule.stages
    start = min_max_balance(times, stages)
    # Only a time balance that does not fit is traded for one that does (the per-stage
    # limit below can miss a split that fits its rank as a whole).
    if limit is not None and not recompute and not _fits(peak_memory(schedule, prof, start), limit):
        memory = _stage_memory(schedule, prof)
        try:
            start = balance_within(times, stages, memory, limit)
        except ConfigError:
            start = min_max_balance(times, stages)
        if not _fits(peak_memory(schedule, prof, start), limit) and schedule.chunks > 1:
            with contextlib.suppress(ConfigError):  # keep the per-stage split
                start = balance_within(times, stages, memory, limit / schedule.chunks)
    return refine(schedule, prof, start, limit, recompute)


def refine(
    schedule: Schedule,
    prof: Profile,
    balance: Sequence[int],
    limit: float | None = None,
    recompute: bool = False,
) -> list[int]:
    """Move single units across stage boundaries while the simulated step gets shorter.

    Fixes what per-stage min-max misses, such as the last stage also paying the loss or a
    schedule that idles some stages more than others.

    Args:
        schedule: What runs.
        prof: The per-unit times and bytes.
        balance: Units per stage to start from.
        limit: Bytes per rank every accepted move must stay within, or None.
        recompute: Whether every stage recomputes its forward at B.

    Returns:
        Units per stage, never slower than ``balance``.

    Raises:
        ConfigError: ``balance`` does not cover the profiled units.
    """
    best = list(balance)
    best_time = predict_step(schedule, prof, best, recompute)
    for _ in range(4 * len(best)):
        improved = False
        for k in range(len(best) - 1):
            for d in (-1, 1):
                cand = list(best)
                cand[k] += d
                cand[k + 1] -= d
                if min(cand) < 1:
                    continue
                peaks = peak_memory(schedule, prof, cand, recompute)
                if limit is not None and not _fits(peaks, limit):
                    continue
                t = predict_step(schedule, prof, cand, recompute)
                if t < best_time * (1 - 1e-6):
                    best, best_time, improved = cand, t, True
        if not improved:
            break
    return best


def evaluate(
    schedule: Schedule,
    prof: Profile,
    limit: float | None,
    overhead: float = 0.0,
    recompute: bool = False,
) -> Candidate:
    """Balance ``schedule`` for ``prof`` and predict its step time and memory.

    Args:
        schedule: What runs.
        prof: The per-unit times and bytes (calibrated, if calibration ran).
        limit: Bytes per rank (the module docstring's count), or None for no limit.
        overhead: Seconds added to the predicted step (a calibration's leftover).
        recompute: Whether every stage recomputes its forward at B.

    Returns:
        The candidate, marked whether it fits ``limit``.

    Raises:
        ConfigError: The schedule has more stages than there are units.
    """
    bal = balanced(schedule, prof, limit, recompute)
    peaks = peak_memory(schedule, prof, bal, recompute)
    step = simulated_step(schedule, prof, bal, recompute)
    return Candidate(
        schedule=schedule.name,
        chunks=schedule.chunks,
        microbatches=schedule.microbatches,
        balance=tuple(bal),
        predicted_step=step.makespan + overhead,
        peak_memory=tuple(peaks),
        fits=_fits(peaks, limit),
        recompute=recompute,
        bubble=step.bubble,
    )


def _held_per_stage(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches it keeps activations for at once."""
    release = W if schedule.split_backward else B
    held = [0] * schedule.stages
    peak = [0] * schedule.stages
    for program in schedule.actions:
        for a in program:
            if a.kind == F:
                held[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], held[a.stage])
            elif a.kind == release:
                held[a.stage] -= 1
    return peak


def _stage_memory(schedule: Schedule, prof: Profile) -> list[list[float]]:
    """memory[s][i]: bytes unit i needs on stage s (for ``balance_within``)."""
    held = _held_per_stage(schedule)
    return [
        [2.0 * u.parameters + u.activations * held[s] for u in prof.layers]
        for s in range(schedule.stages)
    ]


def _fits(peaks: Sequence[int], limit: float | None) -> bool:
    return limit is None or max(peaks) <= limit


__all__ = [
    "ACTION_OVERHEAD",
    "Candidate",
    "balanced",
    "evaluate",
    "peak_memory",
    "predict_step",
    "refine",
    "stage_inputs",
]
