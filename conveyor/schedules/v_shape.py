"""V-Half and V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024).

Both run two chunks per rank in the V placement (rank r holds stages r and 2p-1-r) with a
split backward, and both are built the paper's way: a *building block* (one micro-batch's
F and B of both chunks on every rank, at fixed time slots) is repeated every 6 slots,
which is one micro-batch's work per rank when F = B = W = 1 per chunk. The block's
*lifespan* on a rank (from a chunk's F to its W) decides the peak activation memory: the
rank holds lifespan / 6 chunk activations at once.

Rank r's slots of micro-batch 0, in the order F of chunk 0, F of chunk 1, B of chunk 1,
B of chunk 0 (chunk 0 is stage r, chunk 1 stage 2p-1-r):

- V-Min: r, 2p-1-r, 2p+d+r, 4p+d-1-r with d = 2 when 3 divides p, else 0. Each pass
  moves one slot per rank, the tightest V: about (p+4)//3 micro-batches held.
- V-Half: 2r, 3p-2-r, 3p+d-1+2r, 6p+d-2-r with d = 3 when p is even, else 0. Chunk 0's
  forward and chunk 1's backward move two slots per rank, which leaves room for W and F
  of later micro-batches between them: about (p+2)//2 micro-batches held.

``d`` shifts the backward half so that a rank's four slots fall in four different
residues mod 6: the repeated blocks then never want the same slot, and the two slots left
free in every period take the rank's two W's.

The paper leaves the W placement and the warm-up / cool-down open; what is chosen here is
what :func:`conveyor.simulate.simulate` shows best (F = B = W = 1, p = 2..16, m = 4p):

1. W: each W takes the first free slot after its B, oldest B first (FIFO). W frees the
   activation, so the earliest W keeps the lifespan (and the peak) that of the block.
2. Squeeze: in slot order, each action moves to the earliest free slot after all it
   depends on (and after the same kind of the same stage's previous micro-batch), an F
   only where the rank's activations stay within the cap. The cap is the largest peak of
   any rank of the block schedule (not each rank's own): the same maximum, and a smaller
   bubble (V-Min p=8, m=32: 0.119 instead of 0.123; p=2, m=8: 0.040 instead of 0.059).
   This fills the warm-up the way the paper's squeeze does.
3. Cool-down: after a rank's last F, it runs a B as soon as one is ready and a W only
   while no B is (B is on the critical path, W is not). With no F left this cannot raise
   the peak, and it cuts V-Half's bubble by a quarter to a half (p=8, m=32: 0.081
   instead of 0.107; p=4, m=16: 0.050 instead of 0.086).

Every step moves actions only to free slots after what they wait for, so the slot order is
a real execution with unit costs and the ranks' programs cannot deadlock, for any m >= 1.
"""

from __future__ import annotations

import bisect
from typing import Literal

from conveyor.schedules.core import (
    Action,
    B,
    F,
    Schedule,
    W,
    check_sizes,
    requires,
    v_placement,
)

Variant = Literal["half", "min"]
"""Which V schedule: ``"half"`` (V-Half) or ``"min"`` (V-Min)."""

PERIOD = 6
"""Slots between two micro-batches' building blocks: F, B and W of two chunks."""

Slots = dict[int, Action]
"""One rank's timeline: slot -> the action in it."""


def block_offsets(variant: Variant, ranks: int, rank: int) -> tuple[int, int, int, int]:
    """Rank ``rank``'s slots of micro-batch 0: F chunk 0, F chunk 1, B chunk 1, B chunk 0.

    Args:
        variant: ``"half"`` or ``"min"``.
        ranks: Pipeline ranks (p).
        rank: The rank (r).

    Returns:
        The four slots; they differ mod :data:`PERIOD` (module docstring).
    """
    p, r = ranks, rank
    if variant == "min":
        d = 2 if p % 3 == 0 else 0
        return (r, 2 * p - 1 - r, 2 * p + d + r, 4 * p + d - 1 - r)
    d = 3 if p % 2 == 0 else 0
    return (2 * r, 3 * p - 2 - r, 3 * p + d - 1 + 2 * r, 6 * p + d - 2 - r)


def _block_timeline(variant: Variant, ranks: int, microbatches: int, rank: int) -> Slots:
    """The building block repeated for every micro-batch, W's at the first free slots."""
    first, second = rank, 2 * ranks - 1 - rank
    kinds = ((F, first), (F, second), (B, second), (B, first))
    offsets = block_offsets(variant, ranks, rank)
    timeline: Slots = {}
    for mb in range(microbatches):
        for (kind, stage), offset in zip(kinds, offsets, strict=True):
            timeline[offset + PERIOD * mb] = Action(kind, stage, mb)
    waiting: list[Action] = []  # W's whose B ran, oldest first
    filled: Slots = {}
    slot, end = 0, max(timeline)
    while slot <= end or waiting:
        action = timeline.get(slot)
        if action is None and waiting:
            filled[slot] = waiting.pop(0)
        elif action is not None and action.kind == B:
            waiting.append(Action(W, action.stage, action.microbatch))
        slot += 1
    timeline.update(filled)
    return timeline


def _needs(action: Action, last_stage: int) -> list[Action]:
    """What ``action`` waits for: its data dependencies and its predecessor in kind."""
    kind, stage, mb = action
    before = [Action(kind, stage, mb - 1)] if mb > 0 else []
    return before + list(requires(action, last_stage + 1))


def _held(timeline: Slots, length: int) -> list[int]:
    """Chunk activations held after each slot (F takes one, W gives it back)."""
    held, now = [0] * length, 0
    for slot in range(length):
        action = timeline.get(slot)
        if action is not None and action.kind != B:
            now += 1 if action.kind == F else -1
        held[slot] = now
    return held


