"""The planner: pick schedule, chunks, micro-batch count and balance by simulation.

For every micro-batch count in a small set (p, 2p, 4p, 8p, capped by the batch size) the
model is profiled at that micro-batch size (:func:`conveyor.profile.profile`). For every
schedule that can run (stages = ranks x chunks <= profiled units) the units are balanced
by measured time, exact min-max under the memory limit (:func:`balance_within`), then
refined by simulation: moving one unit across a stage boundary is kept while the simulated
step gets shorter. Each candidate's step time is the simulated makespan with the measured
per-stage (F, B, W) and transfer time, plus a fixed per-action overhead; its memory per
rank is parameters + gradients + the activations the schedule holds at its peak.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from conveyor.errors import ConfigError
from conveyor.partition.balance import balance as min_max_balance
from conveyor.partition.balance import balance_within
from conveyor.profile import LossFn, Profile, profile, units
from conveyor.runtime import microbatch
from conveyor.schedules import Schedule
from conveyor.schedules.auto import zero_bubble_auto
from conveyor.schedules.core import B, F, W
from conveyor.schedules.registry import SCHEDULE_NAMES, get_schedule
from conveyor.simulate import simulate

# Engine bookkeeping per F/B action (tensor wrapping, pytree walks, the send/receive
# calls themselves), measured on CPU/gloo as (measured step - simulated step) / actions
# of 1F1B on the benchmark model; ``benchmarks/plan_accuracy.py`` re-checks it.
ACTION_OVERHEAD = 60e-6


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner simulated. ``predicted_step``: seconds;
    ``peak_memory``: bytes per rank; ``fits``: within the memory limit."""

    schedule: str
    chunks: int
    microbatches: int
    balance: tuple[int, ...]
    predicted_step: float
    peak_memory: tuple[int, ...]
    fits: bool


@dataclass(frozen=True)
class Plan:
    """The chosen configuration and the ranked alternatives.

    ``built`` is the schedule object to pass to ``Pipeline(schedule=...)`` (for
    ``zb-auto`` it is fitted to the measured costs, so pass it rather than the name).
    ``alternatives``: every candidate, fastest fitting first, then those that do not fit.
    """

    schedule: str
    chunks: int
    microbatches: int
    balance: list[int]
    predicted_step: float
    peak_memory: list[int]
    alternatives: list[Candidate]
    built: Schedule
    memory_limit: float | None = None
    profile: Profile | None = None  # the measurements at the chosen micro-batch count

    def table(self) -> str:
        """The ranked alternatives as a markdown table."""
        lines = [
            "| # | schedule | chunks | micro-batches | balance | step ms | peak MB/rank | fits |",
            "|---:|---|---:|---:|---|---:|---|---|",
        ]
        for i, c in enumerate(self.alternatives, 1):
            peak = ", ".join(f"{b / 2**20:.1f}" for b in c.peak_memory)
            lines.append(
                f"| {i} | {c.schedule} | {c.chunks} | {c.microbatches} | "
                f"{list(c.balance)} | {c.predicted_step * 1e3:.2f} | {peak} | "
                f"{'yes' if c.fits else 'no'} |"
            )
        return "\n".join(lines)


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


def peak_memory(schedule: Schedule, prof: Profile, balance: Sequence[int]) -> list[int]:
    """Bytes per rank: parameters and their gradients (no optimizer state) plus the
    activations held at the schedule's peak, walked action by action."""
    params = prof.parameter_bytes(balance)
    acts = prof.activation_bytes(balance)
    release = W if schedule.split_backward else B
    out = []
    for rank, program in enumerate(schedule.actions):
        held = peak = 0
        for a in program:
            if a.kind == F:
                held += acts[a.stage]
                peak = max(peak, held)
            elif a.kind == release:
                held -= acts[a.stage]
        out.append(peak + 2 * sum(params[s] for s in schedule.stages_of(rank)))
    return out


