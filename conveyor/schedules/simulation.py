"""The simulator's core: a schedule and costs in, the event timeline and its numbers out.

Pure Python (no torch import). Each rank runs its program in order; an action starts
when its rank is free and its dependencies are done, plus ``comm`` for a dependency that
ran on another rank. With expert all-to-all time (``a2a``), an action alone waits for its
all-to-all and an overlapped forward / backward pair
(:attr:`~conveyor.schedules.core.Schedule.pairs`) hides each one's behind the other's
compute (:func:`simulate`). With vocabulary parallelism
(:attr:`~conveyor.schedules.core.Schedule.vocab`) each pass is a barrier that occupies
every rank (``vocab``). The order is the one walk's
(:func:`~conveyor.schedules.order.walk`); without passes or all-to-all time the same
times come from a plan of the schedule on integer indices
(:mod:`~conveyor.schedules.fast_sim`; events in :mod:`~conveyor.schedules.events`); the
costs are checked in
:mod:`~conveyor.schedules.costs` (re-exported here). It lives beside
:class:`~conveyor.schedules.core.Schedule` because schedules search with it
(:func:`~conveyor.schedules.auto.zero_bubble_auto`); :mod:`conveyor.simulate` is its
public face.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.errors import ConfigError
from conveyor.schedules.core import Action, B, F, Kind, Schedule, W, dependencies
from conveyor.schedules.costs import (
    A2A,
    VOCAB_KINDS,
    A2ASpec,
    Cost,
    CostSpec,
    VocabCost,
    VocabSpec,
    action_durations,
    is_per_stage,
    normalize_a2a,
    normalize_cost,
    normalize_vocab,
)
from conveyor.schedules.events import Event, VocabEvent
from conveyor.schedules.fast_sim import plan_of, run
from conveyor.schedules.kept import PerSchedule
from conveyor.schedules.order import Compute, walk

__all__ = [
    "A2A",
    "A2ASpec",
    "Cost",
    "CostSpec",
    "Event",
    "SimResult",
    "VocabCost",
    "VocabEvent",
    "VocabSpec",
    "action_durations",
    "bubble",
    "is_per_stage",
    "normalize_a2a",
    "normalize_cost",
    "normalize_vocab",
    "peak_activations",
    "simulate",
]


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` found. Times are in cost units (the unit of ``cost``).

    Attributes:
        schedule: The simulated schedule.
        cost: The costs, checked (:func:`normalize_cost`): one (F, B, W) for one rank's
            share, or a tuple of one per stage.
        comm: Latency of one transfer between ranks.
        events: One :class:`Event` per action, grouped by rank, in program order.
        makespan: First start to last end over all ranks.
        span: The largest, over ranks, of that rank's last end minus its first start.
        bubble: The idle share of all ranks over the makespan, 1 - (busy time of all
            ranks) / (ranks x makespan), which is 1 - M(F+B+W)/makespan for per-rank
            costs and stays meaningful for per-stage costs.
        peak_activations: Per rank, the most micro-batch activations held at once
            (:func:`peak_activations`).
        a2a: The expert all-to-all time (F, B) of one micro-batch through one rank's
            whole share, checked (:func:`normalize_a2a`); (0, 0): none, and the pairs
            were not simulated.
        vocab: The durations (E, S, T, G) of the vocabulary passes, checked
            (:func:`normalize_vocab`).
        vocab_events: Per rank, one :class:`VocabEvent` per pass of
            :attr:`~conveyor.schedules.core.Schedule.vocab`, grouped by rank in pass
            order; empty when the schedule has no passes.
    """

    schedule: Schedule
    cost: Cost | tuple[Cost, ...]
    comm: float
    events: tuple[Event, ...]
    makespan: float
    span: float
    bubble: float
    peak_activations: tuple[float, ...]
    a2a: A2A = (0.0, 0.0)
    vocab: VocabCost = (0.0, 0.0, 0.0, 0.0)
    vocab_events: tuple[VocabEvent, ...] = ()

    @property
    def overlapped(self) -> int:
        """How many overlapped forward / backward pairs were simulated as pairs: those of
        the schedule (:attr:`~conveyor.schedules.core.Schedule.pairs`) when there is
        all-to-all time and no vocabulary pass, else none."""
        if not any(self.a2a) or self.schedule.vocab:
            return 0
        return sum(map(len, self.schedule.pairs))

    def to_json_dict(self) -> dict[str, object]:
        """The ``conveyor simulate --json`` object (keys as in DESIGN.md).

        Returns:
            ``schedule`` (its name), ``ranks``, ``chunks``, ``microbatches``, ``cost``,
            ``comm``, ``makespan``, ``span``, ``bubble`` (rounded to 4 places) and
            ``peak_activations``: plain JSON values. With all-to-all time, also ``a2a``
            (``[F, B]``) and ``pairs`` (how many overlapped pairs ran); with vocabulary
            passes, also ``vocab`` (``[E, S, T, G]``); without, those keys are left out,
            so the object is exactly DESIGN.md's.
        """
        cost = [list(c) for c in self.cost] if is_per_stage(self.cost) else list(self.cost)
        return (
            {
                "schedule": self.schedule.name,
                "ranks": self.schedule.ranks,
                "chunks": self.schedule.chunks,
                "microbatches": self.schedule.microbatches,
                "cost": cost,
                "comm": self.comm,
                "makespan": _tidy(self.makespan),
                "span": _tidy(self.span),
                "bubble": round(self.bubble, 4),
                "peak_activations": [round(p, 4) for p in self.peak_activations],
            }
            | ({"a2a": list(self.a2a), "pairs": self.overlapped} if any(self.a2a) else {})
            | ({"vocab": list(self.vocab)} if self.schedule.vocab else {})
        )


