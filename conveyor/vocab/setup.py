"""Setting up vocabulary parallelism for a pipeline: which layers, what loss, the model
the stages are cut from, this rank's rows, the vocabulary group and the passes' runner."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor._groups import Held
from conveyor.context import Context
from conveyor.errors import ConfigError
from conveyor.losses import ModelTokenLoss, TokenCrossEntropy, model_token_loss
from conveyor.partition.cuts import rows_per_rank
from conveyor.runtime.step_loss import RouterLoss
from conveyor.vocab.layers import VocabLayers, VocabSpec, find_vocab_layers
from conveyor.vocab.runner import Group, VocabLoss, VocabRunner
from conveyor.vocab.shards import VocabInput, VocabShards, exportable, first_stage, stripped


@dataclass
class VocabSetup:
    """What a pipeline with vocabulary parallelism builds on this rank.

    Attributes:
        layers: The vocabulary layers.
        model: The model the stages are cut from (the layers stood in for).
        shards: This rank's rows of the layers.
        runner: The stage ends: runs the passes.
        stand_in: The input embedding's stand-in in ``model``.
    """

    layers: VocabLayers
    model: nn.Module
    shards: VocabShards
    runner: VocabRunner
    stand_in: VocabInput
    exported: bool = False

    def split(self, stages: list[nn.Module]) -> None:
        """The model was cut into ``stages``: the first takes its embedding as an input
        of its own (:func:`~conveyor.vocab.shards.first_stage`; a model torch.export
        captures was given it as its first argument before, :func:`exportable`)."""
        if not self.exported:
            self.runner.takes = first_stage(stages[0], self.stand_in, self.layers.transformers)

    def note(self, ranks: int, passes: int) -> str:
        """A line for ``print(pipe)``: which layers are split over the ranks, and how."""
        layers = self.layers
        rows = rows_per_rank(layers.rows, ranks)
        tied = ", tied" if layers.tied else ""
        return (
            f"\nvocabulary layers {layers.input}, {layers.output}{tied}: {layers.rows} rows "
            f"split over {ranks} ranks ({rows} each, the last ones fewer), "
            f"{passes} passes (E, S, T, G per micro-batch)"
        )


def vocab_loss(loss_fn: Any, layers: VocabLayers) -> VocabLoss:
    """The token cross-entropy the shards compute for ``loss_fn``.

    Raises:
        ConfigError: a loss the shards cannot compute.
    """
    if isinstance(loss_fn, TokenCrossEntropy):
        return VocabLoss(loss_fn.ignore_index, loss_fn.label_smoothing, loss_fn.shift)
    if isinstance(loss_fn, ModelTokenLoss) and layers.transformers:
        # transformers' Trainer: the labels are the targets, counted as it counts them; the
        # loss shifts them as the model's own loss function does.
        own = model_token_loss(loss_fn.model)
        shift = own.shifts if own is not None else True
        return VocabLoss(-100, 0.0, shift, counter=loss_fn.count)
    if loss_fn is None and layers.transformers:
        return VocabLoss(-100, 0.0, True, labels_in_inputs=True)
    what = (
        "loss_fn=None on a model that is not a transformers causal LM"
        if loss_fn is None
        else f"loss_fn={loss_fn!r}"
    )
    raise ConfigError(
        f"vocab_parallel computes the token cross-entropy from the vocabulary shards, not "
        f"{what}; pass loss_fn=conveyor.losses.TokenCrossEntropy(ignore_index=..., shift=...)"
    )


def prepare(
    model: nn.Module,
    spec: VocabSpec,
    loss_fn: Any,
    ctx: Context,
    autocast: torch.dtype | None,
    first_rank: int,
    last_rank: int,
    router: RouterLoss | None = None,
) -> VocabSetup:
    """Find the layers, shard them over the pipeline ranks and make the runner.

    ``first_rank`` / ``last_rank``: the pipeline ranks holding the first and last stages;
    ``router``: a transformers MoE model's own loss adds its router auxiliary term
    (``loss_fn=None``).
    Collective over the whole world when distributed (every rank makes every vocabulary
    group).

    Raises:
        ConfigError: the layers or the loss cannot be split (one sentence).
    """
    layers = find_vocab_layers(model, spec)
    loss = vocab_loss(loss_fn, layers)
    split = ctx.distributed and ctx.pp_size > 1
    mesh = ctx.mesh["pp"] if split and ctx.mesh is not None else None
    shards = VocabShards(model, layers, mesh)
    cut_from, stand_in = stripped(model, layers)
    group = Group(
        _vocab_group(ctx) if split else None,
        ctx.global_rank(first_rank) if split else 0,
        ctx.global_rank(last_rank) if split else 0,
        ctx.rank,
        ctx.timeout,
    )
    runner = VocabRunner(shards, loss, group, ctx.device, autocast, router)
    # A model only torch.export captures takes its embedding as its first argument (a
    # transformers model has its own: inputs_embeds).
    exported = not layers.transformers and not fx_traces(cut_from)
    if exported:
        exportable(cut_from, stand_in)
        runner.takes = "prepend"
    return VocabSetup(layers, cut_from, shards, runner, stand_in, exported)


def fx_traces(model: nn.Module) -> bool:
    """Whether ``model`` is a layer list or torch.fx traces it (else torch.export captures
    it on a sample)."""
    from conveyor.partition.capture import NeedsSample, capture

    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return True
    try:
        capture(model)
    except NeedsSample:
        return False
    return True


def _vocab_group(ctx: Context) -> Any:
    """This pipeline's vocabulary group: a communicator of its own over its pipeline
    ranks (the passes' collectives then never queue behind point-to-point transfers)."""
    timeout = datetime.timedelta(seconds=ctx.timeout)
    mine = None
    for replica in range(ctx.dp_size):
        for part in range(ctx.cp_size):  # each cp rank's share has its own passes
            for shard in range(ctx.tp_size):
                members = [ctx.rank_at(replica, r, shard, part) for r in range(ctx.pp_size)]
                group = dist.new_group(members, timeout=timeout)
                if (replica, part, shard) == (ctx.dp_rank, ctx.cp_rank, ctx.tp_rank):
                    mine = group
    held = Held(mine)
    return held.get