def _squeeze(timelines: list[Slots], last_stage: int) -> None:
    """Move each action, in slot order, to the earliest free slot it may take (in place)."""
    at: dict[Action, int] = {}
    rank_of: dict[Action, int] = {}
    for rank, timeline in enumerate(timelines):
        for slot, action in timeline.items():
            at[action], rank_of[action] = slot, rank
    length = max(at.values()) + 1
    held = [_held(timeline, length) for timeline in timelines]
    cap = max(max(h) for h in held)
    # Per rank, its free slots in increasing order: the only places an action can move to.
    free = [[s for s in range(length) if s not in timeline] for timeline in timelines]
    for action in sorted(at, key=lambda a: (at[a], rank_of[a])):
        rank, now = rank_of[action], at[action]
        timeline, counts, holes = timelines[rank], held[rank], free[rank]
        earliest = max((at[need] + 1 for need in _needs(action, last_stage)), default=0)
        first = bisect.bisect_left(holes, earliest)
        for i in range(first, bisect.bisect_left(holes, now)):
            slot = holes[i]
            if action.kind == F and max(counts[slot:now]) >= cap:
                continue
            del timeline[now]
            timeline[slot] = action
            at[action] = slot
            del holes[i]
            bisect.insort(holes, now)
            if action.kind != B:  # an earlier F holds one more, an earlier W one less
                step = 1 if action.kind == F else -1
                counts[slot:now] = [c + step for c in counts[slot:now]]
            break


def _cool_down(timelines: list[Slots], last_stage: int) -> None:
    """After each rank's last F: a B as soon as it is ready, else the oldest W (in place)."""
    at: dict[Action, int] = {}
    queues: list[tuple[list[Action], list[Action]]] = []  # per rank: B's to run, W's ready
    starts = []
    for timeline in timelines:
        start = max(slot for slot, action in timeline.items() if action.kind == F) + 1
        kept = {slot: a for slot, a in timeline.items() if slot < start}
        backwards = [timeline[s] for s in sorted(timeline) if s >= start and timeline[s].kind == B]
        weights = [a for s, a in sorted(timeline.items()) if s >= start and a.kind == W]
        ready = [w for w in weights if Action(B, w.stage, w.microbatch) in kept.values()]
        at.update((a, s) for s, a in kept.items())
        timeline.clear()
        timeline.update(kept)
        queues.append((backwards, ready))
        starts.append(start)
    slot = min(starts)
    while any(backwards or ready for backwards, ready in queues):
        for rank, (backwards, ready) in enumerate(queues):
            if slot < starts[rank]:
                continue
            nxt = backwards[0] if backwards else None
            if nxt is not None and all(at.get(n, slot) < slot for n in _needs(nxt, last_stage)):
                backwards.pop(0)
                ready.append(Action(W, nxt.stage, nxt.microbatch))
            elif ready:
                nxt = ready.pop(0)
            else:
                continue
            timelines[rank][slot] = nxt
            at[nxt] = slot
        slot += 1


def v_programs(variant: Variant, ranks: int, microbatches: int) -> list[tuple[Action, ...]]:
    """Every rank's program of V-Half or V-Min (how: the module docstring).

    Args:
        variant: ``"half"`` or ``"min"``.
        ranks: Pipeline ranks (p).
        microbatches: Micro-batches per step (m), any m >= 1.

    Returns:
        One program per rank: every F, B and W of its stages r and 2p-1-r, in slot order.
    """
    last_stage = 2 * ranks - 1
    timelines = [_block_timeline(variant, ranks, microbatches, r) for r in range(ranks)]
    _squeeze(timelines, last_stage)
    _cool_down(timelines, last_stage)
    return [tuple(t[slot] for slot in sorted(t)) for t in timelines]


def _v_schedule(name: str, variant: Variant, ranks: int, microbatches: int) -> Schedule:
    check_sizes(ranks, microbatches)
    return Schedule(
        name=name,
        ranks=ranks,
        microbatches=microbatches,
        placement=v_placement(ranks),
        actions=tuple(v_programs(variant, ranks, microbatches)),
        split_backward=True,
    )


def v_half(ranks: int, microbatches: int) -> Schedule:
    """V-Half: about half of 1F1B's activations at a smaller bubble; any m >= 1.

    Holds at most (p+2)//2 micro-batches of one rank's share (1F1B: p); with
    F = B = W = 1 and m = 4p the bubble is below half of 1F1B's (p=8, m=32: 0.081
    against 0.179; the paper's estimate is p/2m).

    Args:
        ranks: Pipeline ranks (p).
        microbatches: Micro-batches per step (m).

    Returns:
        The schedule, named ``"v-half"``, with the V placement and ``split_backward=True``.

    Raises:
        ConfigError: If a size is not an integer >= 1.
    """
    return _v_schedule("v-half", "half", ranks, microbatches)


def v_min(ranks: int, microbatches: int) -> Schedule:
    """V-Min: about a third of 1F1B's activations; any m >= 1.

    Holds at most (p+4)//3 micro-batches of one rank's share (1F1B: p); with
    F = B = W = 1 and m = 4p the bubble is about two thirds of 1F1B's (p=8, m=32: 0.119
    against 0.179; the paper's estimate is 2p/3m).

    Args:
        ranks: Pipeline ranks (p).
        microbatches: Micro-batches per step (m).

    Returns:
        The schedule, named ``"v-min"``, with the V placement and ``split_backward=True``.

    Raises:
        ConfigError: If a size is not an integer >= 1.
    """
    return _v_schedule("v-min", "min", ranks, microbatches)
