"""Measurements of a step over every pipeline rank: the bubble, and the trace file.

Both are collectives over the pipeline group: every rank of a replica calls them.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

from conveyor.context import Context
from conveyor.errors import ConfigError
from conveyor.observe.trace import chrome_trace, measured_bubble, measured_costs
from conveyor.runtime.memory import MemoryReport
from conveyor.runtime.step_state import StepRecord
from conveyor.runtime.timing import Timing
from conveyor.runtime.transport import collective, guarded
from conveyor.schedules import Schedule
from conveyor.schedules.order import instructions
from conveyor.schedules.simulation import bubble
from conveyor.simulate import simulate


def memory_report(tracked: bool, record: StepRecord | None) -> MemoryReport:
    """The last training step's memory report (``pipe.last_step_memory()``).

    Raises:
        ConfigError: without ``track_memory=True``, or before any training step.
    """
    if not tracked:
        raise ConfigError("memory is measured only with Pipeline(..., track_memory=True)")
    if record is None or record.memory is None:
        raise ConfigError("no training step has run yet; call train_step first")
    return record.memory


def action_bytes(memory: MemoryReport | None) -> dict[tuple[str, int, int], dict[str, int]]:
    """Per (kind, stage, micro-batch) of a step, the bytes its action leaves held: an F's
    ``saved_bytes``, and under a split backward a B's ``held_bytes`` (until its W)."""
    if memory is None:
        return {}
    out = {("F", s, m): {"saved_bytes": size} for (s, m), size in memory.forward.items()}
    out.update({("B", s, m): {"held_bytes": size} for (s, m), size in memory.held.items()})
    return out


def pipeline_bubble(timings: list[Timing], ctx: Context, ranks: int) -> float:
    """The :func:`~conveyor.schedules.simulation.bubble` of a step over all pipeline ranks.

    Args:
        timings: this process's actions of the step.
        ctx: the context (in a distributed world, its pipeline group is reduced over).
        ranks: pipeline ranks.

    Returns:
        The bubble, the same on every pipeline rank of the replica.
    """
    if not ctx.distributed:
        return measured_bubble(timings, ranks)
    busy = sum(t.end - t.start for t in timings)
    first = min((t.start for t in timings), default=float("inf"))
    last = max((t.end for t in timings), default=float("-inf"))
    # On the context's device: NCCL reduces device tensors only. The first start is
    # reduced as a maximum of its negative, with the last end, in one collective.
    device = ctx.device
    busies = torch.tensor([busy], dtype=torch.float64, device=device)
    ends = torch.tensor([-first, last], dtype=torch.float64, device=device)
    group = ctx.pp_group
    doing = f"rank {ctx.rank}: measuring the bubble"
    collective(
        lambda: dist.all_reduce(busies, group=group, async_op=True),
        ctx.timeout,
        doing,
        "another pipeline rank",
    )
    collective(
        lambda: dist.all_reduce(ends, op=dist.ReduceOp.MAX, group=group, async_op=True),
        ctx.timeout,
        doing,
        "another pipeline rank",
    )
    first, last = -float(ends[0]), float(ends[1])
    if not first < last:  # no rank ran an action
        return 0.0
    return bubble(float(busies[0]), first, last, ranks)


def write_trace(
    path: str | os.PathLike[str],
    timings: list[Timing],
    waits: list[Timing],
    schedule: Schedule,
    ctx: Context,
    memory: MemoryReport | None = None,
) -> None:
    """Gather a step's actions and waits from every pipeline rank; rank 0 writes them.

    Args:
        path: the Chrome trace JSON to write.
        timings: this process's actions of the step.
        waits: this process's waits for other ranks.
        schedule: the schedule the step ran (recorded with the simulated bubble, and as
            ``order``: per rank, its program as a schedule table writes it, pairs as
            ``F0,3+B0,1`` and vocabulary passes at their slots).
        ctx: the context.
        memory: this process's memory report of the step (``track_memory=True``): its
            bytes per action go into the events.
    """
    parts = [(timings, waits, action_bytes(memory))]
    if ctx.distributed:
        gathered: list[Any] = [None] * ctx.pp_size
        guarded(
            lambda: dist.all_gather_object(gathered, parts[0], group=ctx.pp_group),
            f"rank {ctx.rank}: gathering the trace (pipe.save_trace)",
            "another pipeline rank",
        )
        parts = gathered
    if ctx.rank != 0:
        return
    every = [t for part, _, _ in parts for t in part]
    every_wait = [w for _, part, _ in parts for w in part]
    sizes = {key: size for _, _, part in parts for key, size in part.items()}
    simulated = simulate(schedule, cost=measured_costs(every, schedule.stages)).bubble
    info: dict[str, object] = {
        "schedule": schedule.name,
        "ranks": schedule.ranks,
        "chunks": schedule.chunks,
        "microbatches": schedule.microbatches,
        "measured_bubble": measured_bubble(every, schedule.ranks),
        "simulated_bubble": simulated,
        "order": [[str(step) for step in instructions(schedule, r)] for r in range(schedule.ranks)],
    }
    with open(path, "w") as f:
        json.dump(chrome_trace(every, every_wait, info, sizes), f)
