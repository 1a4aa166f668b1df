"""Interleaved 1F1B (Megatron-LM): several chunks per rank, loop placement."""

from __future__ import annotations

from conveyor.schedules.core import (
    B,
    F,
    Action,
    Schedule,
    check_sizes,
    execution_order,
    loop_placement,
)
from conveyor.errors import ScheduleError


def _chunk_order(ranks: int, microbatches: int, chunks: int, backward: bool) -> list[tuple[int, int]]:
    """(chunk, microbatch) in Megatron's order: groups of `ranks` micro-batches, each
    group through every chunk (reversed for backward); the last group may be smaller."""
    order = []
    chunk_seq = range(chunks - 1, -1, -1) if backward else range(chunks)
    for first in range(0, microbatches, ranks):
        group = range(first, min(first + ranks, microbatches))
        order.extend((c, mb) for c in chunk_seq for mb in group)
    return order


def _program(ranks: int, microbatches: int, chunks: int, rank: int, warmup: int) -> tuple[Action, ...]:
    forwards = [Action(F, c * ranks + rank, mb) for c, mb in _chunk_order(ranks, microbatches, chunks, False)]
    backwards = [Action(B, c * ranks + rank, mb) for c, mb in _chunk_order(ranks, microbatches, chunks, True)]
    total = len(forwards)
    warmup = min(warmup, total)
    program = forwards[:warmup]
    for i in range(total - warmup):
        program.append(forwards[warmup + i])
        program.append(backwards[i])
    program.extend(backwards[total - warmup:])
    return tuple(program)


def megatron_warmup(ranks: int, chunks: int, rank: int) -> int:
    if chunks == 1:
        return ranks - rank - 1
    return 2 * (ranks - rank - 1) + (chunks - 1) * ranks


def interleaved_1f1b(ranks: int, microbatches: int, chunks: int) -> Schedule:
    check_sizes(ranks, microbatches, chunks)
    warm = [megatron_warmup(ranks, chunks, r) for r in range(ranks)]
    return Schedule(
        name="interleaved-1f1b",
        ranks=ranks,
        microbatches=microbatches,
        placement=loop_placement(ranks, chunks),
        actions=tuple(_program(ranks, microbatches, chunks, r, warm[r]) for r in range(ranks)),
    )
