"""The one memory model: what each pipeline rank holds at its peak, by kind.

Both sources' numbers (:class:`~conveyor.planning.costs.Costs`) go through it, so
``Pipeline(schedule="auto", memory_limit=...)``, ``conveyor plan`` and
``conveyor.planning.estimate`` count memory alike:

- **parameters, gradients, optimizer**: per parameter by precision (:class:`Setting`):
  as the rank holds them (a model trained in its own dtype: weights and gradients in it,
  AdamW's two states too), Megatron's mixed precision (bf16 weights, fp32 gradients, fp32
  master weights and states: 18 bytes with AdamW), or fp32. FSDP shards all of it over
  the data-parallel replicas (fp32 shards under mixed precision, as torchtitan keeps
  them); the distributed optimizer (ZeRO-1) shards the master weights and the states
  (Megatron's 6 + 12/dp bytes). Adam keeps a step count per parameter tensor.
- **activations**: the schedule walked action by action with each stage's bytes: what F
  keeps until B (all it saves; with recompute the stage's input, each layer's input, or
  all but the attention kernels' tensors), what a recomputing B holds while it runs, what
  is held from B until W (:func:`held_until_w`), and the largest temporary of one action
  (the loss's logits in fp32 and their gradient, say).
- **buffers**: the pipeline's send and receive, what the source adds (tensor
  parallelism's gathered sequence), FSDP's gathered weights and unsharded gradients (the
  rank's stages for a step with ``fsdp=True``; two units at a time with ``"reshard"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.planning.costs import LAYER, Costs, UnitCost
from conveyor.schedules import Schedule
from conveyor.schedules.core import B, F, W
from conveyor.schedules.kept import PerSchedule
from conveyor.schedules.simulation import W_MEMORY

KINDS = ("parameters", "gradients", "optimizer", "activations", "buffers")
"""The kinds a rank's memory is told apart by."""

OPTIMIZERS = ("adamw", "adam", "sgd")
"""The optimizers whose state the model counts (``sgd``: none)."""

PRECISIONS = ("held", "mixed", "fp32")
"""How parameters are held: as the model holds them, Megatron's mixed precision, fp32."""

RECOMPUTE = (False, True, "layer", "selective")
"""What a B re-runs: nothing; the stage's forward from its input (conveyor's runtime);
each decoder layer's forward from its input (Megatron's full recompute, torchtitan's full
activation checkpointing); the attention kernels' forward (Megatron's selective)."""


@dataclass(frozen=True)
class Setting:
    """What the memory model and the step's tail need beyond the units and the schedule.

    Attributes:
        dp: Data-parallel replicas.
        ep: Expert-parallel ranks (experts' state is sharded over ``dp / ep``).
        fsdp: ``False``, ``True`` (gathered once per step) or ``"reshard"`` (gathered for
            each use and freed after it).
        distributed_optimizer: Master weights and optimizer states sharded over ``dp``.
        optimizer: One of :data:`OPTIMIZERS`.
        precision: One of :data:`PRECISIONS`.
        recompute: One of :data:`RECOMPUTE`.
        buffer: Bytes the source adds to every rank's buffers.
        dp_overlap: When a stage's gradient reduction runs: ``"stage"`` once its last
            backward has ended (conveyor's runtime), ``"backward"`` beside that backward
            (DDP's, FSDP's and Megatron's buckets), ``"none"`` after the step.
    """

    dp: int = 1
    ep: int = 1
    fsdp: bool | str = False
    distributed_optimizer: bool = False
    optimizer: str = "adamw"
    precision: str = "held"
    recompute: bool | str = False
    buffer: float = 0.0
    dp_overlap: str = "stage"


def held_until_w(unit: UnitCost) -> float:
    """Bytes of ``unit``'s activations held from a micro-batch's B until its W.

    The one place this share comes from. conveyor's runtime frees a micro-batch's graph at
    B and keeps what its weight GEMMs read (the Zero Bubble paper's M_W):
    ``unit.w_inputs``; where that is unknown (0), :data:`W_MEMORY` of its activations.
    """
    return unit.w_inputs if unit.w_inputs > 0 else W_MEMORY * unit.activations


def w_share(parts: Sequence[Sequence[UnitCost]]) -> float:
    """The largest share of a stage's activations held from B until W, in [0, 1]: the
    ``w_memory`` a split-backward schedule is fitted with, so that its cap is kept."""
    shares = [
        sum(held_until_w(u) for u in part) / full
        for part in parts
        if (full := sum(u.activations for u in part)) > 0
    ]
    return min(max(shares, default=W_MEMORY), 1.0)


def state_bytes(setting: Setting, unit: UnitCost) -> tuple[float, float, float, float]:
    """Bytes per parameter of ``unit`` as a rank holds them: (weights, gradients, master
    weights, optimizer states), before any sharding."""
    held = unit.parameters / unit.count if unit.count else 4.0
    adam = setting.optimizer != "sgd"
    if setting.precision == "mixed":
        if setting.fsdp:  # fp32 shards of everything (torchtitan's FSDP2)
            return 4.0, 4.0, 0.0, 8.0 if adam else 0.0
        return 2.0, 4.0, 4.0, 8.0 if adam else 0.0
    width = 4.0 if setting.precision == "fp32" else held
    return width, width, 0.0, 2 * width if adam else 0.0


