"""GPipe: every forward, then every backward (looped over chunks when chunks > 1)."""

from __future__ import annotations

from conveyor.schedules.core import Action, B, F, Schedule, check_sizes, loop_placement


def gpipe(ranks: int, microbatches: int, chunks: int = 1) -> Schedule:
    """GPipe: all forwards of all micro-batches, then all backwards, on every rank.

    With ``chunks`` > 1, stage s lives on rank s % ranks and each rank runs its chunks
    breadth first: every micro-batch through chunk 0, then chunk 1, ...; backwards run
    the chunks in reverse. Peak activations: every micro-batch on every rank.

    Args:
        ranks: Pipeline ranks.
        microbatches: Micro-batches per step.
        chunks: Stages per rank.

    Returns:
        The schedule, named ``"gpipe"``, without split backward.

    Raises:
        ConfigError: If a size is not an integer >= 1.
    """
    check_sizes(ranks, microbatches, chunks)
    programs = []
    for rank in range(ranks):
        own = [c * ranks + rank for c in range(chunks)]
        forwards = [Action(F, s, mb) for s in own for mb in range(microbatches)]
        backwards = [Action(B, s, mb) for s in reversed(own) for mb in range(microbatches)]
        programs.append(tuple(forwards + backwards))
    return Schedule(
        name="gpipe",
        ranks=ranks,
        microbatches=microbatches,
        placement=loop_placement(ranks, chunks),
        actions=tuple(programs),
    )
