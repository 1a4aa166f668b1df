"""ZB-V (Qi et al., ICLR 2024, section 6): zero bubble with two chunks per rank in a V."""

from __future__ import annotations

from conveyor.schedules.core import Action, B, F, Schedule, W, check_sizes, v_placement


def zbv_program(ranks: int, microbatches: int, rank: int) -> tuple[Action, ...]:
    """Rank ``rank``'s ZB-V program (stages ``rank`` and ``2p-1-rank``).

    Warm-up: 2(p-r)-1 chunk-0 forwards, then r pairs of chunk-1 / chunk-0 forwards, then
    p-r rounds of chunk-1 F, B, W. Steady state: F, B, W on chunk 0 then on chunk 1.
    Cool-down: r pairs of B's, p-r chunk-0 B/W pairs, then the remaining W's.

    The pattern needs at least 2p-1 micro-batches to fill the V. With fewer, it is
    built for 2p-1 and the actions of the micro-batches that do not exist are dropped:
    dropping work cannot add a wait, so the order stays valid (every m >= 1 works).

    Args:
        ranks: Pipeline ranks (p).
        microbatches: Micro-batches per step (m).
        rank: The rank whose program to build (r).

    Returns:
        The rank's actions in order: every F, B and W of its two stages.
    """
    p = ranks
    planned = max(2 * p - 1, microbatches)
    chunk_stage = (rank, 2 * p - 1 - rank)  # the rank's stage of chunk 0 and chunk 1
    program: list[Action] = []
    # Next micro-batch per (kind, chunk); plain lists keep this hot loop cheap.
    f, b, w = [0, 0], [0, 0], [0, 0]

    def fbw(chunk: int, forward: bool = True) -> None:
        """Append F (when ``forward``), B and W of ``chunk``'s next micro-batches."""
        if forward:
            program.append(Action(F, chunk_stage[chunk], f[chunk]))
            f[chunk] += 1
        program.append(Action(B, chunk_stage[chunk], b[chunk]))
        program.append(Action(W, chunk_stage[chunk], b[chunk]))
        b[chunk] += 1
        w[chunk] += 1

    for mb in range(2 * (p - rank) - 1):
        program.append(Action(F, chunk_stage[0], mb))
    f[0] = 2 * (p - rank) - 1
    for _ in range(rank):
        program.append(Action(F, chunk_stage[1], f[1]))
        program.append(Action(F, chunk_stage[0], f[0]))
        f[1] += 1
        f[0] += 1
    for _ in range(p - rank):
        fbw(1)
    while f[1] < f[0] or f[0] < planned:
        fbw(0, forward=f[0] < planned)
        fbw(1)
    for _ in range(rank):
        program.append(Action(B, chunk_stage[0], b[0]))
        program.append(Action(B, chunk_stage[1], b[1]))
        b[0] += 1
        b[1] += 1
    for _ in range(p - rank):
        program.append(Action(B, chunk_stage[0], b[0]))
        program.append(Action(W, chunk_stage[0], w[0]))
        b[0] += 1
        w[0] += 1
    for chunk in (1, 0):
        program.extend(Action(W, chunk_stage[chunk], mb) for mb in range(w[chunk], b[chunk]))
    if planned == microbatches:
        return tuple(program)
    return tuple(a for a in program if a.microbatch < microbatches)


def zbv(ranks: int, microbatches: int) -> Schedule:
    """ZB-V: V placement (rank r holds stages r and 2p-1-r), split backward; any m >= 1.

    With F = B = W and m >= 2p-1 no rank idles between its first and last action (span
    m(F+B+W)) while holding p micro-batches of activations, the peak of 1F1B.

    Args:
        ranks: Pipeline ranks (p).
        microbatches: Micro-batches per step (m).

    Returns:
        The schedule, named ``"zbv"``, with ``split_backward=True``.

    Raises:
        ConfigError: If a size is not an integer >= 1.
    """
    check_sizes(ranks, microbatches)
    return Schedule(
        name="zbv",
        ranks=ranks,
        microbatches=microbatches,
        placement=v_placement(ranks),
        actions=tuple(zbv_program(ranks, microbatches, r) for r in range(ranks)),
        split_backward=True,
    )