def predict_step(schedule: Schedule, prof: Profile, balance: Sequence[int]) -> float:
    """Simulated seconds of one training step of ``schedule`` with ``balance``."""
    costs = [
        (f + ACTION_OVERHEAD, b + ACTION_OVERHEAD, w)
        for f, b, w in prof.costs(balance, schedule.split_backward)
    ]
    return simulate(schedule, costs, prof.comm(balance)).makespan


def _stage_memory(schedule: Schedule, prof: Profile) -> list[list[float]]:
    """memory[s][i]: bytes unit i needs on stage s (for :func:`balance_within`)."""
    held = _held_per_stage(schedule)
    return [
        [2.0 * u.parameters + u.activations * held[s] for u in prof.layers]
        for s in range(schedule.stages)
    ]


def _fits(peaks: Sequence[int], limit: float | None) -> bool:
    return limit is None or max(peaks) <= limit


def _balanced(schedule: Schedule, prof: Profile, limit: float | None) -> list[int]:
    """Time min-max balance within ``limit`` (per stage; a rank with two stages is checked
    after), then refined by simulation."""
    times = prof.times(schedule.split_backward)
    stages = schedule.stages
    if limit is None:
        start = min_max_balance(times, stages)
    else:
        memory = _stage_memory(schedule, prof)
        try:
            start = balance_within(times, stages, memory, limit)
        except ConfigError:
            start = min_max_balance(times, stages)
        if not _fits(peak_memory(schedule, prof, start), limit) and schedule.chunks > 1:
            with contextlib.suppress(ConfigError):  # keep the per-stage split
                start = balance_within(times, stages, memory, limit / schedule.chunks)
    return refine(schedule, prof, start, limit)


def refine(
    schedule: Schedule, prof: Profile, balance: Sequence[int], limit: float | None = None
) -> list[int]:
    """Move single units across stage boundaries while the simulated step gets shorter
    (and the memory still fits): fixes what per-stage min-max misses, such as the last
    stage also paying the loss or a schedule that idles some stages more than others."""
    best = list(balance)
    best_time = predict_step(schedule, prof, best)
    for _ in range(4 * len(best)):
        improved = False
        for k in range(len(best) - 1):
            for d in (-1, 1):
                cand = list(best)
                cand[k] += d
                cand[k + 1] -= d
                if min(cand) < 1:
                    continue
                if limit is not None and not _fits(peak_memory(schedule, prof, cand), limit):
                    continue
                t = predict_step(schedule, prof, cand)
                if t < best_time * (1 - 1e-6):
                    best, best_time, improved = cand, t, True
        if not improved:
            break
    return best


def _chunk_options(name: str) -> tuple[int, ...]:
    return {"gpipe": (1,), "interleaved-1f1b": (2,), "looped-bfs": (2,)}.get(
        name, (2,) if name in ("zbv", "dualpipev") else (1,)
    )


def _auto_schedule(ranks: int, m: int, prof: Profile, limit: float | None) -> Schedule | None:
    """``zb-auto`` fitted to this profile (time-balanced), or None when nothing fits."""
    bal = min_max_balance(prof.times(True), ranks)
    cap: float | None = None
    if limit is not None:
        params = prof.parameter_bytes(bal)
        acts = prof.activation_bytes(bal)
        room = [
            (limit - 2 * p) / a if a > 0 else float(m) for p, a in zip(params, acts, strict=True)
        ]
        cap = min(min(room), float(m))
        if cap < 1:
            return None
    costs = prof.costs(bal, True)
    return zero_bubble_auto(ranks, m, costs, memory_limit=cap, comm=prof.comm(bal))


def evaluate(schedule: Schedule, prof: Profile, limit: float | None) -> Candidate:
    """Balance ``schedule`` for ``prof`` and predict its step time and memory."""
    bal = _balanced(schedule, prof, limit)
    peaks = peak_memory(schedule, prof, bal)
    return Candidate(
        schedule=schedule.name,
        chunks=schedule.chunks,
        microbatches=schedule.microbatches,
        balance=tuple(bal),
        predicted_step=predict_step(schedule, prof, bal),
        peak_memory=tuple(peaks),
        fits=_fits(peaks, limit),
    )