def compute_width(setting: Setting, unit: UnitCost) -> float:
    """Bytes per parameter of a gathered weight (the compute dtype)."""
    if setting.precision == "mixed":
        return 2.0
    return 4.0 if setting.precision == "fp32" else (unit.parameters / unit.count or 4.0)


def rank_memory(
    schedule: Schedule, costs: Costs, balance: Sequence[int], setting: Setting
) -> list[dict[str, float]]:
    """Bytes by kind (:data:`KINDS`) per rank at the schedule's peak."""
    parts = costs.parts(balance)
    walked = activation_peaks(schedule, parts, setting.recompute, schedule.split_backward)
    out = []
    for rank in range(schedule.ranks):
        units = [u for s in schedule.stages_of(rank) for u in parts[s]]
        kinds = state_bytes_of(units, setting)
        kinds["activations"] = walked[rank]
        kinds["buffers"] = _buffers(schedule, parts, rank, units, setting)
        out.append(kinds)
    return out


def state_bytes_of(units: Sequence[UnitCost], setting: Setting) -> dict[str, float]:
    """Bytes of ``units``' weights, gradients and optimizer state on a rank, by kind."""
    dp = max(1, setting.dp)
    weights = grads = optimizer = 0.0
    for u in units:
        w, g, m, s = state_bytes(setting, u)
        for count, replicas in (
            (u.count - u.expert_params, dp),
            (u.expert_params, dp // setting.ep),
        ):
            replicas = max(1, replicas)
            everything = replicas if setting.fsdp else 1
            states = replicas if setting.fsdp or setting.distributed_optimizer else 1
            weights += w * count / everything
            grads += g * count / everything
            optimizer += (m + s) * count / states
    if setting.optimizer != "sgd":
        optimizer += 4.0 * sum(u.tensors for u in units)  # torch's Adam: a step per tensor
    return {"parameters": weights, "gradients": grads, "optimizer": optimizer}


def _buffers(
    schedule: Schedule,
    parts: Sequence[Sequence[UnitCost]],
    rank: int,
    units: Sequence[UnitCost],
    setting: Setting,
) -> float:
    total = setting.buffer
    if schedule.ranks > 1:  # one micro-batch being sent, one being received
        total += 2 * max(parts[s][-1].output for s in schedule.stages_of(rank))
    if setting.fsdp == "reshard":  # a unit in use and the next one prefetched
        total += 2 * 2 * max((compute_width(setting, u) * u.count for u in units), default=0.0)
    elif setting.fsdp:  # the rank's weights gathered for the step, their gradients unsharded
        total += 2 * sum(compute_width(setting, u) * u.count for u in units)
    return total


def stage_bytes(
    units: Sequence[UnitCost], recompute: bool | str
) -> tuple[float, float, float, float]:
    """One stage's bytes for one micro-batch: (kept from F until B, held on top of that
    while B runs, held from B until W, the largest temporary of one of its actions)."""
    full = sum(u.activations for u in units)
    after = sum(held_until_w(u) for u in units)
    temp = max((u.workspace for u in units), default=0.0)
    layers = [u for u in units if u.kind == LAYER]
    if recompute is True:  # the stage's input only; B runs the whole forward again
        kept = units[0].input
        return kept, full - kept, after, temp
    if recompute == "layer":
        kept = sum(u.input for u in layers) + sum(u.activations for u in units if u.kind != LAYER)
        during = max((u.activations - u.input for u in layers), default=0.0)
        return kept, during, after, temp
    if recompute == "selective":
        kept = full - sum(u.attention_saved for u in layers)
        during = max((u.attention_saved for u in layers), default=0.0)
        return kept, during, after - (full - kept), temp
    return full, 0.0, after, temp


def activation_peaks(
    schedule: Schedule,
    parts: Sequence[Sequence[UnitCost]],
    recompute: bool | str,
    split: bool,
) -> list[float]:
    """Per rank, the most activation bytes held at once, walked action by action (kept per
    schedule and stages while the schedule lives: a search walks it many times alike)."""
    per_stage = tuple(stage_bytes(units, recompute) for units in parts)
    walked = _walked(schedule)
    found = walked.get((split, per_stage))
    if found is not None:
        return list(found)
    out = []
    for program in _programs(schedule):
        held = peak = 0.0
        for code, stage in program:
            kept, during, after, temp = per_stage[stage]
            if code == 0:  # F
                held += kept
                peak = max(peak, held + temp)
            elif code == 1:  # B
                peak = max(peak, held + during + temp)
                held += (after - kept) if split else -kept
                peak = max(peak, held)
            else:  # W
                held -= after
        out.append(peak)
    if len(walked) > 256:
        walked.clear()
    walked[(split, per_stage)] = tuple(out)
    return out


_walked: PerSchedule[dict[object, tuple[float, ...]]] = PerSchedule(lambda _: {})


def _make_programs(schedule: Schedule) -> tuple[tuple[tuple[int, int], ...], ...]:
    codes = {F: 0, B: 1, W: 2}
    return tuple(tuple((codes[a.kind], a.stage) for a in program) for program in schedule.actions)


_programs = PerSchedule(_make_programs)
"""Each rank's program as (0 for F, 1 for B, 2 for W; stage) pairs, kept while the
schedule lives (a search walks each many times)."""


__all__ = [
    "KINDS",
    "OPTIMIZERS",
    "PRECISIONS",
    "RECOMPUTE",
    "Setting",
    "activation_peaks",
    "compute_width",
    "held_until_w",
    "rank_memory",
    "stage_bytes",
    "state_bytes",
    "state_bytes_of",
]
