"""Divide a batch (tensor, tuple or dict of tensors) into micro-batches and merge back.

("Divide" is for batches; "split" means cutting a model into stages.)
"""

from __future__ import annotations

from typing import Any

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
            f"a batch of {n} cannot be split into {parts} micro-batches; use microbatches <= {n} "
            f"or a larger batch"
        )
    leaves, spec = pytree.tree_flatten(batch)
    pieces = [
        torch.tensor_split(x, parts) if isinstance(x, torch.Tensor) else [x] * parts for x in leaves
    ]
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(parts)]


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

