"""The stage ends a pipeline is built with: the model's own input and loss
(:class:`~conveyor.runtime.ends.ModelEnds`), or vocabulary parallelism's
(:mod:`conveyor.vocab`). What :func:`~conveyor._build.build` needs of them, whichever
they are, is :class:`Ends`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from conveyor._options import Options
from conveyor.context import Context
from conveyor.losses import model_token_loss
from conveyor.runtime.ends import ModelEnds, StageEnds
from conveyor.runtime.microbatch import Counter
from conveyor.runtime.step_loss import RouterLoss
from conveyor.runtime.step_sync import StepSync
from conveyor.schedules import Schedule

HOLDER = -1
"""The key of the ends' unit among the stages' (whose indices are >= 0)."""


@dataclass
class Ends:
    """The stage ends of one pipeline on this rank.

    Attributes:
        model: The model the stages are cut from.
        runtime: What the stage compute calls (:class:`~conveyor.runtime.ends.StageEnds`).
        holder: A unit of parameters beside the stages (None: none): reduced over the
            replicas, sharded by FSDP, saved and loaded as the stages are.
        counter: Counts a micro-batch's labels for a model's own token loss (None: other
            losses).
        sample: A capture sample as the first stage sees it.
        split: Told the stages the model was cut into (every rank's).
        note: Lines for ``print(pipe)``, given the pipeline ranks and the schedule.
        syncs: What every step runs around its actions for these ends
            (:class:`~conveyor.runtime.step_sync.StepSync`).
    """

    model: nn.Module
    runtime: StageEnds
    holder: nn.Module | None = None
    counter: Counter | None = None
    sample: Callable[[Any], Any] = lambda value: value
    split: Callable[[list[nn.Module]], None] = lambda stages: None
    note: Callable[[Schedule], str] = field(default=lambda schedule: "")
    syncs: tuple[StepSync, ...] = ()


def stage_ends(model: nn.Module, options: Options, ctx: Context, schedule: Schedule) -> Ends:
    """The ends ``options`` ask for (see the module doc); with context parallelism
    (``ctx.cp_size > 1``) they cut each micro-batch's sequence on the way in
    (:mod:`conveyor.context_parallel`).

    Raises:
        ConfigError: vocabulary layers or a loss that cannot be split (one sentence).
    """
    if ctx.cp_size == 1:
        return _ends(model, options, ctx, schedule)
    from conveyor.context_parallel.setup import sequences, unshifted

    loss_fn, shift_targets = unshifted(options.loss_fn)
    options = dataclasses.replace(options, loss_fn=loss_fn)
    token_loss = model_token_loss(model) if options.loss_fn is None else None
    cp = sequences(model, ctx, options.cp_attention, token_loss, shift_targets)
    inner = _ends(model, options, ctx, schedule)
    return dataclasses.replace(
        inner,
        runtime=cp.wrap(inner.runtime),
        counter=cp.cut.count if inner.counter is not None else None,
        sample=lambda value: inner.sample(cp.cut.inputs(value)),
        split=lambda stages: cp.split(stages, inner.split),
        note=lambda schedule: inner.note(schedule) + cp.note,
        syncs=inner.syncs + cp.syncs,
    )


def _ends(model: nn.Module, options: Options, ctx: Context, schedule: Schedule) -> Ends:
    """The model's own ends, or vocabulary parallelism's."""
    token_loss = model_token_loss(model) if options.loss_fn is None else None
    router = router_loss(model) if token_loss is not None else None
    counter = token_loss.count if token_loss is not None else None
    if options.vocab_parallel:
        from conveyor.vocab.setup import prepare

        setup = prepare(model, options.vocab_parallel, options.loss_fn, ctx, options.autocast,
                        schedule.placement[0], schedule.placement[-1], router)  # fmt: skip
        return Ends(
            setup.model,
            setup.runner,
            setup.shards.holder,
            # The shards count the tokens; the router's term is weighted by their count.
            counter=counter if router is not None else None,
            sample=setup.runner.sample,
            split=setup.split,
            note=lambda s: setup.note(s.ranks, len(s.vocab)),
        )
    return Ends(model, ModelEnds(options.loss_fn, router), counter=counter)


def router_loss(model: Any) -> RouterLoss | None:
    """A transformers MoE model's router auxiliary loss, with its ``router_aux_loss_coef``,
    where its own loss adds it (``output_router_logits=True``), else None."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    coef = getattr(model, "router_aux_loss_coef", None)
    return RouterLoss(float(coef)) if isinstance(coef, (int, float)) else None
