"""Which batches each rank loads, and loading them.

Every rank plans the same global batches (lists of sample indices: a permutation seeded
by ``(seed, epoch)``, or the order of the user's ``DataLoader`` sampler) without touching
the data. Each data-parallel replica takes its contiguous share of every global batch, and
only the ranks whose stages need the inputs or the targets fetch and collate those samples;
the other ranks get ``(None, None)`` and never call the dataset.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
)

from conveyor.errors import ConfigError
from conveyor.pipeline import Pipeline
from conveyor.training.roles import needs, shard

Batch = tuple[Any, Any]


def as_batch(collated: Any) -> Batch:
    """``(inputs, targets)`` of a collated batch.

    A pair is ``(inputs, targets)``; a dict or a tensor is the inputs alone (labels inside
    a dict, as transformers models take them). Lists become tuples (a tuple is the model's
    positional arguments).

    Args:
        collated: What the collate function returned.

    Returns:
        The inputs and the targets (``None`` when the samples carry none).

    Raises:
        ConfigError: The batch is neither of those.
    """
    if isinstance(collated, (tuple, list)) and len(collated) == 2:
        return _tuples(collated[0]), _tuples(collated[1])
    if isinstance(collated, (dict, torch.Tensor)):
        return _tuples(collated), None
    kind = f"a {type(collated).__name__}"
    if isinstance(collated, (tuple, list)):
        kind += f" of {len(collated)}"
    raise ConfigError(
        f"a batch must be a pair (inputs, targets), a dict of inputs or a tensor, but the data "
        f"gave {kind}; make each sample (inputs, targets), e.g. a TensorDataset(x, y)"
    )


def _tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def structure(value: Any) -> str:
    """A batch's structure without sizes, e.g. ``(dict[input_ids, labels], None)``.

    Args:
        value: A batch, or a part of one.

    Returns:
        Its containers, keys and leaf kinds, in words.
    """
    if isinstance(value, tuple):
        return "(" + ", ".join(structure(v) for v in value) + ")"
    if isinstance(value, dict):
        return "dict[" + ", ".join(f"{k}: {structure(v)}" for k, v in value.items()) + "]"
    if isinstance(value, torch.Tensor):
        return "tensor"
    return "None" if value is None else type(value).__name__


def index_batches(n: int, size: int, seed: int | None, drop_last: bool) -> list[list[int]]:
    """One epoch's batches of sample indices.

    Args:
        n: samples in the dataset.
        size: samples per batch.
        seed: the seed of this epoch's shuffle; None keeps the dataset's order.
        drop_last: leave out a last batch smaller than ``size``.

    Returns:
        Index lists of ``size`` (the last one maybe smaller), the same on every rank.
    """
    if seed is not None:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    else:
        order = list(range(n))
    batches = [order[i : i + size] for i in range(0, n, size)]
    if drop_last and batches and len(batches[-1]) < size:
        batches.pop()
    return batches


class Batches:
    """The batches of one data source for one rank of a pipeline.

    Args:
        data: A map-style ``Dataset`` of samples, or a ``DataLoader`` over one.
        batch_size: The global batch (all replicas together) for a ``Dataset``; ignored
            for a ``DataLoader``, whose own batch is the global batch.
        pipe: The pipeline the batches feed.
        evaluating: Evaluation data: kept in order, every sample used (a last batch too
            small to give each replica ``microbatches`` samples joins the one before).
        seed: The seed of the shuffle (training data from a ``Dataset``, or a
            ``DataLoader`` with a ``RandomSampler``), combined with the epoch number.
        what: The argument's name, for errors.

    Raises:
        ConfigError: The data is not a map-style ``Dataset`` or ``DataLoader``, a batch
            size is missing, or a batch is too small for the replicas and micro-batches.
    """

    def __init__(
        self,
        data: Any,
        batch_size: int | None,
        pipe: Pipeline,
        evaluating: bool,
        seed: int,
        what: str,
    ) -> None:
        self.evaluating = evaluating
        self.seed = seed
        self.what = what
        self.needs = needs(pipe, evaluating)
        ctx = pipe.context
        self.replicas, self.replica = (ctx.dp_size, ctx.dp_rank) if ctx.distributed else (1, 0)
        self.smallest = self.replicas * pipe.microbatches
        self._first: str | None = None
        self._sampler: Any = None
        self._loader_options: dict[str, Any] = {}
        if isinstance(data, DataLoader):
            self._from_loader(data)
        elif isinstance(data, Dataset) and not isinstance(data, IterableDataset):
            if batch_size is None:
                raise ConfigError(
                    f"{what} is a Dataset, so fit needs batch_size= (the global batch, all "
                    f"replicas together), e.g. batch_size=64"
                )
            self._check_size(batch_size)
            self.dataset: Any = data
            self.batch_size = batch_size
            self.shuffle = not evaluating
            self.drop_last = not evaluating
            self.collate: Callable[[list[Any]], Any] = default_collate
        else:
            raise ConfigError(
                f"{what} must be a map-style torch Dataset of (inputs, targets) samples or a "
                f"DataLoader over one, got {type(data).__name__}; wrap tensors as "
                f"TensorDataset(x, y)"
            )
        if not hasattr(self.dataset, "__len__"):
            raise ConfigError(f"{what}'s dataset has no len(); give it __len__")
        self.steps_per_epoch = len(self.plan(0))
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"{what} has {len(self.dataset)} samples, fewer than one batch of "
                f"{self.batch_size}; use a smaller batch or more data"
            )

    def _check_size(self, size: int) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < self.smallest:
            raise ConfigError(
                f"batch_size must be an int of at least {self.smallest} ({self.replicas} "
                f"replica(s) x {self.smallest // self.replicas} micro-batches), got {size!r}"
            )

    def _from_loader(self, loader: DataLoader[Any]) -> None:
        if isinstance(loader.dataset, IterableDataset):
            raise ConfigError(
                f"{self.what} is a DataLoader over an IterableDataset, whose batches cannot be "
                f"planned without reading them; use a map-style Dataset (with __getitem__ and "
                f"__len__)"
            )
        if loader.batch_size is None and loader.batch_sampler is None:
            raise ConfigError(
                f"{self.what} is a DataLoader without batch_size; give it batch_size= (the "
                f"global batch)"
            )
        self.dataset = loader.dataset
        self.collate = loader.collate_fn
        self.batch_size = loader.batch_size or 0
        self.drop_last = loader.drop_last
        sampler = loader.sampler
        plain = loader.batch_size is not None
        if plain and type(sampler) is RandomSampler and not sampler.replacement:
            self.shuffle = True
            if loader.generator is not None:
                self.seed = int(loader.generator.initial_seed()) % 2**62
        elif plain and type(sampler) is SequentialSampler:
            self.shuffle = False
        else:  # the user's own (batch) sampler, asked for each epoch's order
            self.shuffle = False
            self._sampler = loader.batch_sampler
        if plain:
            self._check_size(self.batch_size)
        self._loader_options = {
            "num_workers": loader.num_workers,
            "pin_memory": loader.pin_memory,
            "timeout": loader.timeout,
            "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context,
            "persistent_workers": loader.persistent_workers,
        }
        if loader.num_workers > 0:
            self._loader_options["prefetch_factor"] = loader.prefetch_factor

    def plan(self, epoch: int) -> list[list[int]]:
        """The global batches of ``epoch`` (sample indices), the same on every rank."""
        if self._sampler is not None:
            inner = getattr(self._sampler, "sampler", None)
            for holder in (self._sampler, inner):
                set_epoch = getattr(holder, "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(epoch)
            batches = [list(b) for b in self._sampler]
        else:
            seed = self.seed * 1_000_003 + epoch if self.shuffle else None
            batches = index_batches(len(self.dataset), self.batch_size, seed, self.drop_last)
        if batches and len(batches[-1]) < self.smallest:
            if self.evaluating and len(batches) > 1:
                tail = batches.pop()
                batches[-1] = batches[-1] + tail
            elif self.evaluating or not self.drop_last:
                raise ConfigError(
                    f"{self.what}'s last batch has {len(batches[-1])} samples, fewer than "
                    f"{self.smallest} ({self.replicas} replica(s) x "
                    f"{self.smallest // self.replicas} micro-batches); use drop_last=True or "
                    f"a batch size that divides the data"
                )
        return batches

    def epoch(
        self, epoch: int, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[Any, Any, int]]:
        """This rank's batches ``start`` to ``stop`` of ``epoch``.

        Ranks that need neither inputs nor targets get ``(None, None)`` and read nothing.

        Args:
            epoch: The epoch (0-based): its shuffle.
            start: The first batch (a resumed run skips the ones it trained on).
            stop: One past the last batch (default: the epoch's end).

        Yields:
            ``(inputs, targets, samples)``: inputs and targets each ``None`` where this
            rank does not need them, and the global batch's size.
        """
        plan = self.plan(epoch)[start:stop]
        sizes = [len(b) for b in plan]
        if not self.needs.anything:
            for size in sizes:
                yield None, None, size
            return
        mine = [shard(b, self.replicas, self.replica) for b in plan]
        # A generator of its own: a DataLoader draws its workers' base seed from it, which
        # would otherwise move the global generator (dropout) at every epoch and resume.
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch + 1)
        loader = DataLoader(
            self.dataset,
            batch_sampler=mine,
            collate_fn=self.collate,
            generator=gen,
            **self._loader_options,
        )
        for step, (collated, size) in enumerate(zip(loader, sizes, strict=True), start):
            inputs, targets = as_batch(collated)
            self._check_structure((inputs, targets), step, epoch)
            yield (
                inputs if self.needs.inputs else None,
                targets if self.needs.targets else None,
                size,
            )

    def _check_structure(self, batch: Batch, step: int, epoch: int) -> None:
        shape = structure(batch)
        if self._first is None:
            self._first = shape
        elif shape != self._first:
            raise ConfigError(
                f"{self.what}'s batch {step} of epoch {epoch} has another structure than its "
                f"first batch ({shape} instead of {self._first}); make every batch alike (the "
                f"same keys and tuple lengths), e.g. with a collate_fn"
            )
