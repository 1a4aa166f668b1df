"""The planner: pick schedule, chunks, micro-batch count and balance by simulation.

For every micro-batch count in a small set (p, 2p, 4p, 8p, capped by the batch size) the
model is profiled at that micro-batch size (:func:`conveyor.planning.profiler.profile`). For every
schedule that can run (stages = ranks x chunks <= profiled units) the units are balanced
by measured time, exact min-max under the memory limit (:func:`balance_within`), then
refined by simulation: moving one unit across a stage boundary is kept while the simulated
step gets shorter. Each candidate's step time is the simulated makespan with the measured
per-stage (F, B, W) and transfer time, plus a fixed per-action overhead; its memory per
rank is parameters + gradients + the activations the schedule holds at its peak.

An isolated profile underestimates a real step: ranks computing at once slow each other
(shared cores, caches, memory bandwidth) and transfers wait. So in a distributed world the
planner calibrates (:func:`calibrate_family`): at each micro-batch count it runs a few
real steps of one reference per schedule family (:data:`REFERENCES`: ``1f1b``, ``zb-h1``,
``interleaved-1f1b``, ``zbv``; time-balanced), scales F, B and W by measured / profiled
action time, and fits the per-transfer latency that makes the simulated reference step
equal the measured one.
Every candidate is then predicted from those few numbers, not measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from conveyor.errors import ConfigError
from conveyor.partition.balance import balance as min_max_balance
from conveyor.partition.balance import balance_within
from conveyor.pipeline_base import PipelineBase
from conveyor.planning.profiler import LossFn, Profile, profile, units
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

# The reference run per schedule family (split backward?, several chunks per rank?) that
# calibration measures: chunked schedules send twice as often, which one latency fitted
# on a one-chunk run underestimates.
Family = tuple[bool, bool]
REFERENCES: dict[Family, tuple[str, int]] = {
    (False, False): ("1f1b", 1),
    (True, False): ("zb-h1", 1),
    (False, True): ("interleaved-1f1b", 2),
    (True, True): ("zbv", 2),
}
CALIBRATION_WARMUP = 2
CALIBRATION_STEPS = 6


def family(schedule: Schedule) -> Family:
    """The calibration family of ``schedule``: (split backward, chunks > 1)."""
    return schedule.split_backward, schedule.chunks > 1


@dataclass(frozen=True)
class Calibration:
    """What a short real run of ``schedule`` (one schedule family) at ``microbatches``
    taught. ``scale``: measured / profiled seconds of F, B and W (B: the whole backward
    when the family does not split it); ``latency``: seconds per transfer that make the
    simulated step of the reference equal ``measured``; ``overhead``: seconds per step
    left over (negative when even zero latency simulates a longer step)."""

    schedule: str
    chunks: int
    split: bool
    microbatches: int
    balance: tuple[int, ...]
    scale: tuple[float, float, float]
    latency: float
    overhead: float
    measured: float

    def apply(self, prof: Profile) -> Profile:
        """``prof`` with this family's scaled times and fitted latency."""
        return prof.calibrated(*self.scale, split=self.split, latency=self.latency)


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
    profile: Profile | None = None  # the (calibrated) measurements the choice was made on
    calibration: Calibration | None = None  # of the chosen schedule's family, if any

    def table(self) -> str:
        """The ranked alternatives as a markdown table; the chosen one is marked (the
        simplest of those within :data:`TIE` of the fastest)."""
        lines = [
            "| # | schedule | chunks | micro-batches | balance | step ms | peak MB/rank | fits "
            "| chosen |",
            "|---:|---|---:|---:|---|---:|---|---|---|",
        ]
        mine = (self.schedule, self.chunks, self.microbatches, tuple(self.balance))
        for i, c in enumerate(self.alternatives, 1):
            peak = ", ".join(f"{b / 2**20:.1f}" for b in c.peak_memory)
            chosen = (c.schedule, c.chunks, c.microbatches, c.balance) == mine
            lines.append(
                f"| {i} | {c.schedule} | {c.chunks} | {c.microbatches} | "
                f"{list(c.balance)} | {c.predicted_step * 1e3:.2f} | {peak} | "
                f"{'yes' if c.fits else 'no'} | {'yes' if chosen else ''} |"
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


def evaluate(
    schedule: Schedule, prof: Profile, limit: float | None, overhead: float = 0.0
) -> Candidate:
    """Balance ``schedule`` for ``prof`` and predict its step time (plus ``overhead``
    seconds per step) and memory."""
    bal = _balanced(schedule, prof, limit)
    peaks = peak_memory(schedule, prof, bal)
    return Candidate(
        schedule=schedule.name,
        chunks=schedule.chunks,
        microbatches=schedule.microbatches,
        balance=tuple(bal),
        predicted_step=predict_step(schedule, prof, bal) + overhead,
        peak_memory=tuple(peaks),
        fits=_fits(peaks, limit),
    )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _run_reference(
    model: nn.Module | Sequence[nn.Module],
    inputs: Any,
    targets: Any,
    loss_fn: LossFn,
    schedule: Schedule,
    balance: Sequence[int],
) -> tuple[float, list[tuple[float, float, float]]]:
    """Median step seconds (slowest rank) and per-stage mean (F, B, W) of a few real steps
    of ``schedule``; a collective. Gradients already in ``.grad`` are left as they were."""
    from conveyor.observe.trace import measured_costs
    from conveyor.runtime.timing import Timing

    module = model if isinstance(model, nn.Module) else nn.Sequential(*model)
    params = list(module.parameters())
    keep = [p.grad for p in params]
    pipe = PipelineBase(
        module,
        loss_fn=loss_fn,
        microbatches=schedule.microbatches,
        schedule=schedule,
        chunks=schedule.chunks,
        balance=list(balance),
    )
    steps: list[float] = []
    timings: list[Timing] = []
    for i in range(CALIBRATION_WARMUP + CALIBRATION_STEPS):
        for p in params:
            p.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        pipe.train_step(inputs, targets)
        dist.barrier()
        if i >= CALIBRATION_WARMUP:
            steps.append(time.perf_counter() - t0)
            timings += pipe.last_step_timings()
    for p, g in zip(params, keep, strict=True):
        p.grad = g
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (steps, timings))
    # Every rank computes the same numbers from the same gathered data.
    step = statistics.median(max(s) for s in zip(*(g[0] for g in gathered), strict=True))
    costs = measured_costs([t for g in gathered for t in g[1]], schedule.stages)
    return step, costs


