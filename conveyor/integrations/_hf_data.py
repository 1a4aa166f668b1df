"""The batches :class:`~conveyor.integrations.transformers.PipelineTrainer` feeds a pipeline.

The order is the one ``transformers.Trainer`` gives on one process: a permutation from a
generator seeded with ``data_seed`` (else ``seed``) plus the epoch, as accelerate's
``SeedableRandomSampler`` draws it, cut into global batches of ``per_device_batch_size x
dp``. Each data-parallel replica takes its contiguous share of a global batch, which is
what several processes of the plain trainer get too (process i takes every i-th batch of
``per_device_batch_size``). Only ranks whose stages need the batch read it; the others get
an empty dict and never touch the dataset. The loader is a ``DataLoader`` over a batch
sampler of this rank's indices, so that a resumed run skips the batches already trained on
with accelerate's ``skip_first_batches``, as the plain trainer does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset

from conveyor.errors import ConfigError
from conveyor.pipeline import Pipeline
from conveyor.runtime.microbatch import Needs
from conveyor.training.data import index_batches
from conveyor.training.roles import needs, shard


class ReplicaBatches:
    """This rank's sample indices of each global batch: what ``ReplicaLoader`` iterates,
    as a batch sampler (accelerate's ``skip_first_batches`` skips the batches a resumed
    run already trained on by wrapping it).

    Args:
        n: The samples in the dataset.
        batch_size: The global batch (all replicas).
        shuffle: Draw a fresh permutation each epoch (else keep the dataset's order).
        seed: The permutation's seed (the epoch is added).
        drop_last: Leave out a last batch smaller than ``batch_size``.
        reads: Whether this rank reads the batches (else it gets an empty list for each).
        replicas: The data-parallel replicas.
        replica: This rank's replica.
        smallest: The smallest global batch the pipeline takes (a smaller last batch joins
            the one before).
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        reads: bool,
        replicas: int,
        replica: int,
        smallest: int,
    ) -> None:
        self.n = n
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.reads = reads
        self.replicas = replicas
        self.replica = replica
        self.smallest = smallest
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation for the next pass.

        Args:
            epoch: The epoch (0-based).
        """
        self.epoch = epoch

    def plan(self, epoch: int) -> list[list[int]]:
        """The global batches of ``epoch`` (sample indices), the same on every rank.

        Args:
            epoch: The epoch (0-based).

        Returns:
            Lists of sample indices.
        """
        seed = self.seed + epoch if self.shuffle else None
        batches = index_batches(self.n, self.batch_size, seed, self.drop_last)
        if len(batches) > 1 and len(batches[-1]) < self.smallest:
            tail = batches.pop()
            batches[-1] = batches[-1] + tail
        return batches

    def __len__(self) -> int:
        n, size = self.n, self.batch_size
        count = n // size if self.drop_last else -(-n // size)
        if count > 1 and not self.drop_last and n % size and n % size < self.smallest:
            count -= 1
        return count

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        self.epoch += 1  # like accelerate's sampler: the next pass is the next epoch
        for indices in self.plan(epoch):
            yield shard(indices, self.replicas, self.replica) if self.reads else []


class Unread(Dataset[Any]):
    """The dataset as a rank that reads no batch sees it: its length, and nothing else."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        raise IndexError("this rank reads no samples")


class ReplicaLoader(DataLoader[Any]):
    """A data loader for one rank of a pipeline replica, as ``transformers.Trainer`` uses one.

    A ``DataLoader`` over :class:`ReplicaBatches` (its ``batch_sampler``), so that
    accelerate's ``skip_first_batches`` resumes it mid-epoch as it resumes the plain
    trainer's loaders.

    Args:
        dataset: A map-style dataset of feature dicts.
        collate: The data collator.
        batch_size: The global batch (all replicas).
        shuffle: Draw a fresh permutation each epoch (else keep the dataset's order).
        seed: The permutation's seed (the epoch is added).
        drop_last: Leave out a last batch smaller than ``batch_size``.
        needs: What this rank needs from each batch.
        replicas: The data-parallel replicas.
        replica: This rank's replica.
        smallest: The smallest global batch the pipeline takes (a smaller last batch joins
            the one before).

    Raises:
        ConfigError: The dataset has no length.
    """

    def __init__(
        self,
        dataset: Any,
        collate: Callable[[list[Any]], Any],
        batch_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        needs: Needs,
        replicas: int,
        replica: int,
        smallest: int,
    ) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ConfigError(
                "PipelineTrainer needs a map-style dataset (with __len__ and __getitem__); "
                "an iterable dataset cannot be planned across pipeline ranks"
            )
        reads = needs.anything
        batches = ReplicaBatches(len(dataset), batch_size, shuffle, seed, drop_last, reads,
                                 replicas, replica, smallest)  # fmt: skip
        super().__init__(
            dataset if reads else Unread(len(dataset)),
            batch_sampler=batches,
            collate_fn=functools.partial(_collate, collate),
        )
        self.batches = batches

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s permutation for the next pass.

        Args:
            epoch: The epoch (0-based).
        """
        self.batches.set_epoch(epoch)

    def plan(self, epoch: int) -> list[list[int]]:
        """The global batches of ``epoch`` (sample indices), the same on every rank."""
        return self.batches.plan(epoch)

    def sizes(self) -> Iterator[int]:
        """The global batch size of each batch of the current epoch, in order."""
        for indices in self.batches.plan(self.batches.epoch):
            yield len(indices)


def _collate(collate: Callable[[list[Any]], Any], rows: list[Any]) -> Any:
    """A batch of ``rows``; a rank that reads nothing gets an empty dict."""
    return collate(rows) if rows else {}


def replica_loader(
    args: Any,
    pipe: Pipeline,
    dataset: Any,
    collate: Callable[[list[Any]], Any],
    per_replica: int,
    training: bool,
) -> ReplicaLoader:
    """The loader of ``dataset`` for this rank, as ``TrainingArguments`` ask.

    Args:
        args: The ``TrainingArguments``.
        pipe: The pipeline the batches feed.
        dataset: A map-style dataset of feature dicts.
        collate: The data collator.
        per_replica: The batch of one replica.
        training: Training data (shuffled per ``train_sampling_strategy``) or evaluation
            data (in order).

    Returns:
        The loader.

    Raises:
        ConfigError: A sampling strategy other than ``random`` or ``sequential``.
    """
    ctx = pipe.context
    replicas = ctx.dp_size if ctx.distributed else 1
    strategy = getattr(args, "train_sampling_strategy", "random")
    if training and strategy not in ("random", "sequential"):
        raise ConfigError(
            f"PipelineTrainer samples 'random' or 'sequential', not {strategy!r}; set "
            f"train_sampling_strategy accordingly"
        )
    return ReplicaLoader(
        dataset,
        collate,
        per_replica * replicas,
        shuffle=training and strategy == "random",
        seed=args.data_seed if args.data_seed is not None else args.seed,
        drop_last=args.dataloader_drop_last,
        needs=needs(pipe, evaluating=not training),
        replicas=replicas,
        replica=ctx.dp_rank if ctx.distributed else 0,
        smallest=replicas * pipe.microbatches,
    )