def _tidy(value: float) -> float:
    """Drop float noise from sums of fractional costs (e.g. 32.99999999 -> 33.0)."""
    return round(value, 9)


W_MEMORY = 0.76
"""The share of a micro-batch's activations conveyor's runtime still holds between its B
and its W, where nothing else is known: B frees the micro-batch's graph and keeps only the
inputs and output gradients of its deferred GEMMs (the paper's M_W). Measured with the
runtime's meter on a transformers Llama decoder layer (fp32, SDPA attention: 0.755; 0.66
under bfloat16 autocast); a GPT layer whose attention saves its scores keeps 0.25-0.45."""


def peak_activations(schedule: Schedule, *, w_memory: float = W_MEMORY) -> tuple[float, ...]:
    """Per rank, the most micro-batch activations held at once.

    A (stage, micro-batch) is held from its F until the last of its B / W; one chunk
    counts 1/V of a micro-batch through the rank's whole share. Vocabulary passes are
    not counted: they hold the logits of one micro-batch only from its S to its T, which
    run back to back (:func:`~conveyor.schedules.vocab.with_vocab`).

    Args:
        schedule: The schedule.
        w_memory: Under a split backward, the share of an activation still held from its
            B until its W: by default :data:`W_MEMORY`, conveyor's runtime on a
            transformer layer; the Zero Bubble paper counts M_W / M_B.

    Returns:
        One peak per rank, in micro-batches of the rank's whole share.
    """
    at_b = 1.0 - w_memory if schedule.split_backward else 1.0
    peaks = []
    for program in schedule.actions:
        held = peak = 0.0
        for action in program:
            if action.kind == F:
                held += 1.0
                peak = max(peak, held)
            elif action.kind == B:
                held -= at_b
            else:
                held -= w_memory
        peaks.append(_tidy(peak / schedule.chunks))
    return tuple(peaks)


_peaks = PerSchedule(peak_activations)  # (a search simulates a schedule many times)


def bubble(busy: float, first: float, last: float, ranks: int) -> float:
    """The bubble of a step: the share of ``ranks`` x (last end - first start) not busy.

    The one definition conveyor uses: the simulator's :attr:`SimResult.bubble` over
    simulated time, and every measured bubble over real time (``pipe.measured_bubble()``,
    saved traces, progress lines).

    Args:
        busy: Time of work summed over every action of every rank.
        first: The first action's start.
        last: The last action's end.
        ranks: Pipeline ranks.

    Returns:
        ``1 - busy / (ranks * (last - first))``, 0 for an empty step.
    """
    span = last - first
    return 1.0 - busy / (ranks * span) if span > 0 else 0.0