def _fit_latency(schedule: Schedule, prof: Profile, balance: Sequence[int], step: float) -> float:
    """The link latency at which the simulated step of ``schedule`` is ``step`` (0 when
    even zero latency simulates a longer step)."""

    def sim(latency: float) -> float:
        return predict_step(schedule, dataclasses.replace(prof, latency=latency), balance)

    lo, hi = 0.0, step
    if sim(lo) >= step:
        return 0.0
    while sim(hi) < step:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sim(mid) < step else (lo, mid)
    return (lo + hi) / 2


def calibrate_family(
    model: nn.Module | Sequence[nn.Module],
    inputs: Any,
    targets: Any,
    loss_fn: LossFn,
    prof: Profile,
    ranks: int,
    kind: Family,
    memory_limit: float | None = None,
) -> Calibration | None:
    """Calibrate ``prof`` for one schedule family by a few real steps of its reference
    schedule (:data:`REFERENCES`), time-balanced; a collective. None when the reference
    cannot run here (too few micro-batches or units)."""
    split = kind[0]
    name, chunks = REFERENCES[kind]
    try:
        if ranks * chunks > len(prof.layers):
            return None
        ref = get_schedule(name, ranks, prof.microbatches, chunks)
        bal = _balanced(ref, prof, memory_limit)
    except ConfigError:
        return None
    step, real = _run_reference(model, inputs, targets, loss_fn, ref, bal)
    predicted = prof.costs(bal, split)
    scale = tuple(
        sum(r[k] for r in real) / p if (p := sum(c[k] for c in predicted)) > 0 else 1.0
        for k in range(3)
    )
    f, b, w = scale
    scaled = prof.calibrated(f, b, w, split=split, latency=prof.latency)
    latency = _fit_latency(ref, scaled, bal, step)
    scaled = dataclasses.replace(scaled, latency=latency)
    return Calibration(
        schedule=ref.name,
        chunks=chunks,
        split=split,
        microbatches=prof.microbatches,
        balance=tuple(bal),
        scale=(f, b, w),
        latency=latency,
        overhead=step - predict_step(ref, scaled, bal),
        measured=step,
    )


# Candidates predicted within this fraction of the fastest are a tie: measurement noise is
# larger than that, so the simplest of them is chosen (the same one on every run).
TIE = 0.05
# A micro-batch count whose profiled step compute is this many times the median over the
# counts is re-measured (and dropped if it stays that far off).
OUTLIER = 3.0


