"""Interleaved 1F1B (Megatron-LM): several chunks per rank, stage s on rank s % p."""

from __future__ import annotations

import heapq

from conveyor.schedules.core import (
    Action,
    B,
    F,
    Kind,
    Schedule,
    check_sizes,
    loop_placement,
)
from conveyor.schedules.one_f_one_b import one_f_one_b_program
from conveyor.schedules.pairs import paired


def microbatch_groups(ranks: int, microbatches: int) -> list[range]:
    """Micro-batches in groups of ``ranks``; the first group also takes the remainder.

    Megatron requires ``ranks`` to divide ``microbatches``. Putting the remainder first
    (rather than in a short last group) keeps the steady state free of bubbles: with it
    the interleaved makespan is m(F+B) + (p-1)(F+B)/v for every m >= p.

    Args:
        ranks: Pipeline ranks (p).
        microbatches: Micro-batches per step (m).

    Returns:
        Consecutive ranges of micro-batch indices covering ``range(microbatches)``: one
        range when ``microbatches <= ranks``.
    """
    if microbatches <= ranks:
        return [range(microbatches)]
    first_size = ranks + microbatches % ranks
    return [range(0, first_size)] + [
        range(f, f + ranks) for f in range(first_size, microbatches, ranks)
    ]


def chunk_order(
    ranks: int, microbatches: int, chunks: int, backward: bool = False
) -> list[tuple[int, int]]:
    """The (chunk, micro-batch) pairs of one rank's forwards or backwards, in Megatron's order.

    Each group of micro-batches (:func:`microbatch_groups`) runs through every chunk in
    turn, the chunks reversed for backward. The order is the same on every rank.

    Args:
        ranks: Pipeline ranks.
        microbatches: Micro-batches per step.
        chunks: Stages per rank.
        backward: Whether to give the backwards' order rather than the forwards'.

    Returns:
        ``(chunk, microbatch)`` pairs, chunk c of rank r being stage ``c * ranks + r``.
    """
    chunk_seq = range(chunks - 1, -1, -1) if backward else range(chunks)
    return [
        (c, mb)
        for mb_group in microbatch_groups(ranks, microbatches)
        for c in chunk_seq
        for mb in mb_group
    ]


def megatron_warmup(ranks: int, chunks: int, rank: int) -> int:
    """Megatron's warm-up forward count on ``rank``: 2(p-rank-1) + (v-1)p.

    Args:
        ranks: Pipeline ranks (p).
        chunks: Stages per rank (v).
        rank: The rank.

    Returns:
        The forwards ``rank`` runs before its first backward (not capped at the number
        of forwards it has).
    """
    return 2 * (ranks - rank - 1) + (chunks - 1) * ranks


def _megatron_program(ranks: int, microbatches: int, chunks: int, rank: int) -> list[Action]:
    """Warm-up forwards, then one forward / one backward, then the remaining backwards."""
    forwards = [
        Action(F, c * ranks + rank, mb) for c, mb in chunk_order(ranks, microbatches, chunks)
    ]
    backwards = [
        Action(B, c * ranks + rank, mb) for c, mb in chunk_order(ranks, microbatches, chunks, True)
    ]
    total = len(forwards)
    warmup = min(megatron_warmup(ranks, chunks, rank), total)
    program = forwards[:warmup]
    for i in range(total - warmup):
        program.append(forwards[warmup + i])
        program.append(backwards[i])
    program.extend(backwards[total - warmup :])
    return program


def _list_scheduled_programs(ranks: int, microbatches: int, chunks: int) -> list[list[Action]]:
    """Megatron's priorities, with the F/B interleaving found by running the pipeline.

    Megatron's fixed warm-up count can deadlock when ``ranks`` does not divide
    ``microbatches`` (forwards of later chunks arrive at other times than the count
    assumes). Here each rank runs in ideal time with unit costs: forwards in Megatron's
    order until its first backward is ready, then alternating backward / forward, taking
    the other kind when the preferred one is not ready yet. The result is a real
    execution, so it cannot deadlock. With the remainder in the first group
    (:func:`microbatch_groups`) it reaches Megatron's makespan m(F+B) + (p-1)(F+B)/v for
    every m >= p (tests/schedules/test_simulate.py checks this for several F:B ratios).
    """
    p, m, v = ranks, microbatches, chunks
    last = p * v - 1
    never = 1 << 62
    end_f = [[never] * m for _ in range(p * v)]
    end_b = [[never] * m for _ in range(p * v)]
    order = {F: chunk_order(p, m, v), B: chunk_order(p, m, v, backward=True)}
    total = m * v
    position = {F: [0] * p, B: [0] * p}  # per kind and rank: index of the next in order
    prefer_f = [False] * p
    programs: list[list[Action]] = [[] for _ in range(p)]

    def ready_at(kind: Kind, rank: int) -> int:
        """When ``rank``'s next ``kind`` action may start (``never`` while unknown)."""
        c, mb = order[kind][position[kind][rank]]
        s = c * p + rank
        if kind == F:
            return end_f[s - 1][mb] if s > 0 else 0
        return max(end_f[s][mb], end_b[s + 1][mb] if s < last else 0)

    heap = [(0, r) for r in range(p)]
    while heap:
        now, rank = heapq.heappop(heap)
        kinds = [k for k in (B, F) if position[k][rank] < total]
        if not kinds:
            continue
        if prefer_f[rank]:
            kinds.reverse()
        times = [ready_at(k, rank) for k in kinds]
        kind = next((k for k, t in zip(kinds, times, strict=True) if t <= now), None)
        if kind is None:
            # A dependency not yet scheduled ends at now + 1 at the earliest.
            heapq.heappush(heap, (now + 1 if never in times else min(times), rank))
            continue
        c, mb = order[kind][position[kind][rank]]
        position[kind][rank] += 1
        (end_f if kind == F else end_b)[c * p + rank][mb] = now + 1
        prefer_f[rank] = kind == B
        programs[rank].append(Action(kind, c * p + rank, mb))
        heapq.heappush(heap, (now + 1, rank))
    return programs


def interleaved_1f1b(ranks: int, microbatches: int, chunks: int) -> Schedule:
    """Interleaved 1F1B: ``chunks`` stages per rank (stage s on rank s % ranks).

    When ``ranks`` divides ``microbatches`` this is exactly Megatron-LM's order. Otherwise
    (Megatron refuses) the same priorities run in simulated time with unit costs decide
    the order, which cannot deadlock and keeps Megatron's makespan for every m >= p.
    With ``chunks`` == 1 it is 1F1B.

    Args:
        ranks: Pipeline ranks.
        microbatches: Micro-batches per step; any m >= 1.
        chunks: Stages per rank.

    Returns:
        The schedule, named ``"interleaved-1f1b"``, without split backward.

    Raises:
        ConfigError: If a size is not an integer >= 1.
    """
    check_sizes(ranks, microbatches, chunks)
    if chunks == 1:
        programs = [list(one_f_one_b_program(ranks, microbatches, r)) for r in range(ranks)]
    elif microbatches % ranks == 0:
        programs = [_megatron_program(ranks, microbatches, chunks, r) for r in range(ranks)]
    else:
        programs = _list_scheduled_programs(ranks, microbatches, chunks)
    return paired(
        Schedule(
            name="interleaved-1f1b",
            ranks=ranks,
            microbatches=microbatches,
            placement=loop_placement(ranks, chunks),
            actions=tuple(tuple(program) for program in programs),
        )
    )
