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
   larger than the tick the receive was posted at. A group of receives alone is posted
   **ahead** of the tick's compute (phase -1 of the tick): the data arrives while the rank
   computes, and gloo, which moves a message only once its receive is posted, does not
   add a round trip to the wait.
4. Once a rank knows every value's description (a step with the same input shapes ran
   before: ``join=True``), a group of receives it would post ahead (rules 3 and 7) joins
   the last group the rank posted when that group receives nothing itself and nothing
   was posted after it (no group and no pass: the ticks between only compute): one
   ``batch_isend_irecv`` fewer, the receives up earlier, the same order of groups. (A new
   description is waited for when its receive is posted, which must not happen before
   the tick the sender sends it at; and NCCL answers a group with one work, so waiting
   for an earlier receive of the group would wait for the joined ones too.)
5. An overlapped pair of the schedule (an F and a B of another micro-batch, run
   interleaved at their expert all-to-alls) is one tick: one more than the largest of the
   rank's previous tick and both producers' ticks. Both inputs are waited for before the
   pair starts and both outputs are sent in the tick's one group (two messages to one
   peer are listed in the same order by both ends). The pairs a schedule marks are those
   its programs run deadlock-free as units (:func:`~conveyor.schedules.paired`), so the
   ticks exist; the all-to-alls inside a pair are posted in an order fixed by the
   programs (:mod:`~conveyor.runtime.overlap`), the same on every rank of the ep group.
6. A pass of the stage ends (a :class:`~conveyor.schedules.core.Pass` of the schedule's
   walk, :func:`~conveyor.schedules.order.walk`, that no rank's stage computes) is a tick
   of every rank: one more than the largest tick any rank reached before it (its slot).
   It computes no action and posts no point-to-point group; its collectives go, in a
   fixed order, to a group of their own over the pipeline ranks. A training step runs
   every pass, a forward-only step (eval, predict) those of the kinds the stage ends name
   (:attr:`~conveyor.runtime.ends.StageEnds.forward_passes`).
7. Once every value's description is known (``join=True``), a rank that sends and
   receives at tick ``t`` posts its tick-``t`` receives ahead too, as a group of its own,
   and its sends after the compute, when its action is expected to end no earlier than
   those of the ranks it receives from (an estimate from the schedule: F 1, B 1, or 2
   when B is the whole backward, W 1; latest first, then the longer action, then the
   lower rank); those ranks never post ahead at ``t`` themselves
   (:func:`~conveyor.runtime.lockstep.ahead_ranks`).
   A rank whose data arrives before it is ready gains nothing from posting early, and
   two ranks that receive ahead from each other would deadlock under NCCL: each one's
   receive holds its stream until the other's send, which comes after it.

Why this cannot deadlock, under either stream model (one stream per rank pair, or one
per rank) and whether sends block or are buffered: order all groups by (tick, phase).
Groups posted ahead (rules 3 and 7) are phase -1 of their tick: they hold receives only,
whose senders post the sends in their phase-0 group of the same tick, after computing. A
sender with a phase -1 group of its own at that tick (rule 7; rule 3's receive and send
nothing at it) receives in it only from ranks without one. So once every group before
tick ``t`` completes, the ranks without a phase -1 group compute and post their tick-``t``
groups, needing nothing of tick ``t``; those reach the heads of their streams and
complete the rule-7 groups, whose ranks then post their sends, which complete rule 3's.
What follows is the argument for phase 0.
Each operation's counterpart sits in the peer's group of the same (tick, phase), and each
rank posts its groups in increasing order. Suppose every group before (t, k) completes.
Then each rank computes its tick-``t`` action (its inputs came at earlier ticks), so it
posts its (t, k) group; the operations on its streams ahead of that group all belong to
earlier groups, which have completed. So every (t, k) group reaches the head of its
streams, where all its counterparts are too, and completes. A group that rule 4 joined
holds operations of two (tick, phase) positions; NCCL progresses the operations of a
group together, so each completes when its counterpart is posted, and the argument
holds operation by operation: the later receives' senders need nothing this rank posts
after the joined group (it posts nothing until their tick; a rule-7 rank's sends of
that tick go to a sender's phase-0 group, whose own send completes the joined receive
first, as in the phase -1 argument above). A pair's tick is an ordinary tick with two
actions: each rank computes it once both inputs arrived at earlier ticks, then posts its
group. A pass's tick
holds collectives only, at one (tick, phase) of every rank: every rank posts them once
its earlier groups are posted, and their inputs (the last stage's output, stage 0's input
gradient) were computed at earlier ticks, so they complete too; no rank sends or receives
at a pass's tick (every rank's tick there is the pass). Collectives
(data parallel, FSDP, tensor parallel, tied weights) are posted at the same point of the
same program by every member of their group, so they extend the same order.
``tests/parallel/test_nccl.py`` replays what each rank really posts under these rules for
every schedule and layout. The ticks themselves (rules 1, 5, 6) and rule 7's choice are
:mod:`~conveyor.runtime.lockstep`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from conveyor.runtime.lockstep import (
    ahead_ranks,
    choose_ahead,
    consumer_stage,
    lay_out,
    producer_of,
    runs,
    ticks,
)
from conveyor.schedules import Action, B, F, Schedule, W
from conveyor.schedules.core import Pass
from conveyor.schedules.order import Compute, walk

