"""Looped BFS (torch's ScheduleLoopedBFS): breadth first over the chunks of each rank."""

from __future__ import annotations

import dataclasses

from conveyor.schedules.core import Schedule
from conveyor.schedules.gpipe import gpipe


def looped_bfs(ranks: int, microbatches: int, chunks: int) -> Schedule:
    """Loop placement (stage s on rank s % p); every micro-batch through chunk 0, then 1, ...

    Backwards run the chunks in reverse. This is GPipe's chunked order, so the programs
    are :func:`~conveyor.schedules.gpipe.gpipe`'s. torch runs each chunk's backwards in
    reverse micro-batch order; the simulated makespan and the peak memory (all m
    micro-batches held until their backward) are the same either way. Any m >= 1, any
    chunks >= 1.

    Args:
        ranks: Pipeline ranks.
        microbatches: Micro-batches per step.
        chunks: Stages per rank.

    Returns:
        The schedule, named ``"looped-bfs"``, without split backward.

    Raises:
        ConfigError: If a size is not an integer >= 1.
    """
    return dataclasses.replace(gpipe(ranks, microbatches, chunks), name="looped-bfs")
