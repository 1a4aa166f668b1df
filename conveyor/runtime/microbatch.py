"""Divide a batch (tensor, tuple or dict of tensors) into micro-batches and merge back.

:class:`MicroBatches` is a step's batch as the runtime reads it, made once per step by
:func:`prepare` (a batch divided here) or :func:`prepare_cut` (micro-batches the user cut).

("Divide" is for batches; "split" means cutting a model into stages.)
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from conveyor.errors import ConfigError


def batch_size(batch: Any, what: str) -> int:
    """The common dim-0 size of every tensor in ``batch``."""
    if isinstance(batch, list):
        # A list would reach the first layer as one argument ('list' has no 'flatten').
        raise ConfigError(
            f"{what} is a list; pass a tensor, a tuple or a dict of tensors (inputs: a tuple "
            f"is the model's positional arguments, a dict its keyword arguments), e.g. "
            f"tuple({what})"
        )
    if isinstance(batch, torch.Tensor) and batch.dim():
        return int(batch.shape[0])
    leaves = [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    if not leaves:
        raise ConfigError(f"{what} holds no tensor; pass a tensor, or a tuple / dict of tensors")
    sizes = {int(x.shape[0]) if x.dim() else -1 for x in leaves}
    if len(sizes) != 1 or -1 in sizes:
        raise ConfigError(
            f"{what} tensors must share their first (batch) dimension, got sizes {sorted(sizes)}"
        )
    return sizes.pop()


def divide(batch: Any, parts: int, what: str) -> list[Any]:
    """``batch`` divided on dim 0 into ``parts`` micro-batches (sizes differ by at most one)."""
    n = batch_size(batch, what)
    if n < parts:
        raise ConfigError(
            f"a batch of {n} cannot be divided into {parts} micro-batches; use microbatches <= {n} "
            f"or a larger batch"
        )
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, parts))
    leaves, spec = pytree.tree_flatten(batch)
    pieces = [
        torch.tensor_split(x, parts) if isinstance(x, torch.Tensor) else [x] * parts for x in leaves
    ]
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(parts)]


def first(inputs: Any, microbatches: int, what: str = "inputs") -> Any:
    """The first of ``microbatches`` micro-batches of ``inputs`` (of fewer, when the batch
    has fewer rows): the sample a graph capture traces or a profile times."""
    size = batch_size(inputs, what)
    return divide(inputs, min(microbatches, size), what)[0]


def divide_for(
    value: Any, parts: int, what: str, needed: bool, device: torch.device
) -> list[Any] | None:
    """``value`` divided into ``parts`` micro-batches on ``device``, for a rank that does
    (``needed``) or does not hold the stage reading it; None when not given.

    Raises:
        ConfigError: ``value`` is None but ``needed``, or it cannot be divided.
    """
    if value is None:
        if needed:
            raise missing(what)
        return None
    if isinstance(value, torch.Tensor):  # one move, then views of it
        return divide(value.to(device, non_blocking=True), parts, what)
    return [to_device(p, device) for p in divide(value, parts, what)]


def missing(what: str) -> ConfigError:
    """The error for a rank that holds a stage needing ``what`` but was given None."""
    return ConfigError(
        f"this rank holds a stage that needs {what}, but got {what}=None; pass the batch on "
        f"every rank (ranks without the first/last stage may pass None)"
    )


def merge(outputs: list[Any]) -> Any:
    """Concatenate micro-batch outputs (same structure) on dim 0; a scalar per micro-batch
    (a loss the model computed) becomes a tensor of one value per micro-batch."""
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    leaves = []
    for i, first in enumerate(flat[0][0]):
        if not isinstance(first, torch.Tensor):
            leaves.append(first)
        elif first.dim() == 0:
            leaves.append(torch.stack([f[0][i] for f in flat]))
        else:
            leaves.append(torch.cat([f[0][i] for f in flat]))
    return pytree.tree_unflatten(leaves, spec)


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor moved to ``device`` (no copy when already there)."""
    return pytree.tree_map(
        lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x, value
    )


@dataclass(frozen=True)
class Needs:
    """What a process passes to a step: the inputs, the targets, or neither (see
    :func:`needs`)."""

    inputs: bool
    targets: bool

    @property
    def anything(self) -> bool:
        """Whether this process reads batches at all."""
        return self.inputs or self.targets


def needs(first: bool, last: bool, mode: str, reads_targets: bool) -> Needs:
    """What a process reads of each batch, the one rule: the inputs where it holds the
    first stage; the targets where it holds the last stage and a ``loss_fn`` reads them
    (``reads_targets``; with ``loss_fn=None`` the model computes its loss from its
    inputs). ``mode`` is a step's (``train``, ``eval``, ``predict``: no targets), or
    ``metrics``: an evaluation whose metrics the last stage computes from the output, the
    inputs and the targets."""
    if mode == "metrics":
        return Needs(first or last, last)
    return Needs(first, last and reads_targets and mode != "predict")


@dataclass(frozen=True)
class MicroBatches:
    """One step's batch, divided: what each micro-batch is and how many rows it has.

    ``inputs`` / ``targets``: per micro-batch, on the device (None where this process does
    not read them); ``sizes``: rows per micro-batch, where this process got a batch (None
    elsewhere: the engine shares the first stage's with every pipeline rank); ``counts``:
    per micro-batch, the items a model's own token-averaged loss divides by (an integer
    tensor, counted from the labels in the inputs; None for other losses).
    """

    inputs: list[Any] | None
    targets: list[Any] | None
    sizes: tuple[int, ...] | None
    counts: torch.Tensor | None = None

    @property
    def rows(self) -> int | None:
        """The rows of the whole batch (None where this process got no batch)."""
        return None if self.sizes is None else sum(self.sizes)


