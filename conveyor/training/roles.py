"""Which ranks read data, and which share of a global batch a replica trains on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.pipeline import Pipeline


@dataclass(frozen=True)
class Needs:
    """What this rank passes to a step: the inputs, the targets, or neither."""

    inputs: bool
    targets: bool

    @property
    def anything(self) -> bool:
        """Whether this rank loads batches at all."""
        return self.inputs or self.targets


def needs(pipe: Pipeline, evaluating: bool) -> Needs:
    """What this rank of ``pipe`` needs from each batch.

    The rank holding stage 0 needs the inputs. The rank holding the last stage needs the
    targets when a ``loss_fn`` computes the loss; with ``loss_fn=None`` the loss comes from
    the model's output, and that rank needs the inputs only to count its replica's samples
    (data parallelism). Evaluation computes metrics on the last stage, which then needs the
    inputs and the targets. A V schedule puts the first and the last stage on one rank; one
    process holds every stage.

    Args:
        pipe: The pipeline.
        evaluating: For evaluation (metrics on the last stage) instead of training.

    Returns:
        This rank's needs.
    """
    ctx = pipe.context
    if not ctx.distributed:
        return Needs(True, True)
    placement = pipe.schedule.placement
    first, last = placement[0] == ctx.pp_rank, placement[-1] == ctx.pp_rank
    if evaluating:
        return Needs(first or last, last)
    if pipe.loss_fn is not None:
        return Needs(first, last)
    return Needs(first or (last and ctx.dp_size > 1), False)


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
