"""Schedule data: actions, per-rank programs, placement, and validation.

Pure Python (no torch import): the generators, the simulator and the runtime all
consume the same :class:`Schedule`. Ranks here are pipeline ranks (``0 .. ranks - 1``),
stages are global stage indices and micro-batches are numbered from 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from conveyor.errors import ConfigError, ScheduleError

Kind = Literal["F", "B", "W"]
"""What an action computes: ``"F"`` forward, ``"B"`` backward (only the input gradient
when the backward is split), ``"W"`` weight gradient (split backward only)."""

F: Kind = "F"
"""Forward."""
B: Kind = "B"
"""Backward: the whole backward, or only the input gradient when the backward is split."""
W: Kind = "W"
"""Weight gradient (only in schedules with ``split_backward``)."""
KINDS: tuple[Kind, ...] = (F, B, W)
"""Every kind, in the order an action of each runs for one stage and micro-batch."""

VocabKind = Literal["E", "S", "T", "G"]
"""A vocabulary pass (vocabulary parallelism, every pipeline rank takes part):
``"E"`` the embedding lookup of the rank's rows, summed onto the first stage's rank;
``"S"`` the output layer's forward: the last stage's hidden states broadcast, the rank's
logits shard and its softmax statistics, gathered from every rank (the loss);
``"T"`` the output layer's backward: the logits' gradient, the rank's weight gradient,
and the input gradient summed onto the last stage's rank;
``"G"`` the embedding's gradient: the first stage's input gradient broadcast, each rank
adds its rows'."""
VOCAB_KINDS: tuple[VocabKind, ...] = ("E", "S", "T", "G")
"""Every vocabulary pass, in the order they run for one micro-batch."""


class Action(NamedTuple):
    """One unit of work: ``kind`` of ``stage`` on ``microbatch``.

    Written ``F2,5`` (forward of stage 2 on micro-batch 5) by ``str()`` and in schedule
    tables.

    Attributes:
        kind: ``"F"`` (forward), ``"B"`` (backward, or only its input gradient when the
            backward is split) or ``"W"`` (weight gradient).
        stage: The global stage index, from 0.
        microbatch: The micro-batch index, from 0.
    """

    kind: Kind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        """The action as ``<kind><stage>,<microbatch>``, e.g. ``F2,5``."""
        return f"{self.kind}{self.stage},{self.microbatch}"


class VocabAction(NamedTuple):
    """One vocabulary pass (:data:`VocabKind`) of one micro-batch, run by every pipeline
    rank at once (each on its rows of the vocabulary) with collectives over the pipeline
    group. Written ``S3`` (the output forward of micro-batch 3)."""

    kind: VocabKind
    microbatch: int

    def __str__(self) -> str:
        """The pass as ``<kind><microbatch>``, e.g. ``S3``."""
        return f"{self.kind}{self.microbatch}"