def simulate(
    schedule: Schedule,
    cost: CostSpec = (1.0, 1.0, 1.0),
    comm: float = 0.0,
    a2a: A2ASpec = 0.0,
    vocab: VocabSpec = None,
) -> SimResult:
    """Run ``schedule`` in simulated time.

    Each rank runs its program in order; an action starts when its rank is free and its
    dependencies have ended, plus ``comm`` for each dependency that ran on another rank.

    ``a2a`` adds the expert all-to-alls of a mixture-of-experts model (tokens travel to
    their experts and back in every MoE layer, in F and in B; W has none), in the model
    DualPipe is built on: compute and communication run side by side, on their own
    streams.

    - ``a2a`` 0 (the default): no all-to-all. Overlapped pairs are ignored; every action
      runs alone and takes its compute time.
    - An action that runs alone takes its compute plus its all-to-all: the rank waits for
      its tokens, with nothing else to do meanwhile.
    - An overlapped pair (:attr:`~conveyor.schedules.core.Schedule.pairs`: one
      micro-batch's F and another's B, interleaved) starts when its rank is free and
      the dependencies of both have ended, and takes ``max(cF + cB, aF + aB)``: each
      all-to-all is in flight while the other action computes, so the rank is busy for
      the longer of the two streams, compute or communication, not their sum. Its F and
      B are recorded as consecutive events that split that time in proportion ``cF :
      cB``, so busy time, bubble and pictures add up. Both results are ready when the
      pair ends (the two are interleaved to the end, and their outputs are sent
      together), and that is when the actions that need them may start.

    A schedule with vocabulary passes (:attr:`~conveyor.schedules.core.Schedule.vocab`,
    placed by :func:`~conveyor.schedules.vocab.with_vocab`) runs in the order of
    :func:`~conveyor.schedules.vocab.merged_order`. Each pass is a barrier: it starts
    when every rank has finished the actions before its slot (the pass's data is then
    there too: the slots put E before stage 0's forward, S after the last stage's
    forward, and so on), occupies every rank for its duration in ``vocab``, and the ranks
    go on when it ends; its collectives take no time beyond that. Passes count as busy
    time in makespan, span and bubble and are recorded in
    :attr:`SimResult.vocab_events`. Overlapped pairs are not simulated there (each action
    runs alone). Peak activations stay those of the actions: the logits a pass holds
    live only from S to T of one micro-batch, which run back to back.

    Args:
        schedule: The schedule; not validated here (see
            :func:`~conveyor.schedules.core.validate`).
        cost: (F, B, W) durations for one rank's whole share of the model and one
            micro-batch, or a list of (F, B, W), one per stage, in any time unit.
        comm: The latency of one transfer between ranks, in the unit of ``cost``.
        a2a: The expert all-to-all time of one micro-batch through one rank's whole
            share, in the unit of ``cost``: one number for F and B, or a pair (F, B).
            Like a per-rank ``cost``, each of V chunks takes 1/V of it.
        vocab: The durations (E, S, T, G) of the vocabulary passes of one micro-batch on
            one rank's share of the vocabulary layers (the whole layers' cost divided by
            the ranks), one number for all four, or None / 0 for no cost. Only for a
            schedule with passes.

    Returns:
        The timeline and its summary.

    Raises:
        ScheduleError: If the schedule deadlocks.
        ConfigError: For bad costs, a ``comm`` that is not a finite number >= 0, an
            ``a2a`` that is not one or two of them, a ``vocab`` that is not one or four
            of them, or a ``vocab`` cost for a schedule without passes.
    """
    if not (math.isfinite(comm) and comm >= 0):
        raise ConfigError(f"comm must be a finite number >= 0, got {comm}")
    costs = normalize_cost(schedule, cost)
    exchange = normalize_a2a(a2a)
    passes = normalize_vocab(vocab)
    if any(passes) and not schedule.vocab:
        raise ConfigError(
            f"schedule {schedule.name!r} has no vocabulary passes to give the vocab cost "
            f"{list(passes)}; place them with conveyor.schedules.vocab.with_vocab first"
        )
    durations = action_durations(schedule, costs)
    plan = None if any(exchange) else plan_of(schedule)
    if plan is None:
        events, vocab_events, busy, first, last, span = _walked(
            schedule, durations, comm, exchange, passes
        )
    else:  # the fast path, to the same times (conveyor.schedules.fast_sim)
        events, busy, first, last, span = run(plan, durations, comm)
        vocab_events = ()
    return SimResult(
        schedule=schedule,
        cost=costs,
        comm=float(comm),
        events=events,
        makespan=last - first,
        span=span,
        bubble=bubble(busy, first, last, schedule.ranks),
        peak_activations=_peaks(schedule),
        a2a=exchange,
        vocab=passes,
        vocab_events=vocab_events,
    )


