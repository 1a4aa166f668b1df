"""The planner: pick schedule, chunks, micro-batch count and balance by simulation.

For every micro-batch count in a small set (p, 2p, 4p, 8p, capped by the batch size) the
model is profiled at that micro-batch size (:func:`conveyor.planning.profiler.profile`).
Every schedule that can run (stages = ranks x chunks <= profiled units) is balanced and
predicted (:func:`conveyor.planning.candidate.evaluate`: the one prediction,
:mod:`~conveyor.planning.prediction`), from the profile calibrated by
short real runs in a distributed world (:mod:`conveyor.planning.calibration`). The fastest
candidate that fits the memory limit wins, or the simplest of those within :data:`TIE` of it.
Under a tight limit the V schedules ``v-half`` and ``v-min`` (a half and a third of 1F1B's
activations) are often the fastest that fit; when no schedule fits, every one is tried
again with recompute (each stage keeps only its input and re-runs its forward at B).

A model on the meta device is planned without being made real: each unit is timed on a
real copy of it alone, and calibration makes real only this rank's stages of its
reference pipelines (:mod:`conveyor.planning.meta`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor._options import Options
from conveyor.errors import ConfigError
from conveyor.planning.calibration import (
    CALIBRATION_STEPS,
    REFERENCES,
    Calibration,
    calibrate_family,
    family,
)
from conveyor.planning.candidate import Candidate, evaluate
from conveyor.planning.costs import Costs
from conveyor.planning.memory import OPTIMIZERS, Setting, state_bytes_of
from conveyor.planning.plan_result import Plan
from conveyor.planning.prediction import time_balance
from conveyor.planning.profiler import profile, units
from conveyor.planning.timing import LossFn
from conveyor.planning.vocab import evaluate_vocab, vocab_units
from conveyor.runtime import microbatch
from conveyor.schedules import Schedule
from conveyor.schedules.auto import zero_bubble_auto
from conveyor.schedules.registry import SCHEDULE_NAMES, default_chunks, get_schedule

# Candidates predicted within this fraction of the fastest are a tie: measurement noise is
# larger than that, so the simplest of them is chosen (the same one on every run).
TIE = 0.05
# A micro-batch count whose profiled step compute is this many times the median over the
# counts is re-measured (and dropped if it stays that far off).
OUTLIER = 3.0

# A simulated candidate, the schedule it ran, the profile it was predicted on and the
# calibration of its family.
Row = tuple[Candidate, Schedule, Costs, Calibration | None]


def plan(
    model: nn.Module | Sequence[nn.Module],
    inputs: Any,
    targets: Any,
    loss_fn: LossFn | None,
    ranks: int,
    memory_limit: float | None = None,
    *,
    microbatch_counts: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    profiles: dict[int, Costs] | None = None,
    calibrate: bool = True,
    param_shards: int = 1,
    options: Options | None = None,
    device: torch.device | str | None = None,
    vocab: bool | None = None,
    optimizer: str = "adamw",
) -> Plan:
    """The fastest configuration for ``ranks`` pipeline ranks within ``memory_limit``.

    In a distributed world every rank must call it (profiling and link measurement are
    collectives); all ranks get the same plan. A count whose profile is far slower than
    the others' (:data:`OUTLIER`) is measured again, and left out if it stays so.
    Candidates predicted within :data:`TIE` of the fastest count as equal: the simplest of
    them is chosen, so the choice does not follow noise.

    Args:
        model: A module, a layer list or an execution sequence.
        inputs: One sample batch, as for ``train_step``.
        targets: Its targets (None with ``loss_fn=None``).
        loss_fn: ``loss_fn(output, targets)``; None: the loss the model computes itself
            (e.g. a transformers model given ``labels`` among the inputs).
        ranks: Pipeline ranks.
        memory_limit: The most bytes any pipeline rank may need, as the one memory model
            counts them (:mod:`~conveyor.planning.memory`: its stages' parameters,
            gradients and ``optimizer`` state, the activations the schedule holds at
            once, the pipeline's send and receive buffers), or None for no limit.
        microbatch_counts: Micro-batch counts to try (default p, 2p, 4p, 8p, capped by
            the batch size).
        schedules: Schedule names to try (default all).
        profiles: Micro-batch count -> :class:`~conveyor.planning.costs.Costs`; skips
            profiling those counts.
        calibrate: Calibrate each count's profile by short real runs
            (:func:`~conveyor.planning.calibration.calibrate_family`, about a second per
            count); used only when the world is ``ranks`` processes.
        param_shards: Into how many pieces each rank's parameters and gradients are cut
            (FSDP over D replicas times tensor parallelism T); the memory model counts one
            piece.
        options: A pipeline's options: calibration's reference pipelines get its
            ``recompute`` and ``autocast`` but run eager stages even when it has
            ``compile=`` (:mod:`~conveyor.planning.calibration`; ``Plan.basis`` says so).
            ``fsdp`` and ``tp_plan`` reach the plan only through ``param_shards``. A meta
            model's units get the values its ``weights`` / ``init_seed`` give.
        device: Where a model on the meta device is profiled, one unit at a time (see
            :func:`~conveyor.planning.profiler.profile`).
        vocab: Also predict each schedule with the vocabulary layers split over every rank
            (``vocab_parallel``, :mod:`~conveyor.planning.vocab`); None: where the model
            has them and takes the loss (the runtime's rule,
            :func:`conveyor.vocab.setup.vocab_loss`); False: never.
        optimizer: The optimizer whose state the memory model counts: ``"adamw"``,
            ``"adam"`` (two states per parameter in its dtype) or ``"sgd"`` (none).

    Returns:
        The chosen configuration and every candidate, ranked.

    Raises:
        ConfigError: ``ranks < 1``, an unknown optimizer, no schedule can run, or no
            candidate fits the limit.
    """
    if ranks < 1:
        raise ConfigError(f"ranks must be >= 1, got {ranks}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    batch = microbatch.batch_size(inputs, "inputs")
    first = microbatch.divide(inputs, min(batch, ranks), "inputs")[0]
    cut = units(model, first)
    n_units = len(cut)
    found = vocab_units(model, cut, loss_fn, first) if vocab is not False and ranks > 1 else None
    if vocab and found is None:
        raise ConfigError(
            "the plan was asked for vocabulary parallelism, but it needs a model with an "
            "input embedding and a bias-free output layer onto its rows and a loss "
            "vocab_parallel computes from the shards (a TokenCrossEntropy, or loss_fn=None "
            "on a transformers causal LM)"
        )
    counts = (
        sorted({min(k * ranks, batch) for k in (1, 2, 4, 8)})
        if microbatch_counts is None
        else sorted(set(microbatch_counts))
    )
    names = list(schedules or SCHEDULE_NAMES)
    cache = dict(profiles or {})
    real = calibrate and _distributed() and dist.get_world_size() == ranks
    recomputes = options is not None and options.recompute is True  # every stage, asked for
    setting = Setting(optimizer=optimizer, recompute=recomputes)
    rows: list[Row] = []
    seed, weights = (options.init_seed, options.weights) if options is not None else (0, None)

    def measured(m: int) -> Costs:
        return profile(
            model, inputs, targets, loss_fn, m, device=device, init_seed=seed, weights=weights
        )

    for m in counts:
        cache[m] = cache.get(m) or measured(m)
    for m in _outliers(cache, counts):
        # A profile far slower than the others was disturbed (another process, a one-off
        # stall): measure again, keep the fastest, and drop the count if it stays off.
        again = [cache[m], *(measured(m) for _ in range(2))]
        cache[m] = min(again, key=_step_compute)
        if m in _outliers(cache, counts):
            del cache[m]
    for m in counts:
        if m not in cache:
            continue
        prof = cache[m].sharded(param_shards)
        cals = {
            kind: calibrate_family(
                model,
                inputs,
                targets,
                loss_fn,
                prof,
                ranks,
                kind,
                memory_limit,
                options,
                setting,
            )
            if real
            else None
            for kind in REFERENCES
        }
        for name in names:
            chunks = default_chunks(name)  # the schedule's own: 2 for interleaved and V ones
            if ranks * chunks > n_units:
                continue
            try:
                if name == "zb-auto":
                    cal = cals[True, False]
                    fitted = cal.apply(prof) if cal else prof
                    built = _auto_schedule(ranks, m, fitted, memory_limit, setting)
                    if built is None:
                        continue
                else:
                    built = get_schedule(name, ranks, m, chunks)
            except ConfigError:
                continue  # e.g. too few micro-batches for this schedule
            cal = cals[family(built)]
            fitted = cal.apply(prof) if cal else prof
            overhead = cal.overhead if cal else 0.0
            cand = evaluate(built, fitted, memory_limit, setting, overhead)
            rows.append((cand, built, fitted, cal))
            if found is not None and name != "zb-auto" and not recomputes:
                cand = evaluate_vocab(built, fitted, found, memory_limit, setting, overhead)
                rows.append((cand, built, fitted, cal))
    if rows and not recomputes and memory_limit is not None and not any(r[0].fits for r in rows):
        rows += _with_recompute(rows, memory_limit, setting)
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
            f"smallest needs {max(least.peak_memory):.4g} ({least.schedule}"
            f"{' with recompute' if least.recompute else ''}, "
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
        recompute=best.recompute,
        basis=_basis(best_cal, real, options),
        vocab_parallel=best.vocab,
    )


def _basis(cal: Calibration | None, real: bool, options: Options | None) -> str:
    """:attr:`Plan.basis`: what the chosen candidate's times rest on."""
    if cal is None:
        why = (
            "its family's reference could not run"
            if real
            else "calibration runs only in a distributed world of exactly the pipeline ranks"
        )
        text = f"times: each unit profiled alone with eager stages, not calibrated ({why})"
    else:
        text = (
            f"times: each unit profiled alone, calibrated by {CALIBRATION_STEPS} real steps "
            f"of {cal.schedule} with eager stages"
        )
    if options is not None and options.compile_keywords() is not None:
        text += "; compile= is not applied while planning: compiled stages may run faster"
    return text


def _with_recompute(rows: Sequence[Row], limit: float, setting: Setting) -> list[Row]:
    """Every candidate again with recompute (zb-auto's, fitted to no limit, left out)."""
    out = []
    again_setting = dataclasses.replace(setting, recompute=True)
    for cand, built, prof, cal in rows:
        if cand.schedule == "zb-auto" or cand.vocab:
            continue
        overhead = cal.overhead if cal else 0.0
        again = evaluate(built, prof, limit, again_setting, overhead)
        out.append((again, built, prof, cal))
    return out


def _auto_schedule(
    ranks: int, m: int, prof: Costs, limit: float | None, setting: Setting
) -> Schedule | None:
    """``zb-auto`` fitted to this profile (time-balanced), or None when nothing fits: its
    cap is the micro-batches of activations each rank has room for beside its state and
    its send and receive buffers."""
    bal = time_balance(prof.times(True), ranks)
    cap: float | None = None
    if limit is not None:
        parts = prof.parts(bal)
        state = [
            sum(state_bytes_of(units, setting).values())
            + (2 * units[-1].output if ranks > 1 else 0)
            for units in parts
        ]
        acts = prof.activation_bytes(bal)
        room = [(limit - p) / a if a > 0 else float(m) for p, a in zip(state, acts, strict=True)]
        cap = min(min(room), float(m))
        if cap < 1:
            return None
    costs = prof.costs(bal, True)
    return zero_bubble_auto(ranks, m, costs, microbatch_cap=cap, comm=prof.comm(bal))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _step_compute(prof: Costs) -> float:
    """Seconds of F and whole backward of one step's micro-batches, all units together."""
    return sum(prof.times(False)) * prof.microbatches


def _outliers(profiles: dict[int, Costs], counts: Sequence[int]) -> list[int]:
    totals = {m: _step_compute(profiles[m]) for m in counts if m in profiles}
    if len(totals) < 3:
        return []
    middle = statistics.median(totals.values())
    return [m for m, t in totals.items() if t > OUTLIER * middle]


def _simplest_of_the_fastest(rows: list[Row], names: Sequence[str]) -> Row:
    """Among the fitting candidates within :data:`TIE` of the fastest (``rows`` are sorted
    fastest first), the one without vocabulary parallelism, with the fewest actions per
    step, then the fewest chunks, then the first in ``names``."""
    first = rows[0][0]
    if not first.fits:
        return rows[0]
    limit = first.predicted_step * (1 + TIE)
    close = [r for r in rows if r[0].fits and r[0].predicted_step <= limit]
    order = {name: i for i, name in enumerate(names)}
    return min(
        close,
        key=lambda r: (
            r[0].vocab,
            r[0].microbatches * r[0].chunks,
            r[0].chunks,
            order.get(r[0].schedule, len(order)),
            r[0].predicted_step,
        ),
    )


__all__ = ["OUTLIER", "TIE", "Plan", "plan"]