class Header(NamedTuple):
    """What the first stage's batch tells every pipeline rank at a step's start
    (:func:`header_message`): its input shapes' signature, rows per micro-batch, and the
    counts of a model's own token loss (None for other losses)."""

    signature: int
    sizes: tuple[int, ...]
    counts: tuple[int, ...] | None

    @classmethod
    def read(cls, values: list[int], m: int) -> Header:
        """The header of ``m`` micro-batches that :func:`header_message` wrote."""
        counts = tuple(values[m + 2 :]) if values[m + 1] else None
        return cls(values[0], tuple(values[1 : m + 1]), counts)


def header_message(batch: MicroBatches, m: int, device: torch.device) -> torch.Tensor:
    """The header of ``batch`` (``m`` micro-batches) as one integer tensor on ``device``: a
    number that changes when the micro-batches' input shapes change, their rows (a scalar
    loss is weighted by them), and the counts of a model's own token loss
    (:attr:`MicroBatches.counts`)."""
    signature = 0
    if batch.inputs is not None:
        shapes = [
            (tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else repr(x)
            for mb in batch.inputs
            for x in ((mb,) if isinstance(mb, torch.Tensor) else pytree.tree_leaves(mb))
        ]
        signature = zlib.crc32(repr(shapes).encode())
    sizes = batch.sizes if batch.sizes is not None else (0,) * m
    has_counts = batch.counts is not None
    head = torch.tensor([signature, *sizes, int(has_counts)], dtype=torch.int64)
    counts = (
        batch.counts.to(torch.int64)
        if batch.counts is not None
        else torch.zeros(m, dtype=torch.int64, device=device)
    )
    return torch.cat([head.to(device), counts.to(device)])


Counter = Callable[[torch.Tensor], torch.Tensor]


def prepare(
    inputs: Any,
    targets: Any,
    parts: int,
    needs: Needs,
    device: torch.device,
    counter: Counter | None = None,
) -> MicroBatches:
    """A batch divided on dim 0 into ``parts`` micro-batches (sizes differ by at most one);
    ``counter`` counts the items of each micro-batch's ``labels`` input, if given.

    Raises:
        ConfigError: a needed value is None, or the batch cannot be divided.
    """
    mb_inputs = divide_for(inputs, parts, "inputs", needs.inputs, device)
    mb_targets = divide_for(targets, parts, "targets", needs.targets, device)
    return _described(mb_inputs, mb_targets if needs.targets else None, None, counter)


def _described(
    inputs: list[Any] | None,
    targets: list[Any] | None,
    sizes: tuple[int, ...] | None,
    counter: Counter | None,
) -> MicroBatches:
    given = inputs if inputs is not None else targets
    if sizes is None and given is not None:
        what = "inputs" if inputs is not None else "targets"
        sizes = tuple(batch_size(mb, what) for mb in given)
    counts = None
    if (
        counter is not None
        and inputs is not None
        and all(
            isinstance(mb, Mapping) and isinstance(mb.get("labels"), torch.Tensor) for mb in inputs
        )
    ):
        counts = torch.stack([counter(mb["labels"]) for mb in inputs])
    return MicroBatches(inputs, targets, sizes, counts)


def prepare_cut(
    microbatches: Sequence[Any],
    parts: int,
    needs: Needs,
    device: torch.device,
    counter: Counter | None = None,
) -> MicroBatches:
    """Micro-batches the user cut, ``[(inputs_0, targets_0), ...]``, each with its own
    shapes (e.g. bucketed by length).

    Raises:
        ConfigError: not a list of ``parts`` pairs, or a pair whose inputs and targets
            hold different numbers of rows.
    """
    if not isinstance(microbatches, (list, tuple)) or len(microbatches) != parts:
        got = len(microbatches) if isinstance(microbatches, (list, tuple)) else None
        raise ConfigError(
            f"microbatches= takes a list of exactly {parts} (inputs, targets) pairs (the "
            f"pipeline's microbatches={parts}), got "
            + (f"{got}" if got is not None else f"a {type(microbatches).__name__}")
            + "; cut the batch into that many, or build the Pipeline with their count"
        )
    sizes: list[int] = []
    mb_inputs: list[Any] = []
    mb_targets: list[Any] = []
    for i, pair in enumerate(microbatches):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ConfigError(
                f"microbatches[{i}] is a {type(pair).__name__}; each micro-batch is a pair "
                f"(inputs, targets) of tensors, tuples or dicts (targets None with "
                f"loss_fn=None)"
            )
        x, y = pair
        rows = [batch_size(v, f"microbatches[{i}] {w}") for v, w in ((x, "inputs"), (y, "targets"))
                if v is not None]  # fmt: skip
        if len(set(rows)) > 1:
            raise ConfigError(
                f"microbatches[{i}] holds {rows[0]} input rows but {rows[1]} target rows; "
                f"pass targets for the same samples as the inputs"
            )
        if needs.inputs and x is None:
            raise missing(f"microbatches[{i}] inputs")
        if needs.targets and y is None:
            raise missing(f"microbatches[{i}] targets")
        if rows:
            sizes.append(rows[0])
        mb_inputs.append(None if x is None else to_device(x, device))
        mb_targets.append(None if y is None else to_device(y, device))
    known = len(sizes) == parts
    return _described(
        mb_inputs if needs.inputs else None,
        mb_targets if needs.targets else None,
        tuple(sizes) if known else None,
        counter,
    )
