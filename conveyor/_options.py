"""The keywords of :class:`conveyor.Pipeline`, checked in one place.

:class:`Options` holds them (frozen, keywords only); each value alone is checked at
construction. The rules between keywords are :mod:`conveyor._rules`'s, run against the
context (:meth:`Options.check_context`) and the schedule (:func:`pipeline_schedule`,
:meth:`Options.check_schedule`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import conveyor._rules as _rules
from conveyor.context import Context
from conveyor.errors import ConfigError
from conveyor.experts.collections import check_plan
from conveyor.partition.annotations import annotated_stages
from conveyor.runtime import microbatch
from conveyor.runtime.compiled import compile_keywords
from conveyor.runtime.compute import LossFn
from conveyor.runtime.recompute import autocast_dtype
from conveyor.schedules import Schedule, validate
from conveyor.schedules.registry import default_chunks, get_schedule
from conveyor.weights import Weights


@dataclass(frozen=True, kw_only=True)
class Options:
    """What a pipeline was asked for, besides the model, schedule and context.

    Attributes mirror :class:`conveyor.Pipeline`'s keywords of the same names, and are
    given by name (a field added anywhere shifts nothing).
    """

    loss_fn: LossFn | None
    microbatches: int
    chunks: int = 1
    balance: list[int] | None = None
    fsdp: bool | str = False
    tp_plan: Mapping[str, Any] | str | None = None
    sample: tuple[Any, Any] | None = None
    recompute: bool | Iterable[int] = False
    autocast: torch.dtype | None = None
    track_memory: bool = False
    compile: bool | dict[str, Any] = False
    weights: Weights = None
    init_seed: int = 0
    ep_plan: Sequence[str] | None = None
    vocab_parallel: bool | str | Sequence[str] = False
    cp_attention: str = "ring"

    def __post_init__(self) -> None:
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ConfigError(f"microbatches must be an int >= 1, got {self.microbatches!r}")
        if not isinstance(self.chunks, int) or self.chunks < 1:
            raise ConfigError(f"chunks must be an int >= 1, got {self.chunks!r}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise ConfigError(
                f"loss_fn must be a function (output, target) -> scalar tensor, or None when "
                f"the model computes its own loss; got {type(self.loss_fn).__name__}"
            )
        self.compile_keywords()
        autocast_dtype(self.autocast)  # checked once, here: it depends on nothing else
        if not isinstance(self.recompute, bool):
            # a collection read once (a generator too); check_schedule checks its indices
            with contextlib.suppress(TypeError):
                object.__setattr__(self, "recompute", tuple(self.recompute))
        if not isinstance(self.init_seed, int) or isinstance(self.init_seed, bool):
            raise ConfigError(f"init_seed must be an int, got {self.init_seed!r}")
        if self.weights is not None and not isinstance(self.weights, (str, os.PathLike)):
            raise ConfigError(
                f"weights must be a checkpoint path (a conveyor or transformers checkpoint "
                f"directory) or None, got {type(self.weights).__name__}"
            )
        check_plan(self.ep_plan)
        if self.cp_attention not in ("ring", "all-gather"):
            raise ConfigError(
                f"cp_attention must be 'ring' (keys and values passed round the cp ranks) or "
                f"'all-gather' (gathered once per attention), got {self.cp_attention!r}"
            )
        self._check_vocab()
        self._check_sharding()
        sample = self.sample
        if sample is not None and (not isinstance(sample, tuple) or len(sample) != 2):
            raise ConfigError(
                "sample must be a pair (inputs, targets), as train_step takes them (targets "
                "may be None with loss_fn=None)"
            )

    def _check_vocab(self) -> None:
        spec = self.vocab_parallel
        names = isinstance(spec, (list, tuple)) and 1 <= len(spec) <= 2
        if not (isinstance(spec, (bool, str)) or names):
            raise ConfigError(
                f"vocab_parallel must be False, True, a module name or a pair of names "
                f"(input embedding, output layer), got {spec!r}"
            )
        if isinstance(spec, (list, tuple)):
            object.__setattr__(self, "vocab_parallel", tuple(spec))

    def _check_sharding(self) -> None:
        if self.fsdp not in (False, True, "reshard"):
            raise ConfigError(
                f"fsdp must be False, True (gather each stage once per step) or 'reshard' "
                f"(gather each block per use), got {self.fsdp!r}"
            )
        plan = self.tp_plan
        if plan is not None and not isinstance(plan, Mapping) and plan != "auto":
            raise ConfigError(
                "tp_plan must be 'auto' (a transformers model's own plan) or map module-name "
                "patterns to torch ParallelStyles, e.g. "
                "{'blocks.*.mlp.fc1': ColwiseParallel(), 'blocks.*.mlp.fc2': RowwiseParallel()}"
            )

    def check_context(self, ctx: Context) -> None:
        """Check the rules between the keywords and the processes ``ctx`` describes
        (:func:`conveyor._rules.check_context`).

        Raises:
            ConfigError: sharding over a mesh dimension of size 1, or dynamic compiling
                with ``tp_plan``.
        """
        _rules.check_context(self, ctx)

    def check_schedule(self, schedule: Schedule) -> None:
        """Check the rules between the keywords and the schedule
        (:func:`conveyor._rules.check_schedule`).

        Raises:
            ConfigError: ``recompute`` naming stages the schedule does not have.
        """
        _rules.check_schedule(self, schedule)

    def compile_keywords(self) -> dict[str, Any] | None:
        """The :func:`torch.compile` keywords stages compile with (None: eager)."""
        return compile_keywords(self.compile)

    def recompute_stages(self, stages: int) -> frozenset[int]:
        """The global indices of the stages whose forward is re-run at B (``recompute``
        as :meth:`check_schedule` checked it)."""
        if isinstance(self.recompute, bool):
            return frozenset(range(stages)) if self.recompute else frozenset()
        return frozenset(self.recompute)


def schedule_chunks(schedule: str | Schedule, chunks: int | None) -> int:
    """The chunk count asked for: ``chunks``, else the schedule's own (a named one's
    default, a given one's count; the planner's choice for ``"auto"``)."""
    if chunks is not None:
        return chunks
    if isinstance(schedule, Schedule):
        return schedule.chunks
    if schedule == "auto" or not isinstance(schedule, str):
        return 1  # "auto": the planner tries each schedule's own count
    try:
        return default_chunks(schedule)
    except ConfigError:
        return 1  # an unknown name: pipeline_schedule says which names exist


def pipeline_schedule(
    schedule: str | Schedule, ranks: int, microbatches: int, chunks: int
) -> Schedule:
    """The schedule a pipeline runs: generated from a name, or a given one validated.

    Args:
        schedule: a registered name, or a :class:`~conveyor.schedules.Schedule`.
        ranks: pipeline ranks.
        microbatches: micro-batches per step.
        chunks: stages per rank.

    Returns:
        The validated schedule.

    Raises:
        ConfigError: a chunk count the named schedule cannot run (the registry's one rule,
            :func:`~conveyor.schedules.registry.check_chunks`), a wrong type, or a schedule
            built for other sizes.
    """
    if isinstance(schedule, str):
        return get_schedule(schedule, ranks, microbatches, chunks)
    if not isinstance(schedule, Schedule):
        raise ConfigError(
            f"schedule must be a name or a conveyor.schedules.Schedule, got "
            f"{type(schedule).__name__}"
        )
    _rules.schedule_fits(schedule, ranks, microbatches, chunks)
    return validate(schedule)


def pipeline_ranks(
    ctx: Context, model: Any, schedule: str | Schedule, chunks: int, balance: list[int] | None
) -> int:
    """How many pipeline ranks the schedule is built for.

    Args:
        ctx: the context; its ``pp_size`` wins when launched or given ``pp``.
        model: the model (its ``pipeline_stage`` annotations count stages).
        schedule: the schedule's name or the schedule.
        chunks: stages per rank.
        balance: layers per stage, if given.

    Returns:
        The context's pipeline ranks, or in a one-process world where ``init()`` was not
        given ``pp``, as many as the schedule, balance or annotations describe.

    Raises:
        ConfigError: a stage count ``chunks`` cannot share out, or a balance that does not
            fit a launched run.
    """
    if ctx.distributed or ctx.pp_explicit:
        if ctx.distributed and balance is not None and not isinstance(schedule, Schedule):
            _rules.balance_fits_launch(ctx, balance, chunks)
        return ctx.pp_size
    if isinstance(schedule, Schedule):
        return schedule.ranks
    stages = len(balance) if balance is not None else annotated_stages(model)
    if stages is None:
        return ctx.pp_size
    _rules.stages_share_out(stages, chunks, balance is not None)
    return stages // chunks


def check_step(loss_fn: LossFn | None, inputs: Any, targets: Any) -> None:
    """Check a training or evaluation step's batch against the loss.

    Raises:
        ConfigError: targets with ``loss_fn=None``, or inputs and targets of different
            batch sizes.
    """
    if loss_fn is None and targets is not None:
        raise ConfigError(
            "loss_fn=None takes the loss from the model's output, so targets are not used; "
            "pass the labels inside the inputs (e.g. {'input_ids': ..., 'labels': ...}) and "
            "targets=None, or give a loss_fn"
        )
    if inputs is not None and targets is not None:
        n = microbatch.batch_size(inputs, "inputs")
        t = microbatch.batch_size(targets, "targets")
        if n != t:
            raise ConfigError(
                f"inputs hold {n} samples but targets hold {t}; pass targets for the same "
                f"samples as the inputs (their first dimensions must match)"
            )


def check_step_arguments(
    mode: str, loss_fn: LossFn | None, inputs: Any, targets: Any, cut: Any
) -> Any:
    """Check a step's arguments; returns the inputs a capture samples (with micro-batches
    ``cut`` by the user: the first one's).

    Raises:
        ConfigError: both a batch and ``cut`` micro-batches, or a bad batch
            (:func:`check_step`).
    """
    if cut is not None:
        if inputs is not None or targets is not None:
            raise ConfigError(
                "pass either the batch (inputs, targets) or microbatches=[(inputs, "
                "targets), ...] cut by you, not both"
            )
        if isinstance(cut, (list, tuple)) and cut and isinstance(cut[0], tuple):
            return cut[0][0]  # the first micro-batch: a capture's sample
    elif mode != "predict":
        check_step(loss_fn, inputs, targets)
    return inputs
