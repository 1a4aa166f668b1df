"""Calibrate a profile against a few real steps, per schedule family.

An isolated profile underestimates a real step: ranks computing at once slow each other
(shared cores, caches, memory bandwidth) and transfers wait. So in a distributed world the
planner calibrates (:func:`calibrate_family`): at each micro-batch count it runs a few
real steps of one reference per schedule family (:data:`REFERENCES`: ``1f1b``, ``zb-h1``,
``interleaved-1f1b``, ``zbv``; time-balanced), scales F, B and W by measured / profiled
action time, and fits the per-transfer latency that makes the simulated reference step
equal the measured one. Every candidate is then predicted from those few numbers, not
measured.

The reference pipelines get the planned pipeline's ``recompute`` and ``autocast`` (and a
meta model's ``weights`` / ``init_seed``), so they time its step, but always with eager
stages: ``compile=`` is not applied (compiling four references would cost more than the
steps they time), and a calibration says so (:attr:`Calibration.compile_skipped`; the
plan's :attr:`~conveyor.planning.plan_result.Plan.basis`). ``fsdp`` and ``tp_plan`` never reach
it: calibration runs only where the world is the pipeline ranks alone, with no replicas or
tensor-parallel ranks to shard over.

A model on the meta device is calibrated on a meta copy of it
(:func:`conveyor.planning.meta.meta_copy`): each rank makes real only its own stages of the
reference, as the pipeline would, and drops them after the run.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn

from conveyor._build import build
from conveyor._options import Options
from conveyor.context import current
from conveyor.errors import ConfigError
from conveyor.observe.trace import measured_costs
from conveyor.planning.costs import Costs
from conveyor.planning.memory import Setting
from conveyor.planning.meta import as_module, is_meta, meta_copy
from conveyor.planning.prediction import balanced, recomputed_shares, simulated
from conveyor.planning.timing import LossFn
from conveyor.runtime import microbatch
from conveyor.runtime.timing import Timing
from conveyor.schedules import Schedule
from conveyor.schedules.registry import get_schedule

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
    """The calibration family of ``schedule``.

    Args:
        schedule: Any built schedule.

    Returns:
        (splits the backward, chunks > 1): a key of :data:`REFERENCES`.
    """
    return schedule.split_backward, schedule.chunks > 1


@dataclass(frozen=True)
class Calibration:
    """What a short real run of one schedule family's reference taught.

    Attributes:
        schedule: The reference schedule's name.
        chunks: Its stages per rank.
        split: Whether the family splits the backward.
        microbatches: Micro-batches per step of the run.
        balance: Units per stage of the run.
        scale: Measured / profiled seconds of F, B and W (B: the whole backward when the
            family does not split it).
        latency: Seconds per transfer that make the simulated step of the reference
            equal ``measured``.
        overhead: Seconds per step left over (negative when even zero latency simulates a
            longer step).
        measured: The run's median step, seconds.
        compile_skipped: The pipeline asks for compiled stages (``compile=``) but the
            reference ran eager ones, as every reference does: its scale factors are eager
            speeds.
    """

    schedule: str
    chunks: int
    split: bool
    microbatches: int
    balance: tuple[int, ...]
    scale: tuple[float, float, float]
    latency: float
    overhead: float
    measured: float
    compile_skipped: bool = False

    def apply(self, prof: Costs) -> Costs:
        """``prof`` with this family's scaled times and fitted latency.

        Args:
            prof: A profile at the same micro-batch count.

        Returns:
            A new, calibrated profile.
        """
        return prof.calibrated(*self.scale, split=self.split, latency=self.latency)


def calibrate_family(
    model: nn.Module | Sequence[nn.Module],
    inputs: Any,
    targets: Any,
    loss_fn: LossFn | None,
    prof: Costs,
    ranks: int,
    kind: Family,
    memory_limit: float | None = None,
    options: Options | None = None,
    setting: Setting | None = None,
) -> Calibration | None:
    """Calibrate ``prof`` for one schedule family; a collective.

    Runs a few real steps of the family's reference schedule (:data:`REFERENCES`),
    time-balanced within ``memory_limit``.

    Args:
        model: The model being planned.
        inputs: One sample batch, as for ``train_step``.
        targets: Its targets.
        loss_fn: ``loss_fn(output, targets)``.
        prof: The profile at the micro-batch count to calibrate.
        ranks: Pipeline ranks (the world size).
        kind: The family, as :func:`family` gives it.
        memory_limit: Bytes per rank, as the planner's ``memory_limit``
            (:mod:`~conveyor.planning.memory`), for the reference's balance; or None.
        options: The pipeline's options, so the reference runs its step (recompute,
            autocast; eager stages even with ``compile=``, see the module docstring), or
            None for a plain step.
        setting: What the memory model counts (:class:`~conveyor.planning.memory.Setting`);
            default: AdamW on the parameters as the model holds them.

    Returns:
        The calibration, or None when the reference cannot run here (too few
        micro-batches or units).
    """
    split = kind[0]
    name, chunks = REFERENCES[kind]
    recompute = options is not None and options.recompute is True
    rules = setting or Setting(recompute=recompute)
    try:
        if ranks * chunks > len(prof.layers):
            return None
        ref = get_schedule(name, ranks, prof.microbatches, chunks)
        bal = balanced(ref, prof, memory_limit, rules)
    except ConfigError:
        return None
    step, real = _run_reference(model, inputs, targets, loss_fn, ref, bal, options)
    if recompute:  # a measured B re-ran its forward: scale the profile's B by B alone
        shares = recomputed_shares(ref)
        real = [(f, b - f * s, w) for (f, b, w), s in zip(real, shares, strict=True)]
    predicted = prof.costs(bal, split)
    scale = tuple(
        sum(r[k] for r in real) / p if (p := sum(c[k] for c in predicted)) > 0 else 1.0
        for k in range(3)
    )
    f, b, w = scale
    scaled = prof.calibrated(f, b, w, split=split, latency=prof.latency)
    latency = _fit_latency(ref, scaled, bal, step, recompute)
    scaled = dataclasses.replace(scaled, latency=latency)
    return Calibration(
        schedule=ref.name,
        chunks=chunks,
        split=split,
        microbatches=prof.microbatches,
        balance=tuple(bal),
        scale=(f, b, w),
        latency=latency,
        overhead=step - simulated(ref, scaled, bal, recompute).makespan,
        measured=step,
        compile_skipped=options is not None and options.compile_keywords() is not None,
    )


def _run_reference(
    model: nn.Module | Sequence[nn.Module],
    inputs: Any,
    targets: Any,
    loss_fn: LossFn | None,
    schedule: Schedule,
    balance: Sequence[int],
    template: Options | None = None,
) -> tuple[float, list[tuple[float, float, float]]]:
    """Median step seconds (slowest rank) and per-stage mean (F, B, W) of a few real steps
    of ``schedule``, built and run as a pipeline with ``template``'s options builds and
    runs them; a collective. Gradients already in ``.grad`` are left as they were."""
    ctx = current()
    meta = is_meta(model)
    # A meta model stays meta: the reference gives values to this rank's stages of a copy.
    module = meta_copy(model, ctx.device) if meta else as_module(model)
    params = list(module.parameters())
    keep = [p.grad for p in params]
    m = schedule.microbatches
    chunks, cut = schedule.chunks, list(balance)
    options = Options(loss_fn=loss_fn, microbatches=m, chunks=chunks, balance=cut)  # eager
    if template is not None:
        # Calibration runs only where the world is the pipeline ranks alone: no replicas
        # or tensor-parallel ranks for fsdp / tp_plan to shard over.
        options = dataclasses.replace(
            options, recompute=template.recompute, autocast=template.autocast,
            weights=template.weights if meta else None, init_seed=template.init_seed,
        )  # fmt: skip
    parts = build(module, schedule, options, ctx, microbatch.first(inputs, m))
    steps: list[float] = []
    timings: list[Timing] = []
    for i in range(CALIBRATION_WARMUP + CALIBRATION_STEPS):
        for p in params:
            p.grad = None
        dist.barrier()
        t0 = time.perf_counter()
        record = parts.stepper.run("train", inputs, targets).record  # the step users run
        dist.barrier()
        if i >= CALIBRATION_WARMUP:
            steps.append(time.perf_counter() - t0)
            timings += record.timings
    for p, g in zip(params, keep, strict=True):
        p.grad = g
    del parts, params, keep, module
    if meta:
        gc.collect()  # the reference's stages, before anything else is made real
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (steps, timings))
    # Every rank computes the same numbers from the same gathered data.
    step = statistics.median(max(s) for s in zip(*(g[0] for g in gathered), strict=True))
    costs = measured_costs([t for g in gathered for t in g[1]], schedule.stages)
    return step, costs


def _fit_latency(
    schedule: Schedule, prof: Costs, balance: Sequence[int], step: float, recompute: bool
) -> float:
    """The link latency at which the simulated step of ``schedule`` is ``step`` (0 when
    even zero latency simulates a longer step)."""

    def sim(latency: float) -> float:
        linked = dataclasses.replace(prof, latency=latency)
        return simulated(schedule, linked, balance, recompute).makespan

    lo, hi = 0.0, step
    if sim(lo) >= step:
        return 0.0
    while sim(hi) < step:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sim(mid) < step else (lo, mid)
    return (lo + hi) / 2


__all__ = [
    "CALIBRATION_STEPS",
    "CALIBRATION_WARMUP",
    "REFERENCES",
    "Calibration",
    "Family",
    "calibrate_family",
    "family",
]
