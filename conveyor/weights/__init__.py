"""Models bigger than one process: built without memory (the meta device), then given
values where they are held, from their own initialization or from a checkpoint.

:func:`empty_weights` builds; :class:`conveyor.Pipeline` (``weights=``, ``init_seed=``)
materializes each rank's own stages; :func:`materialize` does the same for a whole model
on one device, by the same rules, so it is the reference the pipeline's weights equal.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from conveyor.weights.converted import converted
from conveyor.weights.empty import empty_weights, has_meta
from conveyor.weights.fill import check, fill
from conveyor.weights.plan import wanted
from conveyor.weights.sources import Source, open_source

Weights = str | os.PathLike[str] | None
"""``weights=``: a checkpoint path, or None to initialize."""

__all__ = ["Pending", "Weights", "empty_weights", "give_values", "has_meta", "materialize"]


def materialize(
    model: nn.Module,
    weights: Weights = None,
    init_seed: int = 0,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Make a model built under :func:`empty_weights` (or ``torch.device("meta")``) real,
    in place: the unsplit model with exactly the values a :class:`conveyor.Pipeline` of any
    layout gives it.

    Args:
        model: The model; its meta parameters and buffers get values, real ones are kept
            (with ``weights``, every state-dict entry is loaded).
        weights: A conveyor or transformers checkpoint to load; None: each module's own
            initialization (``reset_parameters()``, a transformers model's
            ``_init_weights``) with torch's RNG seeded from ``(init_seed, module name)``.
        init_seed: The seed of that initialization.
        device: Where the new tensors go (default: the CPU).

    Returns:
        ``model``, for chaining.

    Raises:
        ConfigError: a meta tensor nothing can initialize (named).
        CheckpointError: ``weights`` lacks a tensor or holds another shape (named).
    """
    target = torch.device(device) if device is not None else torch.device("cpu")
    give_values(model, [model], target, weights, init_seed)
    return model


class Pending:
    """Values to give, planned while ties are still one object (before tensor parallelism
    or FSDP replace the parameters); :meth:`give` gives them."""

    def __init__(self, model: nn.Module, modules: list[nn.Module], weights: Weights,
                 init_seed: int) -> None:  # fmt: skip
        self.model, self.init_seed = model, init_seed
        # A transformers checkpoint is read under the model's names, converted as
        # from_pretrained converts it (MoE experts stored one tensor per expert).
        self.source: Source | None = (
            converted(open_source(weights), model) if weights is not None else None
        )
        everything = self.source is not None
        whole = wanted(model, [model], everything)
        self.found = check(model, whole, self.source)
        self.plan = whole if modules == [model] else wanted(model, modules, everything)

    def give(self, device: torch.device, allocate: Callable[[], None] | None = None) -> None:
        """Fill the planned tensors on ``device``. ``allocate`` first makes meta tensors
        real (but unset) where something else owns their memory (FSDP)."""
        if allocate is not None:
            allocate()
        if self.plan:
            fill(self.model, self.plan, device, self.init_seed, self.source, self.found)


def give_values(
    model: nn.Module,
    modules: list[nn.Module],
    device: torch.device,
    weights: Weights,
    init_seed: int,
) -> None:
    """Fill ``modules`` (parts of ``model`` under its names: its stages, or itself): their
    meta tensors, and with ``weights`` every state-dict entry. Errors the whole model would
    raise are raised first, so every rank raises the same one."""
    Pending(model, modules, weights, init_seed).give(device)
