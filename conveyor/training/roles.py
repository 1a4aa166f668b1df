"""Which ranks read data, and which share of a global batch a replica trains on."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.pipeline import Pipeline
from conveyor.runtime import microbatch
from conveyor.runtime.microbatch import Needs


def needs(pipe: Pipeline, evaluating: bool) -> Needs:
    """What this rank of ``pipe`` reads of each batch: the runtime's one rule
    (:func:`conveyor.runtime.microbatch.needs`); evaluation computes metrics on the last
    stage, which then reads the inputs and the targets too.

    Args:
        pipe: The pipeline.
        evaluating: For evaluation (metrics on the last stage) instead of training.

    Returns:
        This rank's needs.
    """
    ctx, placement = pipe.context, pipe.schedule.placement
    # Vocabulary passes: every rank embeds and scores its rows of the vocabulary.
    every = bool(getattr(pipe.schedule, "vocab", ()))
    first = every or not ctx.distributed or placement[0] == ctx.pp_rank
    last = every or not ctx.distributed or placement[-1] == ctx.pp_rank
    mode = "metrics" if evaluating else "train"
    return microbatch.needs(first, last, mode, pipe.loss_fn is not None)


def shard(indices: Sequence[int], replicas: int, replica: int) -> list[int]:
    """Replica ``replica``'s contiguous share of a global batch (sizes differ by at most 1).

    Args:
        indices: The global batch's sample indices.
        replicas: The number of data-parallel replicas.
        replica: This replica's index.

    Returns:
        The indices this replica trains on.
    """
    base, extra = divmod(len(indices), replicas)
    start = replica * base + min(replica, extra)
    return list(indices[start : start + base + (1 if replica < extra else 0)])
