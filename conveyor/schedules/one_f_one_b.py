"""1F1B (PipeDream-flush): warm up with forwards, then alternate one forward, one backward."""

from __future__ import annotations

from conveyor.schedules.core import Action, B, F, Schedule, check_sizes, loop_placement


def one_f_one_b_program(ranks: int, microbatches: int, rank: int) -> tuple[Action, ...]:
    """Rank ``rank``'s 1F1B program: min(p-rank-1, m) warm-up forwards, steady 1F1B, cool-down.

    Holds at most min(p - rank, m) micro-batches of activations at once.

    Args:
        ranks: Pipeline ranks (p).
        microbatches: Micro-batches per step (m).
        rank: The rank, which runs stage ``rank``.

    Returns:
        The rank's F and B actions in order.
    """
    warmup = min(ranks - rank - 1, microbatches)
    program = [Action(F, rank, mb) for mb in range(warmup)]
    for i in range(microbatches - warmup):
        program.append(Action(F, rank, warmup + i))
        program.append(Action(B, rank, i))
    program.extend(Action(B, rank, mb) for mb in range(microbatches - warmup, microbatches))
    return tuple(program)


def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """The 1F1B schedule: one stage per rank, same makespan as GPipe, less memory.

    Args:
        ranks: Pipeline ranks.
        microbatches: Micro-batches per step.

    Returns:
        The schedule, named ``"1f1b"``, without split backward.

    Raises:
        ConfigError: If a size is not an integer >= 1.
    """
    check_sizes(ranks, microbatches)
    # Not paired (conveyor.schedules.paired would mark its steady state): in plain 1F1B a
    # pair's B waits for the next rank's pair, so the pairs run one rank after another
    # and cost more than the overlap hides (docs/concepts/schedules-as-data.md).
    return Schedule(
        name="1f1b",
        ranks=ranks,
        microbatches=microbatches,
        placement=loop_placement(ranks, 1),
        actions=tuple(one_f_one_b_program(ranks, microbatches, r) for r in range(ranks)),
    )
