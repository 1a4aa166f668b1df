"""When each unit of a step runs in lock-step time, and who posts its receives ahead.

The ticks of :mod:`~conveyor.runtime.program`'s rules 1, 5 and 6 (every action one more
than the largest of its rank's previous tick and its producer's; an overlapped pair one
tick; a pass one tick of every rank) and rule 7's choice of the ranks that post their
receives ahead of their compute. Pure Python; the rules and why they cannot deadlock are
in :mod:`~conveyor.runtime.program`'s doc.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from conveyor.schedules import Action, B, F, Schedule
from conveyor.schedules.core import Pass, requires
from conveyor.schedules.order import Compute, walk


class Layout(NamedTuple):
    """A step's computes, each with its tick (``units``, in the walk's order), and the pass
    run at each tick that holds one (``passes``)."""

    units: list[tuple[int, Compute]]
    passes: dict[int, Pass]


def producer_of(action: Action, stages: int) -> Action | None:
    """The action whose result ``action`` consumes from another stage: F takes the
    previous stage's F output, B the next stage's input gradient; None for the first F,
    the last stage's B, and W (the dependency of
    :func:`~conveyor.schedules.core.requires` that lies on another stage)."""
    for dependency in requires(action, stages):
        if dependency.stage != action.stage:
            return dependency
    return None


def consumer_stage(producer: Action, stages: int) -> int | None:
    """The stage that consumes ``producer``'s result, or None if nothing is passed on
    (the neighbouring stage whose action of the same kind and micro-batch it produces
    for: :func:`producer_of` inverted)."""
    for stage in (producer.stage + 1, producer.stage - 1):
        if 0 <= stage < stages:
            consumer = Action(producer.kind, stage, producer.microbatch)
            if producer_of(consumer, stages) == producer:
                return stage
    return None


def runs(step: Pass, train: bool, forward_passes: Collection[str]) -> bool:
    """Whether a step of this mode runs ``step``: a training step every pass, a
    forward-only one (eval, predict) those whose kind the stage ends list in
    ``forward_passes``."""
    return train or step.kind in forward_passes


def lay_out(
    schedule: Schedule, train: bool, pairs: bool, forward_passes: Collection[str] = ()
) -> Layout:
    """The computes of the mode, each with its tick (rule 1; a pair is one unit only with
    ``pairs`` in training, rule 5), and the pass the mode runs at each of its ticks
    (rule 6: a pass is one tick of every rank, after every rank's earlier ticks;
    ``forward_passes``: the kinds a forward-only step runs)."""
    last_tick = [-1] * schedule.ranks
    at: dict[Action, int] = {}
    units: list[tuple[int, Compute]] = []
    passes: dict[int, Pass] = {}
    for step in walk(schedule):
        if not isinstance(step, Compute):
            if runs(step, train, forward_passes):
                tick = max(last_tick) + 1
                passes[tick] = step
                last_tick = [tick] * schedule.ranks
            continue
        rank = step.rank
        if not train:  # a forward-only step runs the forwards alone
            split = [Compute(rank, a) for a in step.actions if a.kind == F]
        elif pairs or step.paired is None:
            split = [step]
        else:
            split = [Compute(rank, a) for a in step.actions]
        for unit in split:
            tick = last_tick[rank]
            for a in unit.actions:
                producer = producer_of(a, schedule.stages)
                tick = max(tick, at[producer] if producer is not None else -1)
            tick += 1
            for a in unit.actions:
                at[a] = tick
            units.append((tick, unit))
            last_tick[rank] = tick
    return Layout(units, passes)


def ticks(
    schedule: Schedule,
    train: bool = True,
    pairs: bool = False,
    forward_passes: Collection[str] = (),
) -> dict[Action, int]:
    """The lock-step tick of every action (forward actions only unless ``train``); with
    ``pairs`` (training only), both actions of an overlapped pair share one tick, after
    the producers of both."""
    units = lay_out(schedule, train, pairs, forward_passes).units
    return {a: tick for tick, unit in units for a in unit.actions}


def _cost(action: Action, split_backward: bool) -> int:
    """An action's expected duration in units of F (rule 7's estimate)."""
    return 2 if action.kind == B and not split_backward else 1


def ahead_ranks(
    schedule: Schedule,
    train: bool = True,
    pairs: bool = False,
    forward_passes: Collection[str] = (),
) -> dict[int, frozenset[int]]:
    """Per tick, the ranks that send and receive at that tick and post their receives
    ahead of the compute (rule 7): those whose action is expected to end no earlier than
    every action producing what they receive (latest first, then the longer action, then
    the lower rank), leaving out a rank that sends to or receives from one already
    chosen."""
    return choose_ahead(schedule, lay_out(schedule, train, pairs, forward_passes))


def choose_ahead(schedule: Schedule, layout: Layout) -> dict[int, frozenset[int]]:
    """:func:`ahead_ranks` from the ticks :func:`lay_out` gave (a rank's program has them)."""
    placement, stages, split = schedule.placement, schedule.stages, schedule.split_backward
    units = layout.units
    at = {a: tick for tick, unit in units for a in unit.actions}
    end: dict[Action, float] = {}
    free = [0.0] * schedule.ranks
    pending = sorted(layout.passes)
    finish: dict[int, dict[int, float]] = {}  # tick -> rank -> expected end of its action
    spent: dict[int, dict[int, int]] = {}  # tick -> rank -> that action's expected duration
    links: dict[int, set[tuple[int, int]]] = {}  # tick -> (src, dst) of messages sent then
    for tick, unit in sorted(units, key=lambda u: u[0]):
        while pending and pending[0] < tick:  # a pass: every rank waits for every other
            free = [max(free)] * schedule.ranks
            pending.pop(0)
        start = free[unit.rank]
        for action in unit.actions:
            producer = producer_of(action, stages)
            if producer is None:
                continue
            start = max(start, end[producer])
            src = placement[producer.stage]
            if src != unit.rank:
                links.setdefault(at[producer], set()).add((src, unit.rank))
        cost = sum(_cost(a, split) for a in unit.actions)
        done = start + cost
        for action in unit.actions:
            end[action] = done
        free[unit.rank] = done
        finish.setdefault(tick, {})[unit.rank] = done
        spent.setdefault(tick, {})[unit.rank] = cost
    out: dict[int, frozenset[int]] = {}
    for tick, sent in links.items():
        ends, costs = finish[tick], spent[tick]
        chosen: set[int] = set()
        receivers = {dst for _, dst in sent}
        for rank in sorted(receivers, key=lambda r: (-ends.get(r, 0.0), -costs.get(r, 0), r)):
            srcs = {src for src, dst in sent if dst == rank}
            dsts = {dst for src, dst in sent if src == rank}
            # Receives alone are posted ahead by rule 3 already.
            if not dsts or srcs & chosen or dsts & chosen:
                continue
            if all(ends[rank] >= ends[src] for src in srcs):
                chosen.add(rank)
        if chosen:
            out[tick] = frozenset(chosen)
    return out