def _sharded_profile(prof: Profile, shards: int) -> Profile:
    """``prof`` with each unit's parameter bytes (and so its gradient's) cut ``shards``
    ways."""
    if shards <= 1:
        return prof
    layers = tuple(
        dataclasses.replace(u, parameters=-(-u.parameters // shards)) for u in prof.layers
    )
    return dataclasses.replace(prof, layers=layers)


def _step_compute(prof: Profile) -> float:
    """Seconds of F and whole backward of one step's micro-batches, all units together."""
    return sum(prof.times(False)) * prof.microbatches


def _outliers(profiles: dict[int, Profile], counts: Sequence[int]) -> list[int]:
    totals = {m: _step_compute(profiles[m]) for m in counts if m in profiles}
    if len(totals) < 3:
        return []
    middle = statistics.median(totals.values())
    return [m for m, t in totals.items() if t > OUTLIER * middle]


Row = tuple[Candidate, Schedule, Profile, Calibration | None]


def _simplest_of_the_fastest(rows: list[Row], names: Sequence[str]) -> Row:
    """Among the fitting candidates within :data:`TIE` of the fastest (``rows`` are sorted
    fastest first), the one with the fewest actions per step, then the fewest chunks, then
    the first in ``names``."""
    first = rows[0][0]
    if not first.fits:
        return rows[0]
    limit = first.predicted_step * (1 + TIE)
    close = [r for r in rows if r[0].fits and r[0].predicted_step <= limit]
    order = {name: i for i, name in enumerate(names)}
    return min(
        close,
        key=lambda r: (
            r[0].microbatches * r[0].chunks,
            r[0].chunks,
            order.get(r[0].schedule, len(order)),
            r[0].predicted_step,
        ),
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
    calibrate: bool = True,
    param_shards: int = 1,
) -> Plan:
    """The fastest configuration for ``ranks`` pipeline ranks that fits ``memory_limit``
    bytes per rank (parameters + gradients + activations; optimizer state not included).

    ``inputs`` / ``targets``: one sample batch as for ``train_step``. In a distributed world
    every rank must call it (profiling and link measurement are collectives); all ranks get
    the same plan. ``microbatch_counts`` / ``schedules`` narrow the search; ``profiles``
    (micro-batch count -> :class:`Profile`) skips profiling for those counts. A count whose
    profile is far slower than the others' (:data:`OUTLIER`) is measured again, and left
    out if it stays so. Candidates predicted within :data:`TIE` of the fastest count as
    equal: the simplest of them is chosen, so the choice does not follow noise.
    ``param_shards``: into how many pieces each rank's parameters and gradients are cut
    (FSDP over D replicas times tensor parallelism T); the memory model counts one piece. With
    ``calibrate`` (used only when the world is ``ranks`` processes) each count's profile
    is calibrated by short real runs (:func:`calibrate_family`, about a second per
    count). Raises :class:`ConfigError` when no candidate fits the limit.
    """
    if ranks < 1:
        raise ConfigError(f"ranks must be >= 1, got {ranks}")
    batch = microbatch.batch_size(inputs, "inputs")
    n_units = len(units(model, microbatch.split(inputs, min(batch, ranks), "inputs")[0]))
    counts = (
        sorted({min(k * ranks, batch) for k in (1, 2, 4, 8)})
        if microbatch_counts is None
        else sorted(set(microbatch_counts))
    )
    names = [n for n in (schedules or SCHEDULE_NAMES)]
    cache = dict(profiles or {})
    real = calibrate and _distributed() and dist.get_world_size() == ranks
    rows: list[Row] = []
    for m in counts:
        cache[m] = cache.get(m) or profile(model, inputs, targets, loss_fn, m)
    for m in _outliers(cache, counts):
        # A profile far slower than the others was disturbed (another process, a one-off
        # stall): measure again, keep the fastest, and drop the count if it stays off.
        again = [cache[m], *(profile(model, inputs, targets, loss_fn, m) for _ in range(2))]
        cache[m] = min(again, key=_step_compute)
        if m in _outliers(cache, counts):
            del cache[m]
    for m in counts:
        if m not in cache:
            continue
        prof = _sharded_profile(cache[m], param_shards)
        cals = {
            kind: calibrate_family(model, inputs, targets, loss_fn, prof, ranks, kind, memory_limit)
            if real
            else None
            for kind in REFERENCES
        }
        for name in names:
            for chunks in _chunk_options(name):
                if ranks * chunks > n_units:
                    continue
                try:
                    if name == "zb-auto":
                        cal = cals[True, False]
                        fitted = cal.apply(prof) if cal else prof
                        built = _auto_schedule(ranks, m, fitted, memory_limit)
                        if built is None:
                            continue
                    else:
                        built = get_schedule(name, ranks, m, chunks)
                except ConfigError:
                    continue  # e.g. too few micro-batches for this schedule
                cal = cals[family(built)]
                fitted = cal.apply(prof) if cal else prof
                cand = evaluate(built, fitted, memory_limit, cal.overhead if cal else 0.0)
                rows.append((cand, built, fitted, cal))
    if not rows:
        raise ConfigError(
            f"no schedule can run {ranks} ranks on a model of {n_units} units with "
            f"micro-batch counts {counts}; use fewer ranks"
        )
    rows.sort(key=lambda r: (not r[0].fits, r[0].predicted_step, max(r[0].peak_memory)))
    best, built, best_prof, best_cal = _simplest_of_the_fastest(rows, names)
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
        alternatives=[r[0] for r in rows],
        built=built,
        memory_limit=memory_limit,
        profile=best_prof,
        calibration=best_cal,
    )


__all__ = [
    "Calibration",
    "Candidate",
    "Plan",
    "calibrate_family",
    "evaluate",
    "family",
    "peak_memory",
    "plan",
    "predict_step",
    "refine",
]
