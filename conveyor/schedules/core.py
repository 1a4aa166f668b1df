"""Schedule data: actions, per-rank programs, placement, and the dependency rule.

Pure Python (no torch import): the generators, the simulator and the runtime all
consume the same :class:`Schedule`. Ranks here are pipeline ranks (``0 .. ranks - 1``),
stages are global stage indices and micro-batches are numbered from 0. How the ranks run
a schedule together is :mod:`~conveyor.schedules.order`; the checks are
:mod:`~conveyor.schedules.checks`; overlapped pairs are :mod:`~conveyor.schedules.pairs`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from conveyor.errors import ConfigError

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


class Pass(NamedTuple):
    """A pipeline-wide step of one micro-batch: every pipeline rank runs it at one tick, at
    the place its program gives it (:attr:`Schedule.vocab_slots`), with collectives over
    the pipeline group. No stage computes it: the stage ends that implement the kind run
    it, and say what each kind does and which kinds a forward-only step runs (vocabulary
    parallelism's ``E``, ``S``, ``T`` and ``G``: :mod:`~conveyor.schedules.vocab`). Written
    ``S3`` (kind ``S`` of micro-batch 3).

    Attributes:
        kind: One capital letter other than F, B and W.
        microbatch: The micro-batch index, from 0.
    """

    kind: str
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
    (:func:`~conveyor.schedules.table.from_table`), and check it with
    :func:`~conveyor.schedules.checks.validate`.
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
            (:func:`~conveyor.schedules.pairs.paired`,
            :func:`~conveyor.schedules.pairs.unpaired`). A value without any pair is
            stored as ``()``.
        vocab: The pipeline-wide passes (:class:`Pass`: vocabulary parallelism's), in the
            one order every rank runs them; empty: none
            (:func:`~conveyor.schedules.vocab.with_vocab`).
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
    vocab: tuple[Pass, ...] = ()
    vocab_slots: tuple[tuple[int, ...], ...] = ()
    # Each rank's stages, from ``placement``: computed by every construction (a
    # ``dataclasses.replace`` copy too, which may have replaced the placement).
    _stages_by_rank: dict[int, tuple[int, ...]] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        """Derive each rank's stages; store "no pair on any rank" as ``pairs=()``."""
        by_rank: dict[int, list[int]] = {}
        for s, r in enumerate(self.placement):
            by_rank.setdefault(r, []).append(s)
        stages = {r: tuple(own) for r, own in by_rank.items()}
        object.__setattr__(self, "_stages_by_rank", stages)
        if self.pairs and not any(self.pairs):
            object.__setattr__(self, "pairs", ())

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
        return self._stages_by_rank.get(rank, ())

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

    Does not validate; pass the result to :func:`~conveyor.schedules.checks.validate`.

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


def requires(action: Action, stages: int) -> tuple[Action, ...]:
    """The dependency rule: the actions that must finish before ``action`` may start.

    F of stage s needs F of stage s-1; B of stage s needs F of stage s and, except on
    the last stage, B of stage s+1; W needs the B of its stage and micro-batch. Every
    walk, check, simulator, scheduler and program of conveyor asks this function.

    Args:
        action: The action.
        stages: The schedule's stage count.

    Returns:
        The actions it waits for (empty for F of stage 0).
    """
    kind, s, m = action
    if kind == F:
        return (Action(F, s - 1, m),) if s > 0 else ()
    if kind == B:
        return (Action(F, s, m),) if s == stages - 1 else (Action(F, s, m), Action(B, s + 1, m))
    return (Action(B, s, m),)


def dependencies(schedule: Schedule, action: Action) -> tuple[Action, ...]:
    """The actions that must finish before ``action`` may start (data dependencies).

    F of stage s needs F of stage s-1; B of stage s needs F of stage s and, except on
    the last stage, B of stage s+1; W needs the B of its stage and micro-batch
    (:func:`requires` with the schedule's stage count).

    Args:
        schedule: The schedule ``action`` belongs to (for its stage count).
        action: The action.

    Returns:
        The actions it waits for (empty for F of stage 0).
    """
    return requires(action, schedule.stages)
