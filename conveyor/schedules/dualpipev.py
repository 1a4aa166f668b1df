"""DualPipeV (DeepSeek's DualPipe folded into a V, as torch's ScheduleDualPipeV)."""

from __future__ import annotations

from collections import deque

from conveyor.errors import ConfigError
from conveyor.schedules.core import Action, B, F, Schedule, W, check_sizes, v_placement
from conveyor.schedules.pairs import paired


def dualpipev_program(ranks: int, microbatches: int, rank: int) -> tuple[Action, ...]:
    """Rank ``rank``'s DualPipeV program (stages ``rank`` and ``2p-1-rank``).

    DualPipeV overlaps the forward of one chunk with the backward of the other; in this
    action model an overlapped pair is simply F followed by B. A "full" backward is B
    immediately followed by its W; a split one queues its W, which runs later from the
    queue to fill a gap. Steps (r = rank): 2(p-r-1) chunk-0 F; r+1 pairs F0 F1; p-r-1
    rounds B1 (split), a queued W, F1; m-2p+r+1 rounds F0 B1, F1 B0 (full); p-r-1 rounds
    B1, F1 B0 (full); r+1 pairs B1 B0 switching to split backward half-way; p-r-1 rounds
    of a queued W and B0; the remaining queued W's.

    Args:
        ranks: Pipeline ranks (p).
        microbatches: Micro-batches per step (m), at least ``2 * ranks - 1``; not
            checked here (:func:`dualpipev` checks it).
        rank: The rank whose program to build (r).

    Returns:
        The rank's actions in order: every F, B and W of its two stages.
    """
    p, m = ranks, microbatches
    first, second = rank, 2 * p - 1 - rank
    program: list[Action] = []
    next_f = {first: 0, second: 0}
    next_b = {first: 0, second: 0}
    queued: deque[Action] = deque()

    def forward(stage: int) -> None:
        program.append(Action(F, stage, next_f[stage]))
        next_f[stage] += 1

    def backward(stage: int, full: bool) -> None:
        mb = next_b[stage]
        next_b[stage] += 1
        program.append(Action(B, stage, mb))
        if full:
            program.append(Action(W, stage, mb))
        else:
            queued.append(Action(W, stage, mb))

    def queued_w() -> None:
        if queued:
            program.append(queued.popleft())

    for _ in range(2 * (p - rank - 1)):
        forward(first)
    for _ in range(rank + 1):
        forward(first)
        forward(second)
    for _ in range(p - rank - 1):
        backward(second, full=False)
        queued_w()
        forward(second)
    for _ in range(m - 2 * p + rank + 1):
        forward(first)
        backward(second, full=True)
        forward(second)
        backward(first, full=True)
    for _ in range(p - rank - 1):
        backward(second, full=True)
        forward(second)
        backward(first, full=True)
    split_backward = False
    half = (rank + 1) // 2
    for i in range(rank + 1):
        # Half-way through, switch to split backward so the queued W's can fill the
        # tail; odd ranks switch one backward earlier than even ranks.
        if i == half and rank % 2 == 1:
            split_backward = True
        backward(second, full=not split_backward)
        if i == half and rank % 2 == 0:
            split_backward = True
        backward(first, full=not split_backward)
    for _ in range(p - rank - 1):
        queued_w()
        backward(first, full=not split_backward)
    while queued:
        queued_w()
    return tuple(program)


def dualpipev(ranks: int, microbatches: int) -> Schedule:
    """DualPipeV: V placement, split backward where it fills bubbles; m >= 2p-1.

    Rank r holds stages r and 2p-1-r (:func:`~conveyor.schedules.core.v_placement`);
    the programs are :func:`dualpipev_program`'s. torch asks for m >= 2p; 2p-1 works.

    Args:
        ranks: Pipeline ranks (p).
        microbatches: Micro-batches per step (m).

    Returns:
        The schedule, named ``"dualpipev"``, with ``split_backward=True``.

    Raises:
        ConfigError: For sizes below 1, or fewer than ``2 * ranks - 1`` micro-batches:
            the steady phase F0 B1 / F1 B0 needs both chunks of every rank busy at once.
    """
    check_sizes(ranks, microbatches)
    if microbatches < 2 * ranks - 1:
        raise ConfigError(
            f"dualpipev needs microbatches >= 2*ranks - 1 = {2 * ranks - 1}; got "
            f"microbatches={microbatches} with ranks={ranks}, so use more micro-batches "
            f"or 'zbv', which runs any count"
        )
    return paired(
        Schedule(
            name="dualpipev",
            ranks=ranks,
            microbatches=microbatches,
            placement=v_placement(ranks),
            actions=tuple(dualpipev_program(ranks, microbatches, r) for r in range(ranks)),
            split_backward=True,
        )
    )
