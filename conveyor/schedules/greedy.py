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
from dataclasses import dataclass

from conveyor.errors import ConfigError, ScheduleError
from conveyor.schedules.core import Action, B, F, W, requires

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
    max_ahead = list(inflight) if inflight is not None else list(caps)
    if fill not in FILLS:
        raise ConfigError(f"fill must be one of {FILLS}, got {fill!r}")
    if min(caps) < 1 or min(max_ahead) < 1:
        raise ConfigError("every rank must be allowed to hold at least 1 activation")
    limits = _Limits(list(caps), max_ahead, fill == "always")
    return _ListScheduler(placement, microbatches, durations, limits, comm).run()


@dataclass(frozen=True)
class _Limits:
    """Per rank, the most activations held from F until W (``caps``) and from F until B
    (``ahead``); ``fill_always``: run a pending W whenever nothing else is ready."""

    caps: list[int]
    ahead: list[int]
    fill_always: bool


class _ListScheduler:
    """The state of one greedy run in simulated time (see :func:`greedy_programs`).

    When each scheduled action ends; per stage, the next micro-batch of its F and of its
    B. Per rank: its pending W's, the activations it holds, the actions it has left, its
    program so far, when it is free and when it decides next (infinity while it sleeps
    until a waited-for action is scheduled).
    """

    def __init__(
        self,
        placement: Sequence[int],
        microbatches: int,
        durations: Sequence[StageCost],
        limits: _Limits,
        comm: float,
    ) -> None:
        ranks = max(placement) + 1
        stages = len(placement)
        self.placement, self.m, self.durations = placement, microbatches, durations
        self.limits, self.comm, self.stages = limits, comm, stages
        self.own_stages = [[s for s in range(stages) if placement[s] == r] for r in range(ranks)]
        self.end: dict[Action, float] = {}
        self.next_f = [0] * stages
        self.next_b = [0] * stages
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(ranks)]
        self.held = [0] * ranks  # activations from F until W
        self.ahead = [0] * ranks  # activations from F until B
        self.left = [3 * microbatches * len(own) for own in self.own_stages]
        self.programs: list[list[Action]] = [[] for _ in range(ranks)]
        # Ranks waiting for an action that is not scheduled yet, keyed by that action.
        self.waiters: dict[Action, list[int]] = {}
        self.free = [0.0] * ranks
        self.wake = [0.0] * ranks
        self.heap = [(0.0, r) for r in range(ranks)]

    def run(self) -> list[list[Action]]:
        """Let every rank decide whenever it wakes, until none has work left."""
        while self.heap:
            now, rank = heapq.heappop(self.heap)
            if now == self.wake[rank] and self.left[rank]:  # else stale, or finished
                self._decide(rank, now)
        if any(self.left):
            stuck = [r for r, left in enumerate(self.left) if left]
            raise ScheduleError(f"the greedy scheduler stalled on ranks {stuck}")
        return self.programs

    def _ready(self, action: Action, rank: int, now: float) -> float:
        """0 when every dependency of ``action`` has reached ``rank`` (plus ``comm`` from
        another rank) by ``now``, else when the last one does; infinity, and ``rank``
        registered as a waiter, while one is unscheduled."""
        ready_at = 0.0
        for dependency in requires(action, self.stages):
            end = self.end.get(dependency)
            if end is None:
                self.waiters.setdefault(dependency, []).append(rank)
                return math.inf
            far = self.placement[dependency.stage] != rank
            ready_at = max(ready_at, end + (self.comm if far else 0.0))
        return ready_at if ready_at > now else 0.0

    def _decide(self, rank: int, now: float) -> None:
        """Run the best ready action of ``rank``, or put it to sleep until one can be."""
        best_b: tuple[int, int] | None = None  # (mb, stage): lowest mb, then highest stage
        best_f: tuple[int, int] | None = None
        soonest = math.inf
        limits = self.limits
        may_forward = (
            self.held[rank] < limits.caps[rank] and self.ahead[rank] < limits.ahead[rank]
        )
        for s in self.own_stages[rank]:
            mb = self.next_b[s]
            if mb < self.next_f[s]:
                at = self._ready(Action(B, s, mb), rank, now)
                if at:
                    soonest = min(soonest, at)
                elif best_b is None or (mb, -s) < (best_b[0], -best_b[1]):
                    best_b = (mb, s)
            mb = self.next_f[s]
            if mb < self.m and may_forward:
                at = self._ready(Action(F, s, mb), rank, now)
                if at:
                    soonest = min(soonest, at)
                elif best_f is None or (mb, -s) < (best_f[0], -best_f[1]):
                    best_f = (mb, s)
        pending = self.pending_w[rank]
        if best_b is not None:
            self._run(rank, now, Action(B, best_b[1], best_b[0]))
        elif best_f is not None:
            self._run(rank, now, Action(F, best_f[1], best_f[0]))
        elif pending and (
            limits.fill_always
            or soonest == math.inf
            or now + self.durations[pending[0][0]][2] <= soonest
        ):
            s, mb = pending.popleft()
            self._run(rank, now, Action(W, s, mb))
        else:
            # Sleep until the soonest known arrival, or until a waited-for action runs.
            self.wake[rank] = soonest
            if soonest < math.inf:
                heapq.heappush(self.heap, (soonest, rank))

    def _run(self, rank: int, now: float, action: Action) -> None:
        """Record ``action`` as run on ``rank`` from ``now`` and wake its waiters."""
        kind, s, mb = action
        finish = now + self.durations[s]["FBW".index(kind)]
        self.end[action] = finish
        if kind == F:
            self.next_f[s] += 1
            self.held[rank] += 1
            self.ahead[rank] += 1
        elif kind == B:
            self.next_b[s] += 1
            self.ahead[rank] -= 1
            self.pending_w[rank].append((s, mb))
        else:
            self.held[rank] -= 1
        self.left[rank] -= 1
        self.programs[rank].append(action)
        self.free[rank] = self.wake[rank] = finish
        heapq.heappush(self.heap, (finish, rank))
        for other in self.waiters.pop(action, ()):
            # A wait registered before ``other`` got busy again may be stale: never wake
            # a rank before it is free.
            at = max(finish + (self.comm if other != rank else 0.0), self.free[other])
            if at < self.wake[other]:
                self.wake[other] = at
                heapq.heappush(self.heap, (at, other))