__all__ = [
    "Message",
    "RankProgram",
    "Tick",
    "ahead_ranks",
    "consumer_stage",
    "producer_of",
    "rank_program",
    "single_process_program",
    "ticks",
]


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
    program holds every rank's actions). ``paired``: a B computed interleaved with
    ``action`` (an F) at their all-to-alls (an overlapped pair of the schedule); both
    outputs are sent in the tick's group. ``boundary``: a pass of the stage ends every
    rank runs at this tick (then nothing else is). ``ahead``: ``recvs`` are posted before
    the compute, as a group of their own, and ``sends`` after it (rules 3 and 7). (A
    "step" is a whole training step; a program is the step's ticks.)"""

    tick: int
    rank: int
    action: Action | None
    sends: tuple[Message, ...] = ()
    recvs: tuple[Message, ...] = ()
    paired: Action | None = None
    boundary: Pass | None = None
    ahead: bool = False

    @property
    def computed(self) -> tuple[Action, ...]:
        """The tick's actions: none, its action, or the pair."""
        if self.action is None:
            return ()
        return (self.action,) if self.paired is None else (self.action, self.paired)


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
        """The action at ``index`` (of a pair: the later one, which ends the pair)."""
        computed = self.ticks[index].computed
        assert computed
        return computed[-1]

    @functools.cached_property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """The ticks as the runtime runs them, each ``(start, stop)`` of ``ticks``: one
        tick, or consecutive W of one stage, run as one (a GEMM per weight, not per W)."""
        out: list[tuple[int, int]] = []
        for i, tick in enumerate(self.ticks):
            a, first = tick.action, self.ticks[out[-1][0]].action if out else None
            if a and first and a.kind == first.kind == W and a.stage == first.stage:
                out[-1] = (out[-1][0], i + 1)
            else:
                out.append((i, i + 1))
        return tuple(out)

    @property
    def actions(self) -> list[Action]:
        """The actions in the order they run (a pair's F first)."""
        return [a for t in self.ticks for a in t.computed]


def rank_program(
    schedule: Schedule,
    rank: int,
    train: bool = True,
    join: bool = False,
    pairs: bool = False,
    forward_passes: Collection[str] = (),
) -> RankProgram:
    """Pipeline rank ``rank``'s program when each rank is its own process; ``join``:
    ranks chosen by rule 7 receive ahead, and receives that go ahead join the last group
    posted (rule 4; only once every description is known); ``pairs``: the schedule's
    overlapped pairs run as one tick (rule 5); ``forward_passes``: the kinds of pass a
    forward-only step runs (rule 6)."""
    layout = lay_out(schedule, train, pairs, forward_passes)
    units, passes = layout
    placement, stages = schedule.placement, schedule.stages
    at = {a: tick for tick, unit in units for a in unit.actions}
    mine: dict[int, Compute] = {}
    incoming: dict[int, list[Message]] = {}
    outgoing: dict[int, list[Message]] = {}
    for tick, unit in units:
        if unit.rank == rank:
            mine[tick] = unit
        for action in unit.actions:
            # A message goes from a producer on another rank, at the producer's tick.
            producer = producer_of(action, stages)
            if producer is None:
                continue
            src, dst = placement[producer.stage], unit.rank
            if src == dst or rank not in (src, dst):
                continue
            message = Message(producer, src, dst)
            sent = at[producer]
            if src == rank:
                outgoing.setdefault(sent, []).append(message)
            else:
                incoming.setdefault(sent, []).append(message)
    ahead = choose_ahead(schedule, layout) if join else {}
    timeline: list[Tick] = []
    last = -1  # the index in timeline of the last group posted (-1: none, or a pass since)
    for tick in sorted(mine.keys() | incoming.keys() | passes.keys()):
        if tick in passes:
            timeline.append(Tick(tick, rank, None, boundary=passes[tick]))
            last = -1  # its collectives are posted: nothing joins a group across them
            continue
        # Sends by producer, receives by peer then producer: both ends of a pair's two
        # messages to one peer list them in the same order, run after run.
        sends = tuple(sorted(outgoing.get(tick, []), key=_message_order))
        recvs = tuple(sorted(incoming.get(tick, []), key=_message_order))
        # Rules 3 and 7: receives alone, or those of a rank chosen to receive ahead.
        early = bool(recvs) and (not sends or rank in ahead.get(tick, ()))
        before = timeline[last] if last >= 0 else None
        if join and early and before and before.sends and not before.recvs:
            # Rule 4: the receives join the last group posted (the ticks since compute only).
            timeline[last] = dataclasses.replace(before, recvs=before.recvs + recvs)
            recvs, early = (), False
        own = mine.get(tick)
        if own is None:
            timeline.append(Tick(tick, rank, None, sends, recvs, ahead=early))
        else:
            timeline.append(Tick(tick, rank, own.action, sends, recvs, own.paired, ahead=early))
        if sends or recvs:
            last = len(timeline) - 1
    return _finish(timeline, train)


def _message_order(message: Message) -> tuple[int, int, str, int, int]:
    return (message.src, message.dst, *message.producer)


def single_process_program(
    schedule: Schedule, train: bool = True, forward_passes: Collection[str] = ()
) -> RankProgram:
    """Every rank's actions in the order of the walk, one tick each (a pair's two one
    after the other), for the world of one process (every value is handed over in
    memory); ``forward_passes``: the kinds of pass a forward-only step runs."""
    timeline: list[Tick] = []
    for step in walk(schedule):
        if not isinstance(step, Compute):
            if runs(step, train, forward_passes):
                timeline.append(Tick(len(timeline), -1, None, boundary=step))
            continue
        for action in step.actions:
            if train or action.kind == F:
                timeline.append(Tick(len(timeline), step.rank, action))
    return _finish(timeline, train)


def _finish(timeline: Iterable[Tick], train: bool) -> RankProgram:
    in_order = tuple(timeline)
    first: dict[int, int] = {}
    final: dict[int, int] = {}
    previous: Action | None = None
    adjacent = set()
    for i, tick in enumerate(in_order):
        for a in tick.computed:
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
