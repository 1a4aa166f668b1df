"""The simulator's fast path: a plain schedule's start and end times, on integer indices.

A plain schedule has no vocabulary passes and is simulated without all-to-all time (its
overlapped pairs, if any, then run one action after the other): each action starts when
its rank is free and its dependencies have ended (plus ``comm`` from another rank),
exactly as :func:`~conveyor.schedules.simulation.simulate` runs it. What depends on the
schedule alone (each action's rank, duration slot, and the one dependency that can come
from another rank) is worked out once per schedule (:func:`plan_of`, kept while the
schedule lives); a simulation is then one pass over plain lists (:func:`run`).

The times are bit for bit the reference's: a start is the largest of the same sums, an
end the same sum, and a dependency on the same rank needs no look: it ran earlier in the
rank's program, so it ended no later than the rank became free. A schedule the plan
cannot take (an action twice or on another rank, a kind or stage out of range, a
dependency missing or later in its rank's program, a deadlock, pairs that deadlock the
walk) has no plan: the reference simulates it and raises what it raises. A plan is
also :func:`~conveyor.schedules.checks.validate`'s proof that such a schedule's ranks
run it (the walk's rule on integer indices), so a validated schedule simulates at once.

Pure Python (no torch import).
"""

from __future__ import annotations

import operator
from array import array
from dataclasses import dataclass
from itertools import chain, repeat

from conveyor.schedules.core import KINDS, Action, Kind, Schedule, requires
from conveyor.schedules.events import Event
from conveyor.schedules.kept import PerSchedule
from conveyor.schedules.order import advance

KIND_SLOT: dict[str, int] = {k: i for i, k in enumerate(KINDS)}
"""An action's kind -> its place in a stage's (F, B, W) durations."""


@dataclass(frozen=True)
class Plan:
    """What a plain schedule's simulation needs of it, in plain arrays.

    Attributes:
        actions: Every action, rank by rank in program order (the events' order).
        bounds: Per rank, the ``(first, past-last)`` indices of its actions in ``actions``.
        owners: Per entry of ``actions``, its rank.
        order: Indices into ``actions`` in an order that puts each action after its
            dependencies (the ranks' programs run together).
        rank: Per entry of ``order``, the action's rank.
        slot: Per entry of ``order``, ``3 * stage + kind`` (its duration's place).
        remote: Per entry of ``order``, the index of the dependency on another rank, or -1.
    """

    actions: tuple[Action, ...]
    bounds: tuple[tuple[int, int], ...]
    owners: array[int]
    order: array[int]
    rank: array[int]
    slot: array[int]
    remote: array[int]


