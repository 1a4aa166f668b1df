"""The one prediction: a step of a schedule from what its units cost (either source).

- **Balance** (:func:`time_balance`, :func:`balanced`): the units are cut into stages by
  exact min-max of their time (F + B + W of one micro-batch), the most even unit counts
  among the optimal cuts; under a memory limit, the fastest cut that fits. The planner
  then refines its cut by simulation (:func:`refine`).
- **Recompute** (:func:`stage_costs`): a recomputing B pays its forward again. conveyor's
  runtime re-runs a stage's forward from its input, except where the B directly follows
  its own F (:func:`recomputed_shares`: the activations are still there); ``"layer"``
  re-runs every decoder layer's forward at every B, ``"selective"`` the attention kernels'.
- **Step**: the schedule simulated (:func:`conveyor.simulate.simulate`) with each stage's
  (F, B, W), the runtime's own cost per F and B, and the transfer time; then the tail
  (:func:`tail`): each rank's gradient reduction, overlapped as the setting says, FSDP's
  gathers, and the optimizer step.
- **Memory** (:mod:`~conveyor.planning.memory`) and **fits**: the largest rank's total
  within the limit.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from conveyor.errors import ConfigError
from conveyor.partition.cuts import balance_within
from conveyor.planning.costs import LAYER, Costs, UnitCost
from conveyor.planning.memory import Setting, rank_memory, state_bytes_of
from conveyor.schedules import Schedule
from conveyor.schedules.core import B, F, W
from conveyor.schedules.kept import PerSchedule
from conveyor.simulate import SimResult, simulate

Cost = tuple[float, float, float]


class Sync(Protocol):
    """The seconds of what a rank does for its gradients and its optimizer: a source
    that knows the links (:mod:`~conveyor.planning.counted`) gives them."""

    def reduce(self, units: Sequence[UnitCost]) -> float:
        """One stage's gradient reduction among its replicas."""
        ...

    def gather(self, units: Sequence[UnitCost]) -> float:
        """FSDP's gather of one stage's weights (0 without FSDP)."""
        ...

    def update(self, units: Sequence[UnitCost]) -> float:
        """The optimizer step on a rank's parameters (after any sharding), and the
        distributed optimizer's gather of the updated weights."""
        ...


@dataclass(frozen=True)
class Prediction:
    """One schedule of one model, predicted.

    Attributes:
        schedule: What runs.
        balance: Units per stage.
        costs: Per stage, the (F, B, W) simulated: overhead and recompute included.
        sim: The simulation.
        memory: Per rank, bytes by kind (:data:`~conveyor.planning.memory.KINDS`).
        tail: Seconds after the pipeline: exposed gradient reduction and gathers, and
            the optimizer step.
    """

    schedule: Schedule
    balance: tuple[int, ...]
    costs: tuple[Cost, ...]
    sim: SimResult
    memory: tuple[dict[str, float], ...]
    tail: float

    @property
    def step(self) -> float:
        """Seconds per training step."""
        return self.sim.makespan + self.tail

    @property
    def peak(self) -> tuple[float, ...]:
        """Per rank, its memory in all, bytes."""
        return tuple(sum(m.values()) for m in self.memory)

    def fits(self, limit: float | None) -> bool:
        """Whether every rank's memory is within ``limit`` bytes (None: no limit)."""
        return fits(self.peak, limit)


def fits(peaks: Sequence[float], limit: float | None) -> bool:
    """The one "fits": the largest rank within ``limit`` (None: no limit)."""
    return limit is None or max(peaks) <= limit


def time_balance(times: Sequence[float], stages: int) -> list[int]:
    """Units per stage for contiguous stages that minimise the slowest stage's time, every
    stage at least one unit; among the optimal cuts, unit counts as even as they go.

    Exact: the smallest feasible bound is found by bisection (a bound is feasible when
    packing units greedily needs at most ``stages`` stages), then each stage takes the
    count closest to an even share that keeps the rest feasible.

    Raises:
        ConfigError: Fewer units than stages, or a negative time.
    """
    n = len(times)
    if stages < 1 or n < stages:
        raise ConfigError(
            f"cannot split {n} units into {stages} stages; use at most {n} stages or split "
            "the model into more units"
        )
    if any(t < 0 for t in times):
        raise ConfigError("unit times must be >= 0")
    prefix = list(itertools.accumulate(times, initial=0.0))
    lo, hi = max(times), prefix[-1]
    for _ in range(100):
        if hi - lo <= 1e-12 * hi:
            break
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _needs(prefix, mid)[0] <= stages else (mid, hi)
    bound = hi * (1 + 1e-12)
    need = _needs(prefix, bound)
    sizes, start = [], 0
    for left in range(stages, 0, -1):
        rest = n - start
        most = min(bisect.bisect_right(prefix, prefix[start] + bound) - 1 - start, rest - left + 1)
        least = next(s for s in range(1, most + 1) if need[start + s] <= left - 1)
        size = min(max(round(rest / left), least), most)
        sizes.append(size)
        start += size
    return sizes


