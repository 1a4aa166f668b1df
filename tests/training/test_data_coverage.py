"""Nothing lost, nothing repeated: over the data-parallel replicas, every sample is read
exactly once per epoch, on the side that feeds the inputs (the rank holding stage 0) and on
the side that feeds the targets (the rank holding the last stage), also when a global batch
does not divide by the replicas, in ``conveyor.Trainer``'s training and evaluation batches
and in ``PipelineTrainer``'s loaders. A user's ``DistributedSampler`` moves to each epoch.

The loaders run here in one process, as each rank of a (pp 2 x dp R) world runs them: a
rank's context says which replica and pipeline rank it is; the loaders never communicate.
Each sample's inputs and targets both hold its index, so what a rank collated says which
samples it read. ``tests/training/test_trainer.py`` runs the same over real processes.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from conveyor.context import Context
from conveyor.integrations._hf_data import replica_loader
from conveyor.training.data import Batches
from conveyor.training.roles import shard


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i is (inputs [i, i], target i)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(i), float(i)]), torch.tensor(i)


class Features(Indexed):
    """Sample i as a transformers feature dict (the labels inside)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"input_ids": torch.tensor([i, i]), "labels": torch.tensor([i, i])}


def rank_of(replicas: int, replica: int, pp_rank: int, loss_fn: Any = "mse") -> Any:
    """What the loaders read of a pipeline: rank (``replica``, ``pp_rank``) of pp 2 x dp
    ``replicas``, 2 micro-batches, stage 0 on pipeline rank 0 and stage 1 on rank 1."""
    ctx = Context(
        rank=replica * 2 + pp_rank, world_size=2 * replicas, pp_rank=pp_rank, pp_size=2,
        dp_rank=replica, dp_size=replicas, device=torch.device("cpu"), backend="gloo",
        distributed=True, timeout=60.0,
    )  # fmt: skip
    return SimpleNamespace(
        context=ctx, schedule=SimpleNamespace(placement=(0, 1)), loss_fn=loss_fn, microbatches=2
    )


def ids(value: Any) -> list[int]:
    """The sample indices in a collated inputs or targets value (one per row)."""
    if value is None:
        return []
    if isinstance(value, dict):
        value = value["labels"] if "labels" in value else value["input_ids"]
    rows = value if value.dim() == 1 else value[:, 0]
    return [int(v) for v in rows]


@pytest.mark.parametrize(("n", "batch", "replicas"), [(45, 15, 2), (51, 17, 3), (40, 10, 4)])
def test_training_batches_read_every_sample_once_per_epoch(
    n: int, batch: int, replicas: int
) -> None:
    for epoch in (0, 1):
        inputs: Counter[int] = Counter()
        targets: Counter[int] = Counter()
        shares = []
        for replica in range(replicas):
            first = Batches(Indexed(n), batch, rank_of(replicas, replica, 0), False, 3, "train")
            last = Batches(Indexed(n), batch, rank_of(replicas, replica, 1), False, 3, "train")
            seen = [ids(x) for x, y, size in first.epoch(epoch)]
            assert [y for _, y, _ in first.epoch(epoch)] == [None] * (n // batch)  # inputs only
            inputs.update(i for rows in seen for i in rows)
            targets.update(i for _, y, _ in last.epoch(epoch) for i in ids(y))
            shares.append([len(rows) for rows in seen])
        assert inputs == targets == Counter(range(n)), (epoch, inputs, targets)
        for sizes in zip(*shares, strict=True):  # each global batch: as even as can be
            assert sum(sizes) == batch and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("n", "batch", "replicas"), [(19, 8, 2), (23, 10, 3), (17, 15, 2)])
def test_evaluation_batches_read_every_sample_once(n: int, batch: int, replicas: int) -> None:
    """Evaluation keeps every sample: a tail too small for the replicas' micro-batches
    joins the batch before, and the joined batch is cut over the replicas too."""
    inputs: Counter[int] = Counter()
    targets: Counter[int] = Counter()
    for replica in range(replicas):
        first = Batches(Indexed(n), batch, rank_of(replicas, replica, 0), True, 0, "eval")
        last = Batches(Indexed(n), batch, rank_of(replicas, replica, 1), True, 0, "eval")
        inputs.update(i for x, _, _ in first.epoch(0) for i in ids(x))
        for x, y, _ in last.epoch(0):  # metrics on the last stage: it reads both
            assert ids(x) == ids(y)
            targets.update(ids(y))
    assert inputs == targets == Counter(range(n))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize(("n", "per_replica", "replicas"), [(33, 7, 2), (50, 4, 3)])
def test_pipeline_trainer_loaders_read_every_sample_once(
    n: int, per_replica: int, replicas: int, training: bool
) -> None:
    """PipelineTrainer's loaders (a dataset of feature dicts, labels inside): a global batch
    is per_replica x replicas, so the uneven cut is the last, partial one (5 of 33 over 2,
    2 of 50 over 3 joining the batch before), kept because drop_last is off. In training
    the last stage reads nothing (the model's loss needs no targets; the first stage
    tells it the rows), but takes as many steps."""
    args = SimpleNamespace(
        train_sampling_strategy="random", data_seed=None, seed=42, dataloader_drop_last=False
    )
    read: list[Counter[int]] = [Counter(), Counter()]
    steps: list[int] = [0, 0]
    for replica in range(replicas):
        for pp_rank in (0, 1):
            pipe = rank_of(replicas, replica, pp_rank, loss_fn=None)
            loader = replica_loader(args, pipe, Features(n), _stack, per_replica, training)
            loader.set_epoch(1)
            for batch in loader:
                steps[pp_rank] += 1
                read[pp_rank].update(ids(batch) if batch else [])
    assert read[0] == Counter(range(n))
    assert read[1] == (Counter() if training else Counter(range(n)))
    assert steps[0] == steps[1] > 0


def _stack(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}


@pytest.mark.parametrize("size", range(0, 12))
@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 5])
def test_shard_cuts_a_batch_into_contiguous_near_equal_parts(size: int, replicas: int) -> None:
    batch = [100 + i for i in range(size)]
    parts = [shard(batch, replicas, r) for r in range(replicas)]
    assert [i for p in parts for i in p] == batch  # in order: nothing lost or repeated
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [len(p) for p in parts] == sorted((len(p) for p in parts), reverse=True)


def test_a_users_distributed_sampler_moves_to_each_epoch() -> None:
    """Each epoch's batches are the sampler's order for that epoch (set_epoch is called),
    not epoch 0's again."""
    data = Indexed(24)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    batches = Batches(loader, None, rank_of(1, 0, 0), False, 0, "train")
    orders = [[i for x, _, _ in batches.epoch(epoch) for i in ids(x)] for epoch in range(3)]
    expected = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        expected.append(list(sampler))
    assert orders == expected
    assert orders[0] != orders[1] != orders[2]
    assert sorted(orders[1]) == list(range(24))