def _make_plan(schedule: Schedule) -> Plan | None:
    """The schedule's plan (None: one the fast path does not take, see the module
    docstring)."""
    if schedule.vocab or len(schedule.actions) != schedule.ranks:
        return None
    if schedule.pairs and any(step is not None for step in advance(schedule)[1]):
        return None  # the pairs deadlock the walk (each waits for both its actions' needs)
    placement, stages = schedule.placement, schedule.stages
    needs = _needs(stages)
    if needs is None:
        return None
    # where[slot][microbatch]: the action's index in the flat order
    where: list[dict[object, int]] = [{} for _ in range(3 * stages)]
    actions = tuple(chain.from_iterable(schedule.actions))
    slots, owners, i = array("q"), array("q"), 0
    for r, program in enumerate(schedule.actions):
        for kind, s, m in program:
            k = KIND_SLOT.get(kind)
            if k is None or not 0 <= s < stages or placement[s] != r:
                return None
            found = where[3 * s + k]
            if m in found:
                return None  # an action twice
            found[m] = i
            slots.append(3 * s + k)
            owners.append(r)
            i += 1
    remote = array("q", [-1]) * len(actions)
    bounds, start = [], 0
    for r, program in enumerate(schedule.actions):
        end = start + len(program)
        bounds.append((start, end))
        for i in range(start, end):
            m = actions[i][2]
            for slot in needs[slots[i]]:
                j = where[slot].get(m)
                if j is None:
                    return None  # never runs: the walk deadlocks
                if placement[slot // 3] != r:
                    remote[i] = j  # (one at most: _needs)
                elif not start <= j < i:
                    return None  # later on its own rank: a deadlock
        start = end
    order = _walk(bounds, remote)
    if order is None:
        return None
    return Plan(
        actions=actions,
        bounds=tuple(bounds),
        owners=owners,
        order=order,
        rank=array("q", [owners[i] for i in order]),
        slot=array("q", [slots[i] for i in order]),
        remote=array("q", [remote[i] for i in order]),
    )


def _needs(stages: int) -> list[tuple[int, ...]] | None:
    """Per slot (``3 * stage + kind``), the slots of the actions it needs, of its own
    micro-batch, as :func:`~conveyor.schedules.core.requires` says (None: a rule this
    plan cannot hold: another micro-batch, or two stages besides its own)."""
    out = []
    for s in range(stages):
        for kind in KINDS:
            got = [requires(Action(kind, s, m), stages) for m in (0, 1)]
            if any(d.microbatch != m for m, deps in enumerate(got) for d in deps):
                return None
            if len({d.stage for d in got[0]} - {s}) > 1:
                return None
            out.append(tuple(3 * d.stage + KIND_SLOT[d.kind] for d in got[0]))
    return out


def _walk(bounds: list[tuple[int, int]], remote: array[int]) -> array[int] | None:
    """Each rank runs its program in order while its remote dependencies are done, round
    robin until every rank is through (None: they stall, a deadlock)."""
    at = [first for first, _ in bounds]
    done = bytearray(len(remote))
    order = array("q")
    moved = True
    while moved:
        moved = False
        for r, (_, end) in enumerate(bounds):
            i = at[r]
            while i < end and (remote[i] < 0 or done[remote[i]]):
                done[i] = 1
                order.append(i)
                i += 1
            if i > at[r]:
                at[r], moved = i, True
    return order if len(order) == len(remote) else None


def run(
    plan: Plan, durations: list[dict[Kind, float]], comm: float
) -> tuple[tuple[Event, ...], float, float, float, float]:
    """The plan simulated: the events (rank by rank, in program order), the busy time
    (the events' lengths summed in that order), the first start, the last end and the
    largest span of a rank, as :func:`~conveyor.schedules.simulation.simulate` gives them.

    Args:
        plan: The schedule's plan.
        durations: Per stage, the duration of its F, B and W actions.
        comm: The latency of a dependency from another rank.
    """
    slots = [d[k] for d in durations for k in KINDS]
    n = len(plan.actions)
    starts, ends = [0.0] * n, [0.0] * n
    free = [0.0] * len(plan.bounds)
    for i, r, slot, j in zip(plan.order, plan.rank, plan.slot, plan.remote, strict=True):
        start = free[r]
        if j >= 0:
            ready = ends[j] + comm
            if ready > start:
                start = ready
        starts[i] = start
        free[r] = ends[i] = start + slots[slot]
    # An action starts no earlier than the one before it on its rank ended: a rank's
    # first start is its least, its last end its greatest.
    active = [(starts[i], ends[j - 1]) for i, j in plan.bounds if j > i]
    first = min((a for a, _ in active), default=0.0)
    last = max((z for _, z in active), default=0.0)
    span = max((z - a for a, z in active), default=0.0)
    rows = zip(plan.owners, plan.actions, starts, ends, strict=True)
    events = tuple(map(tuple.__new__, repeat(Event), rows))  # Event(*row), without __new__
    return events, sum(map(operator.sub, ends, starts)), first, last, span


plan_of = PerSchedule(_make_plan)
"""The schedule's :class:`Plan`, made on first use and kept while the schedule lives
(None: a schedule the fast path does not take, see the module docstring)."""

__all__ = ["KIND_SLOT", "Plan", "plan_of", "run"]
