"""What a :class:`conveyor.Pipeline` runs, settled from its keywords before anything is
built: the plan (``schedule="auto"``), the schedule with any vocabulary passes placed,
and the options the plan fills in. Every rule between the keywords is checked on the way
(:mod:`conveyor._rules`), each as soon as its facts are known."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from conveyor._options import Options, pipeline_ranks, pipeline_schedule
from conveyor._rules import auto_needs_sample, memory_limit_needs_auto
from conveyor.context import Context
from conveyor.partition.replaced import snapshot
from conveyor.partition.resplit import Before, make_whole
from conveyor.planning.planner import Plan, plan
from conveyor.schedules import Schedule, validate
from conveyor.schedules.pairs import paired_with_vocab
from conveyor.schedules.vocab import with_vocab


@dataclass(frozen=True)
class Settled:
    """What a pipeline runs.

    Attributes:
        plan: the planner's choice (``schedule="auto"``), else None.
        schedule: the validated schedule, vocabulary passes placed.
        options: the options, with what the plan chose filled in.
        before: what an earlier pipeline over the model held on this process (None: none
            did), for the new one's check of moved values.
        originals: the model's parameter objects by name before anything replaced one
            (an earlier pipeline's gathered included): an optimizer built over them steps
            their replacements (:mod:`conveyor.partition.replaced`).
    """

    plan: Plan | None
    schedule: Schedule
    options: Options
    before: Before | None = None
    originals: Mapping[str, Tensor] = field(default_factory=dict)


def settle(
    model: nn.Module,
    ctx: Context,
    schedule: str | Schedule,
    options: Options,
    memory_limit: float | None,
) -> Settled:
    """The plan, schedule and options of a pipeline of ``model`` (collective with
    ``schedule="auto"``: the plan profiles on every rank).

    Raises:
        ConfigError: a keyword, or a rule between keywords, that cannot work.
    """
    memory_limit_needs_auto(schedule, memory_limit)
    auto_needs_sample(schedule, options.sample)
    options.check_context(ctx)  # before a plan's collective profiling run
    originals = snapshot(model)
    before = make_whole(model)  # what an earlier pipeline sharded of it (collective)
    chosen: Plan | None = None
    if schedule == "auto":
        chosen = plan_pipeline(model, ctx, options, memory_limit)
        schedule = chosen.built
        options = dataclasses.replace(
            options,
            chunks=chosen.chunks,
            balance=chosen.balance,
            recompute=chosen.recompute or options.recompute,  # where nothing else fits
            vocab_parallel=options.vocab_parallel or chosen.vocab_parallel,  # where it wins
        )
    ranks = pipeline_ranks(ctx, model, schedule, options.chunks, options.balance)
    built = pipeline_schedule(schedule, ranks, options.microbatches, options.chunks)
    if options.vocab_parallel and not built.vocab:
        # The passes placed, and the schedule's overlapped pairs kept where they still
        # run as units around them (expert parallelism's paired F/B).
        built = validate(paired_with_vocab(with_vocab(built), built.pairs))
    options.check_schedule(built)
    return Settled(chosen, built, options, before, originals)


def plan_pipeline(
    model: nn.Module, ctx: Context, options: Options, memory_limit: float | None
) -> Plan:
    """``Pipeline(schedule="auto")``: the plan for a pipeline's options, keeping its
    micro-batch count (on ``options.sample``, which :func:`settle` checked is given)."""
    sample: Any = options.sample
    assert sample is not None
    shards = (ctx.replicas if options.fsdp else 1) * (ctx.tp_size if options.tp_plan else 1)
    return plan(
        model,
        sample[0],
        sample[1],
        options.loss_fn,
        pipeline_ranks(ctx, model, "auto", options.chunks, options.balance),
        memory_limit,
        microbatch_counts=[options.microbatches],
        param_shards=shards,
        options=options,
        device=ctx.device,
        vocab=True if options.vocab_parallel else None,
    )
