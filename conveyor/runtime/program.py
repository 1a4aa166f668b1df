"""What one rank does in a step, in which order: compute, receive, send. Pure Python.

The runtime never decides when to post a transfer; it walks a :class:`RankProgram` built
here from the :class:`~conveyor.schedules.Schedule`. The posting discipline is what makes
the same program correct under NCCL, which matches messages by order alone, runs the
operations between two ranks on one stream in posting order, lets a receive hold its
stream until its data arrives and may hold a send until the peer's receive runs:

1. Every action gets a **tick**: one more than the largest of its rank's previous
   action's tick and its producer's tick (the earliest lock-step time it can run).
2. At tick ``t`` a rank first computes its action of tick ``t`` (if any), then posts
   **one group** (``batch_isend_irecv``) holding the send of that action's output and
   the receives of every message its peers send at tick ``t``. When some value's
   description (shapes, dtypes) is new, a group of descriptions goes first, and the
   receivers wait for it before posting the tensors.
3. A rank waits for a receive right before the action that consumes it, whose tick is
   larger than the tick the receive was posted at.
4. Once a rank knows every value's description (a step with the same input shapes ran
   before: ``join=True``), a group of receives alone joins the group the rank posts just
   before it (nothing is posted between the two) when that group receives nothing
   itself: one ``batch_isend_irecv`` fewer, the same posting order. (A new description
   is waited for when its receive is posted, which must not happen before the tick the
   sender sends it at; and NCCL answers a group with one work, so waiting for an earlier
   receive of the group would wait for the joined ones too.)

Why this cannot deadlock, under either stream model (one stream per rank pair, or one
per rank) and whether sends block or are buffered: order all groups by (tick, phase).
Each operation's counterpart sits in the peer's group of the same (tick, phase), and each
rank posts its groups in increasing order. Suppose every group before (t, k) completes.
Then each rank computes its tick-``t`` action (its inputs came at earlier ticks), so it
posts its (t, k) group; the operations on its streams ahead of that group all belong to
earlier groups, which have completed. So every (t, k) group reaches the head of its
streams, where all its counterparts are too, and completes. A group that rule 4 joined
holds operations of two (tick, phase) positions; NCCL progresses the operations of a
group together, so each completes when its counterpart is posted, and the argument
holds operation by operation: the later receives' senders need nothing this rank posts
after the joined group. Collectives (data parallel,
FSDP, tensor parallel, tied weights) are posted at the same point of the same program by
every member of their group, so they extend the same order. ``tests/parallel/test_nccl.py``
replays what each rank really posts under these rules for every schedule and layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass

from conveyor.schedules import Action, B, F, Schedule, execution_order


@dataclass(frozen=True)
class Message:
    """A value crossing ranks: ``producer``'s output (F) or input gradient (B), sent
    from pipeline rank ``src`` to ``dst``."""

    producer: Action
    src: int
    dst: int


@dataclass(frozen=True)
class Tick:
    """One tick of one rank: compute ``action`` (None: idle), then post ``sends`` and
    ``recvs`` as one group. ``rank`` is whose action it is (in the one-process world one
    program holds every rank's actions). (A "step" is a whole training step; a program
    is the step's ticks.)"""

    tick: int
    rank: int
    action: Action | None
    sends: tuple[Message, ...] = ()
    recvs: tuple[Message, ...] = ()


@dataclass(frozen=True)
class RankProgram:
    """Everything a process does in one step of one mode, in order.

    ``first`` / ``final``: per stage held here, the index in ``ticks`` of its first and of
    its last action (FSDP gathers before the first and reduces after the last).
    ``adjacent``: (stage, micro-batch) whose B directly follows its F (recomputing its
    forward would free nothing). ``train``: a training step's program (else forward only).
    """

    ticks: tuple[Tick, ...]
    first: dict[int, int]
    final: dict[int, int]
    adjacent: frozenset[tuple[int, int]]
    train: bool = True

    @functools.cached_property
    def last_group(self) -> int:
        """The index in ``ticks`` of the last tick that posts transfers (-1: none)."""
        return max((i for i, t in enumerate(self.ticks) if t.sends or t.recvs), default=-1)

    @functools.cached_property
    def opening(self) -> dict[Action, int]:
        """Each stage's first action here, and that stage (FSDP gathers before it)."""
        return {self._action(i): s for s, i in self.first.items()}

    @functools.cached_property
    def closing(self) -> dict[Action, int]:
        """Each stage's last action here, and that stage (its gradients are final after
        it in a training step: reductions start)."""
        return {self._action(i): s for s, i in self.final.items()}

    def _action(self, index: int) -> Action:
        action = self.ticks[index].action
        assert action is not None
        return action

    @property
    def actions(self) -> list[Action]:
        """The actions in the order they run."""
        return [t.action for t in self.ticks if t.action is not None]


def producer_of(action: Action, stages: int) -> Action | None:
    """The action whose result ``action`` consumes from another stage: F takes the
    previous stage's F output, B the next stage's input gradient; None for the first F,
    the last stage's B, and W."""
    if action.kind == F and action.stage > 0:
        return Action(F, action.stage - 1, action.microbatch)
    if action.kind == B and action.stage < stages - 1:
        return Action(B, action.stage + 1, action.microbatch)
    return None


def consumer_stage(producer: Action, stages: int) -> int | None:
    """The stage that consumes ``producer``'s result, or None if nothing is passed on."""
    if producer.kind == F and producer.stage < stages - 1:
        return producer.stage + 1
    if producer.kind == B and producer.stage > 0:
        return producer.stage - 1
    return None


def ticks(schedule: Schedule, train: bool = True) -> dict[Action, int]:
    """The lock-step tick of every action (forward actions only unless ``train``)."""
    last_tick = [-1] * schedule.ranks
    out: dict[Action, int] = {}
    for rank, action in execution_order(schedule):
        if not train and action.kind != F:
            continue
        producer = producer_of(action, schedule.stages)
        after = out[producer] if producer is not None else -1
        tick = max(last_tick[rank], after) + 1
        out[action] = last_tick[rank] = tick
    return out


def rank_program(
    schedule: Schedule, rank: int, train: bool = True, join: bool = False
) -> RankProgram:
    """Pipeline rank ``rank``'s program when each rank is its own process; ``join``:
    receives alone join the group before them (rule 4; only once every description is
    known)."""
    at = ticks(schedule, train)
    placement, stages = schedule.placement, schedule.stages
    mine: dict[int, Action] = {}
    incoming: dict[int, list[Message]] = {}
    outgoing: dict[int, Message] = {}
    for action, tick in at.items():
        src = placement[action.stage]
        consumer = consumer_stage(action, stages)
        dst = placement[consumer] if consumer is not None else src
        if src == rank:
            mine[tick] = action
        if src == dst or rank not in (src, dst):
            continue
        message = Message(action, src, dst)
        if src == rank:
            outgoing[tick] = message
        else:
            incoming.setdefault(tick, []).append(message)
    timeline: list[Tick] = []
    for tick in sorted(mine.keys() | incoming.keys()):
        sent = outgoing.get(tick)
        # Receives in peer order: the group's layout is the same on every run.
        recvs = tuple(sorted(incoming.get(tick, []), key=lambda m: m.src))
        before = timeline[-1] if timeline else None
        if join and not sent and recvs and before and before.sends and not before.recvs:
            joined = timeline[-1]  # rule 4: the receives join the group posted before them
            timeline[-1] = dataclasses.replace(joined, recvs=joined.recvs + recvs)
            recvs = ()
        timeline.append(Tick(tick, rank, mine.get(tick), (sent,) if sent else (), recvs))
    return _finish(timeline, train)


def single_process_program(schedule: Schedule, train: bool = True) -> RankProgram:
    """Every rank's actions in one valid order, for the world of one process (every
    value is handed over in memory)."""
    timeline = [
        Tick(i, rank, action)
        for i, (rank, action) in enumerate(execution_order(schedule))
        if train or action.kind == F
    ]
    return _finish(timeline, train)


def _finish(timeline: Iterable[Tick], train: bool) -> RankProgram:
    in_order = tuple(timeline)
    first: dict[int, int] = {}
    final: dict[int, int] = {}
    previous: Action | None = None
    adjacent = set()
    for i, tick in enumerate(in_order):
        a = tick.action
        if a is None:
            continue
        first.setdefault(a.stage, i)
        final[a.stage] = i
        if (
            previous is not None
            and previous.kind == F
            and a.kind == B
            and (previous.stage, previous.microbatch) == (a.stage, a.microbatch)
        ):
            adjacent.add((a.stage, a.microbatch))
        previous = a
    return RankProgram(in_order, first, final, frozenset(adjacent), train)