def plan(
    model: nn.Module | Sequence[nn.Module],
    inputs: Any,
    targets: Any,
    loss_fn: LossFn,
    ranks: int,
    memory_limit: float | None = None,
    *,
    microbatch_counts: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    profiles: dict[int, Profile] | None = None,
) -> Plan:
    """The fastest configuration for ``ranks`` pipeline ranks that fits ``memory_limit``
    bytes per rank (parameters + gradients + activations; optimizer state not included).

    ``inputs`` / ``targets``: one sample batch as for ``train_step``. In a distributed world
    every rank must call it (profiling and link measurement are collectives); all ranks get
    the same plan. ``microbatch_counts`` / ``schedules`` narrow the search; ``profiles``
    (micro-batch count -> :class:`Profile`) skips profiling for those counts. Raises
    :class:`ConfigError` when no candidate fits the limit.
    """
    if ranks < 1:
        raise ConfigError(f"ranks must be >= 1, got {ranks}")
    n_units = len(units(model))
    batch = microbatch.batch_size(inputs, "inputs")
    counts = (
        sorted({min(k * ranks, batch) for k in (1, 2, 4, 8)})
        if microbatch_counts is None
        else sorted(set(microbatch_counts))
    )
    names = [n for n in (schedules or SCHEDULE_NAMES)]
    cache = dict(profiles or {})
    rows: list[tuple[Candidate, Schedule]] = []
    for m in counts:
        prof = cache.get(m) or profile(model, inputs, targets, loss_fn, m)
        cache[m] = prof
        for name in names:
            for chunks in _chunk_options(name):
                if ranks * chunks > n_units:
                    continue
                try:
                    if name == "zb-auto":
                        built = _auto_schedule(ranks, m, prof, memory_limit)
                        if built is None:
                            continue
                    else:
                        built = get_schedule(name, ranks, m, chunks)
                except ConfigError:
                    continue  # e.g. too few micro-batches for this schedule
                rows.append((evaluate(built, prof, memory_limit), built))
    if not rows:
        raise ConfigError(
            f"no schedule can run {ranks} ranks on a model of {n_units} units with "
            f"micro-batch counts {counts}; use fewer ranks"
        )
    rows.sort(key=lambda r: (not r[0].fits, r[0].predicted_step, max(r[0].peak_memory)))
    best, built = rows[0]
    if not best.fits:
        least = min(rows, key=lambda r: max(r[0].peak_memory))[0]
        raise ConfigError(
            f"no configuration fits memory_limit={memory_limit:.4g} bytes per rank; the "
            f"smallest needs {max(least.peak_memory):.4g} ({least.schedule}, "
            f"{least.microbatches} micro-batches): raise the limit or use more ranks"
        )
    return Plan(
        schedule=best.schedule,
        chunks=best.chunks,
        microbatches=best.microbatches,
        balance=list(best.balance),
        predicted_step=best.predicted_step,
        peak_memory=list(best.peak_memory),
        alternatives=[c for c, _ in rows],
        built=built,
        memory_limit=memory_limit,
        profile=cache[best.microbatches],
    )


def plan_for_pipeline(
    model: nn.Module | Sequence[nn.Module],
    sample_inputs: Any,
    sample_targets: Any,
    loss_fn: LossFn,
    ranks: int,
    microbatches_hint: int | None = None,
    memory_limit: float | None = None,
) -> Plan:
    """What ``Pipeline(schedule="auto")`` needs: a plan for its first batch.

    With ``microbatches_hint`` (the Pipeline's ``microbatches``) only that count is
    considered, so the pipeline keeps the micro-batch count the user asked for.
    """
    counts = None if microbatches_hint is None else [microbatches_hint]
    return plan(
        model,
        sample_inputs,
        sample_targets,
        loss_fn,
        ranks,
        memory_limit,
        microbatch_counts=counts,
    )


__all__ = [
    "Candidate",
    "Plan",
    "evaluate",
    "peak_memory",
    "plan",
    "plan_for_pipeline",
    "predict_step",
    "refine",
]
