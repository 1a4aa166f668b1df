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
from typing import NamedTuple

from conveyor.errors import ConfigError, ScheduleError
from conveyor.schedules.core import Action, B, F, Kind, W, requires

StageCost = tuple[float, float, float]
"""Durations of one stage's F, B and W for one micro-batch."""
FILLS = ("always", "fit")
"""The values :func:`greedy_run` accepts for ``fill``."""
_INDEX: dict[Kind, int] = {F: 0, B: 1, W: 2}  # a kind's place in a StageCost


class GreedyRun(NamedTuple):
    """What one run of the list scheduler found: the per-rank programs, and the run's own
    makespan and span (as :func:`~conveyor.schedules.simulation.simulate` defines them;
    the simulator, starting each action as early as its program order allows, never
    finds them longer)."""

    programs: list[list[Action]]
    makespan: float
    span: float


def greedy_run(
    placement: Sequence[int],
    microbatches: int,
    durations: Sequence[StageCost],
    caps: Sequence[float],
    inflight: Sequence[int] | None = None,
    comm: float = 0.0,
    fill: str = "always",
    w_memory: float = 1.0,
    bound: tuple[float, float] = (math.inf, math.inf),
) -> GreedyRun | None:
    """The greedy B > F > W list scheduler, with split backward: per-rank programs and
    the run's own makespan and span, so a search can rank its runs without simulating
    each one again.

    F and B of each stage run in micro-batch order, W in the order of the B's.

    Args:
        placement: ``placement[s]`` is the rank of stage s.
        microbatches: Micro-batches per step.
        durations: ``durations[s]`` is (F, B, W) of stage s, in any time unit.
        caps: ``caps[r]`` is the most stage activations rank r may hold (from F until W),
            a whole one from F until B and ``w_memory`` of one from B until W.
        inflight: ``inflight[r]`` is the most forwards rank r may run ahead of its
            backwards (from F until B); None: no limit beyond ``caps``.
        comm: Latency of a transfer between ranks, in the unit of ``durations``.
        fill: ``"always"`` runs a pending W whenever nothing else is ready; ``"fit"``
            only when the W ends before the next known arrival, or when the cap keeps a
            ready F from running (W frees memory).
        w_memory: The share of a stage activation still held between its B and its W
            (the Zero Bubble paper's M_W / M_B), in [0, 1].
        bound: The (makespan, span) of the best run a search has: the run stops as soon
            as it cannot beat it, its makespan (or, at no less a makespan, its span)
            already past it, counting each rank's work left.

    Returns:
        The run; None only when it stopped at ``bound``.

    Raises:
        ConfigError: For an unknown ``fill``, a cap (or ``inflight`` entry) below 1, or a
            ``w_memory`` outside [0, 1].
        ScheduleError: If some rank cannot finish its program (the scheduler stalled).
    """
    max_ahead = list(inflight) if inflight is not None else [math.floor(c) for c in caps]
    if fill not in FILLS:
        raise ConfigError(f"fill must be one of {FILLS}, got {fill!r}")
    if min(caps) < 1 or min(max_ahead) < 1:
        raise ConfigError("every rank must be allowed to hold at least 1 activation")
    if not 0.0 <= w_memory <= 1.0:
        raise ConfigError(f"w_memory must be a share in [0, 1], got {w_memory!r}")
    limits = _Limits([float(c) for c in caps], max_ahead, fill == "always", w_memory)
    try:
        return _ListScheduler(placement, microbatches, durations, limits, comm, bound).run()
    except _Beaten:
        return None


class _Beaten(Exception):
    """A run cannot beat its ``bound``."""


@dataclass(frozen=True)
class _Limits:
    """Per rank, the most activations held from F until W (``caps``, a B-to-W one counting
    ``w_memory``) and from F until B (``ahead``); ``fill_always``: run a pending W whenever
    nothing else is ready."""

    caps: list[float]
    ahead: list[int]
    fill_always: bool
    w_memory: float