def _needs(prefix: Sequence[float], bound: float) -> list[int]:
    """Per start index, the stages a greedy packing under ``bound`` needs for the units
    from there on (a huge number where one unit alone exceeds it)."""
    n = len(prefix) - 1
    need = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        j = bisect.bisect_right(prefix, prefix[i] + bound) - 1
        need[i] = n + 1 if j <= i else 1 + need[j]
    return need


def recomputed_shares(schedule: Schedule) -> list[float]:
    """Per stage, the share of its micro-batches whose B re-runs the forward under
    conveyor's recompute: all but those whose B directly follows their F on the rank (the
    runtime keeps those activations; ``RankProgram.adjacent``)."""
    kept = [0] * schedule.stages
    for actions in schedule.actions:
        for a, b in itertools.pairwise(actions):
            if a.kind == F and b.kind == B and (a.stage, a.microbatch) == (b.stage, b.microbatch):
                kept[a.stage] += 1
    return [1.0 - k / schedule.microbatches for k in kept]


shares_of = PerSchedule(recomputed_shares)
""":func:`recomputed_shares`, worked out once per schedule and kept while it lives."""


def stage_costs(
    schedule: Schedule, costs: Costs, balance: Sequence[int], recompute: bool | str = False
) -> list[Cost]:
    """Per stage, the (F, B, W) the simulator runs: the units' times, the runtime's cost
    per F and B, and what a recomputing B runs again (see the module docstring)."""
    split = schedule.split_backward
    plain = costs.costs(balance, split)
    shares = shares_of(schedule) if recompute is True else [0.0] * schedule.stages
    send = costs.comm(balance) if costs.blocking else 0.0
    last = schedule.stages - 1
    out = []
    for s, ((f, b, w), units, share) in enumerate(
        zip(plain, costs.parts(balance), shares, strict=True)
    ):
        again = f * share
        if recompute == "layer":
            again = sum(u.forward if split else u.forward_plain for u in units if u.kind == LAYER)
        elif recompute == "selective":
            again = sum(u.attention for u in units if u.kind == LAYER)
        f += costs.overhead + (send if s < last else 0.0)
        b += costs.overhead + again + (send if s > 0 else 0.0)
        out.append((f, b, w))
    return out


def simulated(
    schedule: Schedule, costs: Costs, balance: Sequence[int], recompute: bool | str = False
) -> SimResult:
    """The schedule simulated on :func:`stage_costs` and the slowest transfer."""
    return simulate(schedule, stage_costs(schedule, costs, balance, recompute), costs.comm(balance))


def tail(
    sim: SimResult, costs: Costs, balance: Sequence[int], setting: Setting, sync: Sync | None
) -> float:
    """Seconds the step lasts beyond the simulated pipeline.

    Per rank: the gradient reduction of each of its stages, one after another on its
    link, starting when the stage's last backward has ended (``dp_overlap="stage"``),
    when it begins (``"backward"``: the reduction runs beside it) or when the rank is done
    (``"none"``); with ``fsdp=True`` the gathers before the rank's first forward, hidden
    behind it as far as it lasts; then the optimizer step. The step ends when the last
    rank does.
    """
    if sync is None:
        return 0.0
    schedule = sim.schedule
    parts = costs.parts(balance)
    last = W if schedule.split_backward else B
    finish, start = 0.0, 0
    for rank, program in enumerate(schedule.actions):
        events = sim.events[start : start + len(program)]  # this rank's, in program order
        start += len(program)
        if not events:
            continue
        busy = events[-1].end
        first_f = next((e.end - e.start for e in events if e.action.kind == F), 0.0)
        ends: dict[int, tuple[float, float]] = {}  # stage -> (end, start) of its last backward
        stages = schedule.stages_of(rank)
        for e in reversed(events):
            if e.action.kind == last and e.action.stage not in ends:
                ends[e.action.stage] = (e.end, e.start)
                if len(ends) == len(stages):
                    break
        clock = 0.0
        for s in sorted(stages, key=lambda s: ends[s][0]):
            end, begin = ends[s]
            when = {"stage": end, "backward": begin, "none": busy}[setting.dp_overlap]
            clock = max(clock, when) + sync.reduce(parts[s])
            clock = max(clock, end)
        gathers = sum(sync.gather(parts[s]) for s in stages)
        early = max(0.0, gathers - first_f)
        mine = [u for s in stages for u in parts[s]]
        finish = max(finish, max(busy, clock) + early + sync.update(mine))
    return max(0.0, finish - sim.makespan)


