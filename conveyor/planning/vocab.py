"""Vocabulary parallelism as a planner candidate: a schedule whose vocabulary layers are
split over every rank (``Pipeline(vocab_parallel=True)``), predicted from the same profile
as the layer splits it competes with.

The units that hold the vocabulary layers cost nothing in the stages (the split model has
stand-ins there, so balances count the same units); their time moves to the vocabulary
passes, each rank running ``1/p`` of it (E and G from the embedding's unit, S and T from
the output layer's), and their parameters to every rank, ``1/p`` each (a tied weight once),
with their gradients; each rank also holds one micro-batch's logits of its rows (from S
to T).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.errors import ConfigError
from conveyor.partition.cuts import rows_per_rank
from conveyor.planning.candidate import Candidate
from conveyor.planning.costs import Costs, UnitCost
from conveyor.planning.memory import Setting, compute_width, state_bytes_of
from conveyor.planning.prediction import balanced, peaks, stage_costs
from conveyor.schedules import Schedule
from conveyor.schedules.simulation import simulate
from conveyor.schedules.vocab import with_vocab
from conveyor.vocab.layers import VocabLayers, find_vocab_layers
from conveyor.vocab.setup import vocab_loss


@dataclass(frozen=True)
class VocabUnits:
    """Which profiled units hold the vocabulary layers, their parameters' bytes, the
    vocabulary's rows, and its rows over the hidden size (a logit's bytes per embedding
    byte)."""

    embedding: int
    output: int
    parameter_bytes: int
    rows: int
    widening: float
    vanish: bool = False
    tensors: int = 1
    """How many weight tensors the layers hold (1 when tied)."""
    """The split with the layers stood in for has no units for them: a graph torch.export
    captured, where the model takes the embedding as ``inputs_embeds`` and the output
    stand-in reads no parameter; else they stay units that cost nothing."""


def takes_loss(loss_fn: Any, layers: VocabLayers) -> bool:
    """Whether vocabulary parallelism computes ``loss_fn`` from the shards of ``layers``:
    the runtime's own rule (:func:`~conveyor.vocab.setup.vocab_loss`), so that the planner
    never offers what the pipeline would refuse, nor leaves out what it would run."""
    try:
        vocab_loss(loss_fn, layers)
    except ConfigError:
        return False
    return True


def vocab_units(
    model: Any, units: Sequence[nn.Module], loss_fn: Any, sample: Any = None
) -> VocabUnits | None:
    """The units of ``model`` holding its vocabulary layers, when vocabulary parallelism
    can run it (layers :func:`find_vocab_layers` finds, a loss :func:`takes_loss`);
    else None. ``sample``: what ``units`` were cut on (tells a graph torch.export
    captured)."""
    if not isinstance(model, nn.Module):
        return None
    try:
        layers = find_vocab_layers(model, True)
    except ConfigError:
        return None
    if not takes_loss(loss_fn, layers):
        return None
    emb = _weight(model.get_submodule(layers.input))
    out = _weight(model.get_submodule(layers.output))
    holding = [{id(p) for p in unit.parameters()} for unit in units]
    first = [i for i, ids in enumerate(holding) if id(emb) in ids]
    last = [i for i, ids in enumerate(holding) if id(out) in ids]
    if not first or not last:
        return None
    weights = {id(emb): emb, id(out): out}
    size = sum(w.numel() * w.element_size() for w in weights.values())
    exported = sample is not None and _exported(model, sample)
    return VocabUnits(
        embedding=first[0], output=last[-1], parameter_bytes=size, rows=layers.rows,
        widening=layers.rows / layers.hidden, vanish=exported, tensors=len(weights),
    )  # fmt: skip


def _exported(model: Any, sample: Any) -> bool:
    """Whether ``model`` is a graph torch.export captured (the capture :func:`units` made,
    from the cache)."""
    if not isinstance(model, nn.Module) or isinstance(model, (nn.Sequential, nn.ModuleList)):
        return False
    from conveyor.partition.capture import capture

    try:
        return bool(capture(model, sample).exported)
    except Exception:  # not a graph (an execution sequence, say): its units are its own
        return False


def evaluate_vocab(
    schedule: Schedule,
    prof: Costs,
    found: VocabUnits,
    limit: float | None,
    setting: Setting,
    overhead: float = 0.0,
) -> Candidate:
    """``schedule`` with vocabulary passes: balanced and predicted (see the module doc)."""
    ranks = schedule.ranks
    emb, out = prof.layers[found.embedding], prof.layers[found.output]
    split = schedule.split_backward
    layers = list(prof.layers)
    for i in {found.embedding, found.output}:
        u = layers[i]
        layers[i] = UnitCost(u.name, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, u.output, input=u.input)
    if found.vanish:  # the balance counts the split's own units
        gone = {found.embedding, found.output}
        layers = [u for i, u in enumerate(layers) if i not in gone]
    stripped = dataclasses.replace(prof, layers=tuple(layers))
    bal = balanced(schedule, stripped, None, setting)
    passes = (
        _forward(emb, split) / ranks,
        _forward(out, split) / ranks,
        _backward(out, split) / ranks,
        _backward(emb, split) / ranks,
    )
    costs = stage_costs(schedule, stripped, bal)
    placed = with_vocab(schedule, _per_rank(costs, schedule))
    result = simulate(placed, costs, stripped.comm(bal), vocab=passes)
    step = result.makespan + overhead
    # The rows' weights, gradients and optimizer state, and one micro-batch's logits
    # (held from S to T), on the first ranks, which hold the most rows.
    held = rows_per_rank(found.rows, ranks)
    logits = int(emb.output * found.widening * held / found.rows)  # the embedding's tokens
    width = compute_width(setting, emb if emb.count else out)
    rows = UnitCost(
        "vocabulary rows", 0.0, 0.0, 0.0, 0.0, 0.0, 0, -(-(found.parameter_bytes * held) //
        found.rows), 0, params=found.parameter_bytes * held / found.rows / width,
        tensors=found.tensors,
    )  # fmt: skip
    shared = sum(state_bytes_of([rows], setting).values()) + logits
    need = [p + shared for p in peaks(schedule, stripped, bal, setting)]
    return Candidate(
        schedule=schedule.name,
        chunks=schedule.chunks,
        microbatches=schedule.microbatches,
        balance=tuple(bal),
        predicted_step=step,
        peak_memory=tuple(round(p) for p in need),
        fits=limit is None or max(need) <= limit,
        vocab=True,
        bubble=result.bubble,
    )


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _forward(u: UnitCost, split: bool) -> float:
    return u.forward if split else u.forward_plain


def _backward(u: UnitCost, split: bool) -> float:
    return u.backward_input + u.backward_weight if split else u.backward


def _per_rank(costs: Sequence[tuple[float, float, float]], schedule: Schedule) -> tuple[float, ...]:
    """One rank's share (F, B, W) from per-stage costs: what places the passes."""
    share = [0.0, 0.0, 0.0]
    for s in schedule.stages_of(0):
        for k in range(3):
            share[k] += costs[s][k]
    return tuple(share)