class _ListScheduler:
    """The state of one greedy run in simulated time (see :func:`greedy_run`).

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
        bound: tuple[float, float] = (math.inf, math.inf),
    ) -> None:
        ranks = max(placement) + 1
        stages = len(placement)
        self.placement, self.m, self.durations = placement, microbatches, durations
        self.limits, self.comm, self.stages = limits, comm, stages
        self.own_stages = [[s for s in range(stages) if placement[s] == r] for r in range(ranks)]
        # Keyed by (kind, stage, micro-batch): an Action, or a plain tuple equal to one.
        self.end: dict[tuple[Kind, int, int], float] = {}
        self.next_f = [0] * stages
        self.next_b = [0] * stages
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(ranks)]
        self.held = [0.0] * ranks  # activations from F until W (B to W: w_memory of one)
        self.ahead = [0] * ranks  # activations from F until B
        self.left = [3 * microbatches * len(own) for own in self.own_stages]
        # Per rank, the time its actions not yet run take. A rank ends no sooner than it
        # is free plus that: the run's makespan and span are at least ``latest`` and
        # ``longest`` (the first start is 0), and with ``bound`` a run past it stops.
        self.work = [microbatches * sum(sum(durations[s]) for s in own) for own in self.own_stages]
        self.latest = self.longest = 0.0
        self.bound = (bound[0] * (1 + 1e-9), bound[1] * (1 + 1e-9))
        self.tie = bound[0] * (1 - 1e-9)
        self.programs: list[list[Action]] = [[] for _ in range(ranks)]
        # Ranks waiting for an action that is not scheduled yet, keyed by that action.
        self.waiters: dict[Action, list[int]] = {}
        # Per kind and stage, the (kind, stage) of each dependency: the rule asked once
        # (it does not depend on the micro-batch), since _ready is the hot loop.
        self.shapes: dict[Kind, list[list[tuple[Kind, int]]]] = {
            kind: [[(d.kind, d.stage) for d in requires(Action(kind, s, 0), stages)]
                   for s in range(stages)]
            for kind in (F, B, W)
        }  # fmt: skip
        self.free = [0.0] * ranks
        self.first = [math.inf] * ranks  # when each rank's first action starts
        self.wake = [0.0] * ranks
        self.heap = [(0.0, r) for r in range(ranks)]

    def run(self) -> GreedyRun:
        """Let every rank decide whenever it wakes, until none has work left."""
        while self.heap:
            now, rank = heapq.heappop(self.heap)
            if now == self.wake[rank] and self.left[rank]:  # else stale, or finished
                self._decide(rank, now)
        if any(self.left):
            stuck = [r for r, left in enumerate(self.left) if left]
            raise ScheduleError(f"the greedy scheduler stalled on ranks {stuck}")
        busy = [r for r, program in enumerate(self.programs) if program]
        first = min(self.first[r] for r in busy)
        last = max(self.free[r] for r in busy)
        span = max(self.free[r] - self.first[r] for r in busy)
        return GreedyRun(self.programs, last - first, span)

    def _ready(self, kind: Kind, s: int, mb: int, rank: int, now: float) -> float:
        """0 when every dependency of ``kind`` of stage ``s`` on micro-batch ``mb`` has
        reached ``rank`` (plus ``comm`` from another rank) by ``now``, else when the last
        one does; infinity, and ``rank`` registered as a waiter, while one is
        unscheduled."""
        ready_at = 0.0
        for dep_kind, dep_stage in self.shapes[kind][s]:
            end = self.end.get((dep_kind, dep_stage, mb))
            if end is None:
                self.waiters.setdefault(Action(dep_kind, dep_stage, mb), []).append(rank)
                return math.inf
            if self.placement[dep_stage] != rank:
                end += self.comm
            if end > ready_at:
                ready_at = end
        return ready_at if ready_at > now else 0.0

    def _arrived(self, s: int, mb: int, rank: int, now: float) -> bool:
        """Whether every dependency of F of stage ``s`` on micro-batch ``mb`` has reached
        ``rank`` by ``now`` (no waiter is registered)."""
        for dep_kind, dep_stage in self.shapes[F][s]:
            end = self.end.get((dep_kind, dep_stage, mb))
            far = self.placement[dep_stage] != rank
            if end is None or end + (self.comm if far else 0.0) > now:
                return False
        return True

    def _decide(self, rank: int, now: float) -> None:
        """Run the best ready action of ``rank``, or put it to sleep until one can be."""
        best_b: tuple[int, int] | None = None  # (mb, stage): lowest mb, then highest stage
        best_f: tuple[int, int] | None = None
        soonest = math.inf
        limits = self.limits
        # The cap in whole activations; the tolerance absorbs sums of fractional shares.
        fits = self.held[rank] + 1.0 <= limits.caps[rank] + 1e-9
        may_forward = fits and self.ahead[rank] < limits.ahead[rank]
        blocked_f = False  # a ready F that only the cap holds back
        for s in self.own_stages[rank]:
            mb = self.next_b[s]
            if mb < self.next_f[s]:
                at = self._ready(B, s, mb, rank, now)
                if at:
                    soonest = min(soonest, at)
                elif best_b is None or (mb, -s) < (best_b[0], -best_b[1]):
                    best_b = (mb, s)
            mb = self.next_f[s]
            if mb < self.m and may_forward:
                at = self._ready(F, s, mb, rank, now)
                if at:
                    soonest = min(soonest, at)
                elif best_f is None or (mb, -s) < (best_f[0], -best_f[1]):
                    best_f = (mb, s)
            elif mb < self.m and not fits and self._arrived(s, mb, rank, now):
                blocked_f = True
        pending = self.pending_w[rank]
        if best_b is not None:
            self._run(rank, now, Action(B, best_b[1], best_b[0]))
        elif best_f is not None:
            self._run(rank, now, Action(F, best_f[1], best_f[0]))
        elif pending and (
            limits.fill_always
            or blocked_f
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
        finish = now + self.durations[s][_INDEX[kind]]
        self.end[action] = finish
        if kind == F:
            self.next_f[s] += 1
            self.held[rank] += 1
            self.ahead[rank] += 1
        elif kind == B:
            self.next_b[s] += 1
            self.ahead[rank] -= 1
            self.held[rank] -= 1.0 - self.limits.w_memory
            self.pending_w[rank].append((s, mb))
        else:
            self.held[rank] -= self.limits.w_memory
        self.left[rank] -= 1
        self.work[rank] -= self.durations[s][_INDEX[kind]]
        end = finish + self.work[rank]
        self.latest = max(self.latest, end)
        self.longest = max(self.longest, end - min(self.first[rank], now))
        if self.latest > self.bound[0] or (
            self.latest >= self.tie and self.longest > self.bound[1]
        ):
            raise _Beaten
        self.programs[rank].append(action)
        self.first[rank] = min(self.first[rank], now)
        self.free[rank] = self.wake[rank] = finish
        heapq.heappush(self.heap, (finish, rank))
        for other in self.waiters.pop(action, ()):
            # A wait registered before ``other`` got busy again may be stale: never wake
            # a rank before it is free.
            at = max(finish + (self.comm if other != rank else 0.0), self.free[other])
            if at < self.wake[other]:
                self.wake[other] = at
                heapq.heappush(self.heap, (at, other))
