"""``Pipeline``, the object users touch: :class:`PipelineBase` plus ``schedule="auto"``.

The planner resolves ``"auto"`` and calibrates by running :class:`PipelineBase` itself, so
the import direction is pipeline -> plan -> pipeline_base, with no cycle.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from conveyor.context import Context, current
from conveyor.errors import ConfigError
from conveyor.pipeline_base import PipelineBase, pipeline_ranks
from conveyor.planning.planner import Plan, plan
from conveyor.runtime.engine import LossFn
from conveyor.schedules import Schedule


class Pipeline(PipelineBase):
    """A model cut into stages and trained by a pipeline schedule: build it the same way
    on every rank, call ``train_step`` and step your optimizer over ``pipe.parameters()``.

    Everything is as in :class:`~conveyor.pipeline_base.PipelineBase` (which documents
    data parallelism, recompute, autocast and memory tracking), plus
    ``schedule="auto"``: :func:`conveyor.plan` picks the schedule, chunks and balance
    (keeping ``microbatches``), profiling the model on ``sample=(inputs, targets)`` within
    ``memory_limit`` bytes per rank; the result is ``pipe.plan``. In a distributed world
    every rank must build the pipeline at the same time (planning is collective).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_fn: LossFn | None,
        microbatches: int,
        schedule: str | Schedule = "1f1b",
        chunks: int = 1,
        balance: list[int] | None = None,
        context: Context | None = None,
        fsdp: bool | str = False,
        tp_plan: Mapping[str, Any] | None = None,
        sample: tuple[Any, Any] | None = None,
        memory_limit: float | None = None,
        recompute: bool | Iterable[int] = False,
        autocast: torch.dtype | None = None,
        track_memory: bool = False,
    ) -> None:
        self.plan: Plan | None = None
        if schedule == "auto":
            if sample is None:
                raise ConfigError(
                    "schedule='auto' profiles the model on a batch: pass sample=(inputs, "
                    "targets), e.g. your first batch"
                )
            if loss_fn is None:
                raise ConfigError(
                    "schedule='auto' needs a loss_fn to profile the last layers with; pass "
                    "one, or name a schedule"
                )
            ctx = context if context is not None else current()
            self.plan = plan(
                model,
                sample[0],
                sample[1],
                loss_fn,
                pipeline_ranks(ctx, model, schedule, chunks, balance),
                memory_limit,
                microbatch_counts=[microbatches],  # keep the user's micro-batch count
                param_shards=(ctx.dp_size if fsdp else 1) * (ctx.tp_size if tp_plan else 1),
            )
            schedule, chunks, balance = self.plan.built, self.plan.chunks, self.plan.balance
        super().__init__(
            model,
            loss_fn=loss_fn,
            microbatches=microbatches,
            schedule=schedule,
            chunks=chunks,
            balance=balance,
            context=context,
            fsdp=fsdp,
            tp_plan=tp_plan,
            sample=sample,
            recompute=recompute,
            autocast=autocast,
            track_memory=track_memory,
        )
