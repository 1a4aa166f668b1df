"""A list scheduler: run the pipeline in simulated time, record what each rank ran.

Used where a fixed formula would need special cases: ZB-H2 (derived with unit costs) and
the memory-bounded zero-bubble scheduler (:mod:`conveyor.schedules.auto`, real costs).
Whenever a rank is free it takes, in this order: a ready B (input gradient, on the
critical path), a ready F if one more activation fits under its caps, else a pending W
(weight gradient) to fill the gap and free memory; otherwise it waits for the next
arrival. The programs are a real execution, so they never deadlock.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

from conveyor.errors import ConfigError, ScheduleError
from conveyor.schedules.core import Action, B, F, Kind, W

StageCost = tuple[float, float, float]
"""Durations of one stage's F, B and W for one micro-batch."""
FILLS = ("always", "fit")
"""The values :func:`greedy_programs` accepts for ``fill``."""


def greedy_programs(
    placement: Sequence[int],
    microbatches: int,
    durations: Sequence[StageCost],
    caps: Sequence[int],
    inflight: Sequence[int] | None = None,
    comm: float = 0.0,
    fill: str = "always",
) -> list[list[Action]]:
    """Per-rank programs of the greedy B > F > W list scheduler, with split backward.

    F and B of each stage run in micro-batch order, W in the order of the B's.

    Args:
        placement: ``placement[s]`` is the rank of stage s.
        microbatches: Micro-batches per step.
        durations: ``durations[s]`` is (F, B, W) of stage s, in any time unit.
        caps: ``caps[r]`` is the most stage activations rank r may hold (from F until W).
        inflight: ``inflight[r]`` is the most forwards rank r may run ahead of its
            backwards (from F until B); None: no limit beyond ``caps``.
        comm: Latency of a transfer between ranks, in the unit of ``durations``.
        fill: ``"always"`` runs a pending W whenever nothing else is ready; ``"fit"``
            only when the W ends before the next known arrival.

    Returns:
        One program per rank (lists of F, B and W actions).

    Raises:
        ConfigError: For an unknown ``fill`` or a cap (or ``inflight`` entry) below 1.
        ScheduleError: If some rank cannot finish its program (the scheduler stalled).
    """
    ranks = max(placement) + 1
    max_ahead = list(inflight) if inflight is not None else list(caps)
    if fill not in FILLS:
        raise ConfigError(f"fill must be one of {FILLS}, got {fill!r}")
    if min(caps) < 1 or min(max_ahead) < 1:
        raise ConfigError("every rank must be allowed to hold at least 1 activation")
    m = microbatches
    stages = len(placement)
    last = stages - 1
    own_stages = [[s for s in range(stages) if placement[s] == r] for r in range(ranks)]
    end_f: list[list[float | None]] = [[None] * m for _ in range(stages)]
    end_b: list[list[float | None]] = [[None] * m for _ in range(stages)]
    next_f = [0] * stages
    next_b = [0] * stages
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(ranks)]
    held = [0] * ranks  # activations from F until W
    ahead = [0] * ranks  # activations from F until B
    left = [3 * m * len(own_stages[r]) for r in range(ranks)]
    programs: list[list[Action]] = [[] for _ in range(ranks)]
    # Ranks waiting for an action that is not scheduled yet, keyed by that action.
    waiters: dict[tuple[Kind, int, int], list[int]] = {}
    free = [0.0] * ranks
    wake = [0.0] * ranks  # when each rank decides next; inf while it sleeps on a waiter
    heap = [(0.0, r) for r in range(ranks)]
    kind_index = {F: 0, B: 1, W: 2}

    def arrival(dep_end: float | None, dep_stage: int, rank: int) -> float | None:
        """When a dependency's output reaches ``rank`` (None while it is unscheduled)."""
        if dep_end is None:
            return None
        return dep_end + (comm if placement[dep_stage] != rank else 0.0)

    def run(rank: int, now: float, action: Action) -> None:
        """Record ``action`` as run on ``rank`` from ``now`` and wake its waiters."""
        kind, s, mb = action
        finish = now + durations[s][kind_index[kind]]
        if kind == F:
            end_f[s][mb] = finish
            next_f[s] += 1
            held[rank] += 1
            ahead[rank] += 1
        elif kind == B:
            end_b[s][mb] = finish
            next_b[s] += 1
            ahead[rank] -= 1
            pending_w[rank].append((s, mb))
        else:
            held[rank] -= 1
        left[rank] -= 1
        programs[rank].append(action)
        free[rank] = wake[rank] = finish
        heapq.heappush(heap, (finish, rank))
        for other in waiters.pop(action, ()):
            # A wait registered before ``other`` got busy again may be stale: never wake
            # a rank before it is free.
            at = max(finish + (comm if other != rank else 0.0), free[other])
            if at < wake[other]:
                wake[other] = at
                heapq.heappush(heap, (at, other))

    while heap:
        now, rank = heapq.heappop(heap)
        if now != wake[rank] or left[rank] == 0:
            continue  # a stale wake-up, or a finished rank
        best_b: tuple[int, int] | None = None  # (mb, stage): lowest mb, then highest stage
        best_f: tuple[int, int] | None = None
        soonest = math.inf
        may_forward = held[rank] < caps[rank] and ahead[rank] < max_ahead[rank]
        for s in own_stages[rank]:
            mb = next_b[s]
            if mb < next_f[s]:
                ready_at = end_f[s][mb] if s == last else arrival(end_b[s + 1][mb], s + 1, rank)
                if ready_at is None:
                    waiters.setdefault((B, s + 1, mb), []).append(rank)
                elif ready_at > now:
                    soonest = min(soonest, ready_at)
                elif best_b is None or (mb, -s) < (best_b[0], -best_b[1]):
                    best_b = (mb, s)
            mb = next_f[s]
            if mb < m and may_forward:
                ready_at = 0.0 if s == 0 else arrival(end_f[s - 1][mb], s - 1, rank)
                if ready_at is None:
                    waiters.setdefault((F, s - 1, mb), []).append(rank)
                elif ready_at > now:
                    soonest = min(soonest, ready_at)
                elif best_f is None or (mb, -s) < (best_f[0], -best_f[1]):
                    best_f = (mb, s)
        if best_b is not None:
            run(rank, now, Action(B, best_b[1], best_b[0]))
        elif best_f is not None:
            run(rank, now, Action(F, best_f[1], best_f[0]))
        elif pending_w[rank] and (
            fill == "always"
            or soonest == math.inf
            or now + durations[pending_w[rank][0][0]][2] <= soonest
        ):
            s, mb = pending_w[rank].popleft()
            run(rank, now, Action(W, s, mb))
        else:
            # Sleep until the soonest known arrival, or until a waited-for action runs.
            wake[rank] = soonest
            if soonest < math.inf:
                heapq.heappush(heap, (soonest, rank))
    if any(left):
        stuck = [r for r in range(ranks) if left[r]]
        raise ScheduleError(f"the greedy scheduler stalled on ranks {stuck}")
    return programs
