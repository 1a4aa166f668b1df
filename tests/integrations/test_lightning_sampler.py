"""Which data each process of a ``PipelineStrategy`` run reads, checked for every rank of
a layout without starting processes: each of its contexts is built as ``conveyor.init``
would make it on that rank."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

pytest.importorskip("lightning")
pytest.importorskip("pytorch_lightning")

from conveyor.context import Context
from conveyor.integrations import lightning, pytorch_lightning
from conveyor.integrations._lightning.processes import sampler_arguments


def contexts(pp: int, dp: int, tp: int = 1) -> list[Context]:
    """Every rank's context: global rank (dp_rank * pp + pp_rank) * tp + tp_rank."""
    cpu = torch.device("cpu")
    world = pp * dp * tp
    ranks = [(d, p, t) for d in range(dp) for p in range(pp) for t in range(tp)]
    return [
        Context(
            rank=(d * pp + p) * tp + t,
            world_size=world,
            pp_rank=p,
            pp_size=pp,
            dp_rank=d,
            dp_size=dp,
            device=cpu,
            backend="gloo",
            distributed=True,
            timeout=60.0,
            tp_rank=t,
            tp_size=tp,
        )
        for d, p, t in ranks
    ]


@pytest.mark.parametrize(
    ("pp", "dp", "tp"), [(2, 4, 1), (4, 2, 1), (2, 2, 2), (2, 2, 1)],
    ids=["pp2xdp4", "pp4xdp2", "pp2xdp2xtp2", "pp2xdp2"],
)  # fmt: skip
@pytest.mark.parametrize("package", [lightning, pytorch_lightning], ids=lambda m: m.__name__)
def test_each_sample_is_read_once_per_epoch_by_one_replica(
    package: object, pp: int, dp: int, tp: int
) -> None:
    """Lightning's DistributedSampler with the strategy's arguments (shuffled, as Lightning
    reads training data): the replicas together read every sample exactly once per
    epoch, and every pipeline (and tensor-parallel) rank of a replica reads the same
    samples in the same order."""
    n = 96
    strategy = package.PipelineStrategy(pp=pp, dp=dp, tp=tp)  # type: ignore[attr-defined]
    read: dict[int, list[int]] = {}
    for ctx in contexts(pp, dp, tp):
        strategy.context = ctx
        kwargs = strategy.distributed_sampler_kwargs
        sampler = DistributedSampler(range(n), shuffle=True, seed=0, **kwargs)
        sampler.set_epoch(1)
        order = list(sampler)
        if ctx.dp_rank in read:  # another rank of this replica read it first
            assert order == read[ctx.dp_rank], (ctx.rank, ctx.dp_rank)
        read[ctx.dp_rank] = order
    assert sorted(read) == list(range(dp))
    every = sorted(i for order in read.values() for i in order)
    assert every == list(range(n))  # each sample once: none left out, none read twice


def test_one_process_reads_everything() -> None:
    assert sampler_arguments(None) == (1, 0)