def check_sizes(ranks: int, microbatches: int, chunks: int = 1) -> None:
    """Check the sizes every schedule generator takes.

    Args:
        ranks: Pipeline ranks.
        microbatches: Micro-batches per step.
        chunks: Stages per rank.

    Raises:
        ConfigError: If any of them is not an ``int`` >= 1 (``bool`` does not count).
    """
    for label, value in (("ranks", ranks), ("microbatches", microbatches), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{label} must be an integer >= 1, got {value!r}")


def loop_placement(ranks: int, chunks: int) -> tuple[int, ...]:
    """The loop placement (Megatron's interleaved layout): stage s on rank s % ranks.

    Args:
        ranks: Pipeline ranks.
        chunks: Stages per rank.

    Returns:
        The rank of each of the ``ranks * chunks`` stages.
    """
    return tuple(s % ranks for s in range(ranks * chunks))


def v_placement(ranks: int) -> tuple[int, ...]:
    """The V placement: two chunks per rank, rank r holds stages r and 2p-1-r.

    Args:
        ranks: Pipeline ranks (p).

    Returns:
        The rank of each of the ``2 * ranks`` stages.
    """
    return tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks))


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered actions plus the stage placement.

    Build one with a generator (:func:`~conveyor.schedules.registry.get_schedule`), from
    plain lists (:func:`make_schedule`) or from a table
    (:func:`~conveyor.schedules.table.from_table`), and check it with :func:`validate`.
    Iterating over a schedule yields ``(rank, action)`` pairs, rank by rank in program
    order.

    Attributes:
        name: The schedule's name, e.g. ``"1f1b"``.
        ranks: Pipeline ranks.
        microbatches: Micro-batches per step.
        placement: ``placement[s]`` is the rank holding stage s.
        actions: ``actions[r]`` is rank r's program, in the order the rank runs it.
        split_backward: Whether the backward is split into B (input gradient) and W
            (weight gradient); when False, B is the whole backward and there are no W
            actions.
        pairs: Per rank, the indices ``i`` of its program whose F ``actions[r][i]`` runs
            overlapped with the B ``actions[r][i + 1]`` of another micro-batch (each
            one's expert all-to-alls in flight during the other's compute); empty: none
            (:func:`paired`, :func:`unpaired`).
        vocab: The vocabulary passes (vocabulary parallelism), in the one order every
            rank runs them; empty: none (:func:`~conveyor.schedules.vocab.with_vocab`).
        vocab_slots: Per rank, for each pass of ``vocab``, the index of the rank's
            program it runs before (the program's length: after its last action).
    """

    name: str
    ranks: int
    microbatches: int
    placement: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    split_backward: bool = False
    pairs: tuple[tuple[int, ...], ...] = ()
    vocab: tuple[VocabAction, ...] = ()
    vocab_slots: tuple[tuple[int, ...], ...] = ()
    _stage_ranks: dict[int, tuple[int, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def stages(self) -> int:
        """Total number of stages (ranks x chunks)."""
        return len(self.placement)

    @property
    def chunks(self) -> int:
        """Stages per rank (``stages // ranks``)."""
        return self.stages // self.ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages placed on ``rank``.

        Args:
            rank: A pipeline rank.

        Returns:
            Its stage indices in increasing order (empty for a rank out of range).
        """
        if rank not in self._stage_ranks:
            own = tuple(s for s, r in enumerate(self.placement) if r == rank)
            self._stage_ranks[rank] = own
        return self._stage_ranks[rank]

    def pair_starts(self, rank: int) -> frozenset[int]:
        """The indices of ``rank``'s program that start an overlapped pair (:attr:`pairs`)."""
        return frozenset(self.pairs[rank]) if self.pairs else frozenset()

    def __iter__(self) -> Iterator[tuple[int, Action]]:
        """Every ``(rank, action)`` pair: rank 0's program first, each in program order."""
        for rank, program in enumerate(self.actions):
            for action in program:
                yield rank, action


def make_schedule(
    name: str,
    ranks: int,
    microbatches: int,
    placement: Sequence[int],
    actions: Sequence[Sequence[Action]],
    split_backward: bool = False,
) -> Schedule:
    """Build a :class:`Schedule` from plain sequences.

    Does not validate; pass the result to :func:`validate`.

    Args:
        name: The schedule's name.
        ranks: Pipeline ranks.
        microbatches: Micro-batches per step.
        placement: The rank of each stage.
        actions: One program per rank; each action an :class:`Action` or a plain
            ``(kind, stage, microbatch)`` tuple.
        split_backward: Whether B and W are separate actions.

    Returns:
        The schedule, with every sequence converted to a tuple.
    """
    return Schedule(
        name=name,
        ranks=ranks,
        microbatches=microbatches,
        placement=tuple(placement),
        actions=tuple(tuple(Action(*a) for a in program) for program in actions),
        split_backward=split_backward,
    )


def dependencies(schedule: Schedule, action: Action) -> tuple[Action, ...]:
    """The actions that must finish before ``action`` may start (data dependencies).

    F of stage s needs F of stage s-1; B of stage s needs F of stage s and, except on
    the last stage, B of stage s+1; W needs the B of its stage and micro-batch.

    Args:
        schedule: The schedule ``action`` belongs to (for its stage count).
        action: The action.

    Returns:
        The actions it waits for (empty for F of stage 0).
    """
    kind, s, m = action
    last = schedule.stages - 1
    if kind == F:
        return (Action(F, s - 1, m),) if s > 0 else ()
    if kind == B:
        return (Action(F, s, m),) if s == last else (Action(F, s, m), Action(B, s + 1, m))
    return (Action(B, s, m),)


def _check_shape(schedule: Schedule) -> None:
    """Raise ScheduleError unless sizes, program count and placement fit together."""
    p, m = schedule.ranks, schedule.microbatches
    if p < 1 or m < 1:
        raise ScheduleError(f"schedule {schedule.name!r}: ranks and microbatches must be >= 1")
    if len(schedule.actions) != p:
        raise ScheduleError(
            f"schedule {schedule.name!r} has programs for {len(schedule.actions)} ranks, "
            f"expected {p}; give one action list per rank"
        )
    if not schedule.placement or any(not 0 <= r < p for r in schedule.placement):
        raise ScheduleError(
            f"schedule {schedule.name!r}: placement {schedule.placement} must map every "
            f"stage to a rank in 0..{p - 1}"
        )
    for r in range(p):
        if not schedule.stages_of(r):
            raise ScheduleError(f"schedule {schedule.name!r}: rank {r} holds no stage")


def _bad_action(schedule: Schedule, rank: int, action: Action, kinds: tuple[Kind, ...]) -> str:
    """Why ``action`` may not appear in ``rank``'s program, or '' when it may."""
    kind, s, mb = action
    if kind not in kinds:
        return (
            f"rank {rank}: action {action} has kind {kind!r}; this schedule allows "
            f"{'/'.join(kinds)} (set split_backward=True to use W)"
        )
    if not (0 <= s < schedule.stages and 0 <= mb < schedule.microbatches):
        return (
            f"rank {rank}: action {action} is out of range "
            f"(stages 0..{schedule.stages - 1}, microbatches 0..{schedule.microbatches - 1})"
        )
    if schedule.placement[s] != rank:
        return (
            f"rank {rank}: action {action} runs stage {s}, which is placed on rank "
            f"{schedule.placement[s]}; move it to that rank's program"
        )
    return ""


def _check_complete(schedule: Schedule) -> None:
    """Raise ScheduleError unless every action is allowed and appears exactly once."""
    kinds = (F, B, W) if schedule.split_backward else (F, B)
    stages, m = schedule.stages, schedule.microbatches
    seen: set[Action] = set()
    for rank, program in enumerate(schedule.actions):
        own = set(schedule.stages_of(rank))
        for action in program:
            kind, s, mb = action
            # Plain comparisons first: this loop runs for every action of every schedule.
            if kind not in kinds or s not in own or not 0 <= mb < m or not 0 <= s < stages:
                raise ScheduleError(_bad_action(schedule, rank, action, kinds))
        # A stage lives on one rank, so a repeated action repeats within one program.
        before = len(seen)
        seen.update(program)
        if len(seen) - before != len(program):
            counted: set[Action] = set()
            for action in program:
                if action in counted:
                    raise ScheduleError(f"rank {rank}: action {action} appears twice; keep one")
                counted.add(action)
    if len(seen) == stages * m * len(kinds):
        return  # every action seen is distinct, in range and of an allowed kind
    for s in range(stages):
        for mb in range(m):
            for kind in kinds:
                if Action(kind, s, mb) not in seen:
                    raise ScheduleError(
                        f"rank {schedule.placement[s]}: action {Action(kind, s, mb)} is "
                        f"missing; every stage needs {'/'.join(kinds)} of every micro-batch"
                    )


def execution_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """A valid global order of all actions, found by running the ranks' programs.

    Sends never block and receives do: each rank advances while the dependencies of its
    next action are done (of both actions of an overlapped pair, which come out
    together). The order is round-robin over ranks, which is also the order the
    single-process world uses.

    Args:
        schedule: A schedule whose actions are complete and in range (as checked by
            :func:`validate`).

    Returns:
        Every ``(rank, action)`` pair, in an order that respects :func:`dependencies`.

    Raises:
        ScheduleError: If the programs deadlock; the message names every stuck rank and
            the action it waits on.
    """
    order, position = _run(schedule)
    if len(order) < sum(len(p) for p in schedule.actions):
        done = {a for _, a in order}
        starts = [schedule.pair_starts(r) for r in range(schedule.ranks)]
        stuck = []
        for rank, program in enumerate(schedule.actions):
            i = position[rank]
            if i < len(program):
                action = program[i]
                waiting = [action, program[i + 1]] if i in starts[rank] else [action]
                missing = [d for a in waiting for d in dependencies(schedule, a) if d not in done]
                stuck.append(
                    f"rank {rank} at {action} waits for "
                    + ", ".join(f"{d} on rank {schedule.placement[d.stage]}" for d in missing)
                )
        raise ScheduleError(
            f"schedule {schedule.name!r} deadlocks: "
            + "; ".join(stuck)
            + "; reorder the actions so every wait is on work that can finish first"
        )
    return order


def _run(schedule: Schedule) -> tuple[list[tuple[int, Action]], list[int]]:
    """Run the programs while any rank can advance: the order found, and where each
    rank's program stopped (at its end unless the programs deadlock)."""
    position = [0] * schedule.ranks
    # Whether each action is done, by index (kind, stage, micro-batch) in a bytearray:
    # much cheaper per action than a set of tuples, and this loop runs for every action of
    # every schedule.
    m, stages = schedule.microbatches, schedule.stages
    is_done = bytearray(3 * stages * m)
    b_base, w_base = stages * m, 2 * stages * m
    order: list[tuple[int, Action]] = []
    last = stages - 1

    def slot(action: Action) -> tuple[bool, int]:
        """Whether ``action`` may run, and its index in ``is_done``."""
        kind, s, mb = action
        at = s * m + mb
        if kind == F:
            return s == 0 or bool(is_done[at - m]), at
        if kind == B:
            return bool(is_done[at]) and (s == last or bool(is_done[b_base + at + m])), at + b_base
        return bool(is_done[b_base + at]), at + w_base

    starts = [schedule.pair_starts(r) for r in range(schedule.ranks)]
    progressed = True
    while progressed:
        progressed = False
        for rank, program in enumerate(schedule.actions):
            i, n = position[rank], len(program)
            start = i
            while i < n:
                ready, at = slot(program[i])
                if not ready:
                    break
                if i in starts[rank]:  # an overlapped pair runs when both may
                    ready_b, at_b = slot(program[i + 1])
                    if not ready_b:
                        break
                    is_done[at_b] = 1
                    i += 1
                is_done[at] = 1
                i += 1
            if i > start:
                order.extend((rank, a) for a in program[start:i])
                position[rank] = i
                progressed = True
    return order, position


def forward_backward_pairs(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """Per rank, every F directly followed by a B of another micro-batch (the steady
    state of 1F1B, DualPipeV's overlapped slots): the pairs :func:`paired` marks."""
    return tuple(
        tuple(
            i
            for i in range(len(program) - 1)
            if program[i].kind == F
            and program[i + 1].kind == B
            and program[i].microbatch != program[i + 1].microbatch
        )
        for program in schedule.actions
    )


def paired(schedule: Schedule) -> Schedule:
    """``schedule`` with its forward / backward pairs marked (:func:`forward_backward_pairs`):
    where a pipeline shards experts, each pair runs interleaved at the expert all-to-alls.

    Args:
        schedule: A valid schedule.

    Returns:
        The same programs with :attr:`Schedule.pairs` set.

    Raises:
        ScheduleError: If ``schedule`` itself deadlocks. (A pair that would deadlock, e.g.
            an F of 1F1B's warm-up with the first B, is left unpaired.)
    """
    def stops(marked: Schedule) -> list[int] | None:
        order, position = _run(marked)
        return None if len(order) == sum(len(p) for p in marked.actions) else position

    # A pair whose B waits on its own F's consequences (a warm-up F before the first B)
    # runs apart; if no pair is stuck, the schedule itself deadlocks.
    return _runnable_pairs(
        schedule, forward_backward_pairs(schedule), stops, lambda _: execution_order(schedule)
    )


def _runnable_pairs(
    schedule: Schedule,
    pairs: Sequence[Iterable[int]],
    stops: Callable[[Schedule], list[int] | None],
    fail: Callable[[Schedule], object],
) -> Schedule:
    """``schedule`` with those of ``pairs`` (per rank, the indices of paired Fs) marked that
    let it run: ``stops`` walks a marked schedule (None: every action ran; else where each
    rank stopped); each pair a walk stops at is dropped and the walk repeated. Stopped at
    no pair, ``fail`` raises, naming the stuck ranks."""
    marks = [set(p) for p in pairs]
    while True:
        kept = tuple(tuple(sorted(p)) for p in marks) if any(marks) else ()
        marked = dataclasses.replace(schedule, pairs=kept)
        position = stops(marked)
        if position is None:
            return marked
        stuck = [(r, i) for r, i in enumerate(position) if i in marks[r]]
        if not stuck:
            fail(marked)
        for r, i in stuck:
            marks[r].discard(i)


def unpaired(schedule: Schedule) -> Schedule:
    """``schedule`` with no overlapped pairs: every action runs on its own."""
    return dataclasses.replace(schedule, pairs=())


def _check_pairs(schedule: Schedule) -> None:
    """Raise ScheduleError unless each pair is an F then a B of another micro-batch."""
    if not schedule.pairs:
        return
    if len(schedule.pairs) != schedule.ranks:
        raise ScheduleError(
            f"pairs has {len(schedule.pairs)} entries for {schedule.ranks} ranks; give one "
            f"tuple of indices per rank (empty for none)"
        )
    for rank, starts in enumerate(schedule.pairs):
        program = schedule.actions[rank]
        previous = -2
        for i in starts:
            ok = 0 <= i < len(program) - 1 and i > previous + 1
            if ok:
                f, b = program[i], program[i + 1]
                ok = f.kind == F and b.kind == B and f.microbatch != b.microbatch
            if not ok:
                raise ScheduleError(
                    f"rank {rank}: pair at index {i} is not an F followed by a B of another "
                    f"micro-batch (pairs are increasing and do not share an action)"
                )
            previous = i


def _check_local_order(schedule: Schedule) -> None:
    """Raise ScheduleError if a rank's program puts an action before one it needs."""
    for rank, program in enumerate(schedule.actions):
        index = {a: i for i, a in enumerate(program)}
        for i, action in enumerate(program):
            kind, s, mb = action
            if kind == F and (s == 0 or (F, s - 1, mb) not in index):
                continue  # fast path: the only dependency is on another rank
            for dep in dependencies(schedule, action):
                j = index.get(dep)
                if j is not None and j > i:
                    raise ScheduleError(
                        f"rank {rank}: action {action} comes before {dep}, which it needs; "
                        f"swap them"
                    )


Step = tuple[int, Action] | tuple[None, VocabAction]
"""One entry of :func:`merged_order`: ``(rank, action)``, or ``(None, pass)`` for a
vocabulary pass that every rank runs."""


def merged_order(schedule: Schedule) -> list[Step]:
    """A valid global order of every action and vocabulary pass.

    The ranks run their programs as :func:`~conveyor.schedules.core.execution_order`
    does; a pass runs once every rank has reached its slot (a barrier: each holds
    collectives of the whole pipeline group). Without passes it is ``execution_order``.

    Raises:
        ScheduleError: If the programs deadlock; names each stuck rank and its wait.
    """
    if not schedule.vocab:
        return list(execution_order(schedule))
    parts, _, stuck = _merge(schedule)
    if stuck:
        raise ScheduleError(
            f"schedule {schedule.name!r} deadlocks around its vocabulary passes: "
            + ", ".join(stuck)
            + " wait on work placed after a pass that needs them; place each pass after "
            "the actions it waits for on every rank"
        )
    return parts


def _merge(schedule: Schedule) -> tuple[list[Step], list[int], list[str]]:
    """:func:`merged_order`'s walk: the order, each rank's position where it stopped, and
    the stuck ranks (empty when every action ran)."""
    parts: list[Step] = []
    position = [0] * schedule.ranks
    done: set[Action] = set()
    for k, v in enumerate(schedule.vocab):
        slots = [schedule.vocab_slots[r][k] for r in range(schedule.ranks)]
        stuck = _segment(schedule, position, slots, done, parts)
        if stuck:
            return parts, position, stuck
        parts.append((None, v))
    stuck = _segment(schedule, position, [len(p) for p in schedule.actions], done, parts)
    return parts, position, stuck


def _segment(
    schedule: Schedule, position: list[int], stop: list[int], done: set[Action],
    order: list[Step],
) -> list[str]:  # fmt: skip
    """The actions between two barriers in a valid order, appended to ``order``: each rank
    runs its program from ``position`` up to ``stop`` (both updated in place, as is
    ``done``), an overlapped pair as one unit (a pair a barrier splits never runs).
    Returns the stuck ranks, each with the action it waits at."""
    starts = [schedule.pair_starts(r) for r in range(schedule.ranks)]
    progressed = True
    while progressed:
        progressed = False
        for rank, program in enumerate(schedule.actions):
            while position[rank] < stop[rank]:
                i = position[rank]
                unit = [program[i]]
                if i in starts[rank]:
                    if i + 1 >= stop[rank]:
                        break
                    unit.append(program[i + 1])
                if not all(d in done for a in unit for d in dependencies(schedule, a)):
                    break
                for a in unit:
                    done.add(a)
                    order.append((rank, a))
                position[rank] += len(unit)
                progressed = True
    return [
        f"rank {r} at {p[position[r]]}"
        for r, p in enumerate(schedule.actions)
        if position[r] < stop[r]
    ]


def paired_with_vocab(schedule: Schedule, pairs: tuple[tuple[int, ...], ...]) -> Schedule:
    """``schedule`` (with vocabulary passes) with those of ``pairs`` marked that run
    deadlock-free as units around the passes (as :func:`paired` keeps those that do
    without passes): a pair a pass splits, or whose B waits on work after a pass, runs
    apart."""
    def stops(marked: Schedule) -> list[int] | None:
        _, position, stuck = _merge(marked)
        return position if stuck else None

    return _runnable_pairs(schedule, pairs, stops, merged_order)


def check_vocab(schedule: Schedule) -> None:
    """Check the vocabulary passes of ``schedule``: each of E, S, T, G once per
    micro-batch, in an order that keeps each micro-batch's E, S, T, G in that order; one
    slot per pass on every rank, never decreasing; each pass where its data is (E before
    stage 0's forward, S after the last stage's forward, T before the last stage's
    backward, G after stage 0's backward, on their ranks); and no deadlock.

    Raises:
        ScheduleError: Naming the pass and rank at fault.
    """
    name, p = schedule.name, schedule.ranks
    seen = {(v.kind, v.microbatch) for v in schedule.vocab}
    wanted = {(k, m) for k in VOCAB_KINDS for m in range(schedule.microbatches)}
    if len(schedule.vocab) != len(wanted) or seen != wanted:
        missing = sorted(wanted - seen)
        what = f"lacks {missing[0][0]}{missing[0][1]}" if missing else "repeats a pass"
        raise ScheduleError(
            f"schedule {name!r}: its vocabulary passes {what}; give E, S, T and G of every "
            f"micro-batch once (conveyor.schedules.vocab.with_vocab places them)"
        )
    index = {(v.kind, v.microbatch): k for k, v in enumerate(schedule.vocab)}
    for m in range(schedule.microbatches):
        ks = [index[(kind, m)] for kind in VOCAB_KINDS]
        if ks != sorted(ks):
            raise ScheduleError(
                f"schedule {name!r}: micro-batch {m}'s vocabulary passes run out of order; "
                f"run E, S, T, G of a micro-batch in that order"
            )
    if len(schedule.vocab_slots) != p or any(
        len(row) != len(schedule.vocab) for row in schedule.vocab_slots
    ):
        raise ScheduleError(
            f"schedule {name!r}: vocab_slots needs one slot per pass for each of {p} ranks"
        )
    for r, row in enumerate(schedule.vocab_slots):
        n = len(schedule.actions[r])
        if any(not 0 <= i <= n for i in row) or list(row) != sorted(row):
            raise ScheduleError(
                f"schedule {name!r}: rank {r}'s vocabulary slots {row} must be positions "
                f"0..{n} of its program, never decreasing"
            )
    last = schedule.stages - 1
    for k, v in enumerate(schedule.vocab):
        m = v.microbatch
        rules = {
            "E": (Action(F, 0, m), False, "before"),
            "S": (Action(F, last, m), True, "after"),
            "T": (Action(B, last, m), False, "before"),
            "G": (Action(B, 0, m), True, "after"),
        }
        action, after, word = rules[v.kind]
        rank = schedule.placement[action.stage]
        i = schedule.actions[rank].index(action)
        slot = schedule.vocab_slots[rank][k]
        if (slot <= i) if after else (slot > i):
            raise ScheduleError(
                f"schedule {name!r}: rank {rank} runs {v} {'before' if after else 'after'} "
                f"{action}; it must run {word} it"
            )
    merged_order(schedule)


def validate(schedule: Schedule) -> Schedule:
    """Check that ``schedule`` is complete, in dependency order and deadlock free.

    Complete: the placement maps every stage to a rank, every rank holds a stage, each
    rank's program runs only its own stages, and every F and B (and W with
    ``split_backward``) of every stage and micro-batch appears exactly once. Each
    overlapped pair (:attr:`Schedule.pairs`) is an F followed by a B of another micro-batch.

    Args:
        schedule: The schedule to check.

    Returns:
        ``schedule`` itself, unchanged, so calls can be chained.

    Raises:
        ScheduleError: Naming the rank and action at fault and how to fix it.
    """
    _check_shape(schedule)
    _check_complete(schedule)
    _check_pairs(schedule)
    if schedule.vocab or schedule.vocab_slots:
        _check_local_order(schedule)
        check_vocab(schedule)
        return schedule
    try:
        execution_order(schedule)
    except ScheduleError:
        # A rank that orders its own actions wrongly also deadlocks; name the swap instead.
        _check_local_order(schedule)
        raise
    return schedule