def predict(
    schedule: Schedule,
    costs: Costs,
    balance: Sequence[int],
    setting: Setting,
    sync: Sync | None = None,
    cache: dict[object, SimResult] | None = None,
) -> Prediction:
    """``schedule`` on ``costs`` cut by ``balance``: simulated, its tail and its memory.
    ``cache`` keeps simulations by schedule and stage costs, for a caller that predicts
    many layouts alike (FSDP or not changes no stage's time)."""
    per_stage = stage_costs(schedule, costs, balance, setting.recompute)
    comm = costs.comm(balance)
    key = (id(schedule), tuple(per_stage), comm)
    sim = cache.get(key) if cache is not None else None
    if sim is None:
        sim = simulate(schedule, per_stage, comm)
        if cache is not None:
            cache[key] = sim
    return Prediction(
        schedule=schedule,
        balance=tuple(balance),
        costs=tuple(per_stage),
        sim=sim,
        memory=tuple(rank_memory(schedule, costs, balance, setting)),
        tail=tail(sim, costs, balance, setting, sync),
    )


def peaks(
    schedule: Schedule, costs: Costs, balance: Sequence[int], setting: Setting
) -> list[float]:
    """Per rank, its memory in all (bytes), as :class:`Prediction` counts it."""
    return [sum(m.values()) for m in rank_memory(schedule, costs, balance, setting)]


def balanced(schedule: Schedule, costs: Costs, limit: float | None, setting: Setting) -> list[int]:
    """The time balance, or under ``limit`` the fastest cut whose stages fit it.

    The limit is applied per stage (a unit's state and activations times the most
    micro-batches its stage holds); a rank of several stages that still exceeds it gives
    each stage an equal share of it. Where that finds no cut (or under recompute, whose
    bytes do not add up per unit), units move across the cuts until one fits or the
    largest need stops falling (:func:`_shrunk`).

    Raises:
        ConfigError: The schedule has more stages than there are units.
    """
    times = costs.times(schedule.split_backward)
    stages = schedule.stages
    start = time_balance(times, stages)
    if limit is None or fits(peaks(schedule, costs, start, setting), limit):
        return start
    if not setting.recompute:  # per-unit bytes add up only without recompute
        memory = _unit_memory(schedule, costs, setting)
        for share in (limit, limit / schedule.chunks):
            try:
                cut = balance_within(times, stages, memory, share)
            except ConfigError:
                continue
            if fits(peaks(schedule, costs, cut, setting), limit):
                return cut
    return _shrunk(schedule, costs, start, limit, setting)


def _shrunk(
    schedule: Schedule, costs: Costs, cut: Sequence[int], limit: float, setting: Setting
) -> list[int]:
    """``cut`` with single units moved across stage boundaries, each time where the largest
    rank's need falls most, until it fits ``limit`` or no move lowers it: the cut that
    fits where the per-unit sums cannot say (a recomputing stage keeps its input per
    micro-batch in flight and one micro-batch's activations), else the least need found,
    which is what a "nothing fits" error names."""
    best = list(cut)
    need = max(peaks(schedule, costs, best, setting))
    while need > limit:
        moves = []
        for k in range(len(best) - 1):
            for d in (-1, 1):
                moved = list(best)
                moved[k] += d
                moved[k + 1] -= d
                if min(moved) >= 1:
                    moves.append((max(peaks(schedule, costs, moved, setting)), moved))
        least = min(moves, default=None)
        if least is None or least[0] >= need:
            break
        need, best = least
    return best


def _unit_memory(schedule: Schedule, costs: Costs, setting: Setting) -> list[list[float]]:
    """memory[s][i]: the bytes unit i needs on stage s (for ``balance_within``)."""
    release = W if schedule.split_backward else B
    held = [0] * schedule.stages
    most = [0] * schedule.stages
    for program in schedule.actions:
        for a in program:
            if a.kind == F:
                held[a.stage] += 1
                most[a.stage] = max(most[a.stage], held[a.stage])
            elif a.kind == release:
                held[a.stage] -= 1
    state = [sum(state_bytes_of([u], setting).values()) for u in costs.layers]
    return [
        [s + u.activations * most[k] for s, u in zip(state, costs.layers, strict=True)]
        for k in range(schedule.stages)
    ]


def refine(
    schedule: Schedule,
    costs: Costs,
    balance: Sequence[int],
    limit: float | None,
    setting: Setting,
) -> list[int]:
    """Move single units across stage boundaries while the simulated step gets shorter
    and every rank stays within ``limit``: fixes what per-stage min-max misses, such as
    a schedule that idles some stages more than others. Never slower than ``balance``."""
    best = list(balance)
    best_time = simulated(schedule, costs, best, setting.recompute).makespan
    for _ in range(4 * len(best)):
        improved = False
        for k in range(len(best) - 1):
            for d in (-1, 1):
                cand = list(best)
                cand[k] += d
                cand[k + 1] -= d
                if min(cand) < 1:
                    continue
                if limit is not None and not fits(peaks(schedule, costs, cand, setting), limit):
                    continue
                t = simulated(schedule, costs, cand, setting.recompute).makespan
                if t < best_time * (1 - 1e-6):
                    best, best_time, improved = cand, t, True
        if not improved:
            break
    return best


__all__ = [
    "Prediction",
    "Sync",
    "balanced",
    "fits",
    "peaks",
    "predict",
    "recomputed_shares",
    "refine",
    "shares_of",
    "simulated",
    "stage_costs",
    "tail",
    "time_balance",
]