def _walked(
    schedule: Schedule,
    durations: list[dict[Kind, float]],
    comm: float,
    exchange: A2A,
    passes: VocabCost,
) -> tuple[tuple[Event, ...], tuple[VocabEvent, ...], float, float, float, float]:
    """:func:`simulate`'s events, vocabulary events, busy time, first start, last end and
    span, along the walk: the reference, and the path of pairs, passes and all-to-alls."""
    overlap = any(exchange) and not schedule.vocab
    # Per kind, one chunk's all-to-all (W has none); all zero without all-to-all.
    a2a_of: dict[Kind, float] = {
        F: exchange[0] / schedule.chunks,
        B: exchange[1] / schedule.chunks,
        W: 0.0,
    }
    pass_length: dict[str, float] = dict(zip(VOCAB_KINDS, passes, strict=True))
    placement = schedule.placement
    ranks = range(schedule.ranks)
    free = [0.0] * schedule.ranks
    first_start = [math.inf] * schedule.ranks
    end: dict[Action, float] = {}
    timed: list[list[Event]] = [[] for _ in ranks]
    barriers: list[list[VocabEvent]] = [[] for _ in ranks]
    for step in walk(schedule):
        if not isinstance(step, Compute):
            # A vocabulary pass: a barrier of every rank, busy on each for its length.
            start = max(free)
            finish = start + pass_length[step.kind]
            for r in ranks:
                barriers[r].append(VocabEvent(r, step, start, finish))
                free[r] = finish
                first_start[r] = min(first_start[r], start)
            continue
        rank = step.rank
        # Without all-to-all time (or among passes) a pair's actions run one by one.
        units = [step.actions] if overlap else [(a,) for a in step.actions]
        for together in units:
            start = free[rank]
            for one in together:
                for dep in dependencies(schedule, one):
                    ready_at = end[dep] + (comm if placement[dep.stage] != rank else 0.0)
                    start = max(start, ready_at)
            if len(together) == 1:
                (action,) = together
                finish = start + durations[action.stage][action.kind] + a2a_of[action.kind]
                end[action] = finish
                timed[rank].append(Event(rank, action, start, finish))
            else:
                fwd, bwd = together
                compute_f, compute_b = durations[fwd.stage][F], durations[bwd.stage][B]
                length = max(compute_f + compute_b, a2a_of[F] + a2a_of[B])
                finish = start + length
                share = compute_f / (compute_f + compute_b) if compute_f + compute_b else 0.5
                middle = start + length * share
                end[fwd] = end[bwd] = finish
                timed[rank] += [Event(rank, fwd, start, middle), Event(rank, bwd, middle, finish)]
            free[rank] = finish
            first_start[rank] = min(first_start[rank], start)
    events = tuple(e for rank_events in timed for e in rank_events)
    vocab_events = tuple(e for rank_events in barriers for e in rank_events)
    active = [r for r in ranks if timed[r] or barriers[r]]
    first = min((first_start[r] for r in active), default=0.0)
    last = max((free[r] for r in active), default=0.0)
    span = max((free[r] - first_start[r] for r in active), default=0.0)
    busy = sum(e.end - e.start for e in events) + sum(e.end - e.start for e in vocab_events)
    return events, vocab_events, busy, first, last, span
