"""Calling one stage on one micro-batch, with inputs it modifies in place copied first.

A stage input that needs a gradient is an autograd leaf (it arrived from another stage),
and autograd forbids in-place operations on such a leaf. In the unsplit model the same
value came out of an operation, so ``ReLU(inplace=True)``, ``x += y`` or a ``silu_`` at the
start of a stage was fine there. The first time a stage runs on inputs that need a
gradient it gets copies of them; if the copies' version counters moved (the stage
modified an input or a view of it in place), the stage keeps getting copies, else the
originals from then on. The gradients are the same either way: a copy passes its gradient
straight back to the original.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree


def call_stage(stage: nn.Module, value: Any, first: bool) -> Any:
    """Call ``stage`` on ``value``; the first stage unpacks tuples and dicts like a model call."""
    if first and isinstance(value, tuple):
        return stage(*value)
    if first and isinstance(value, dict):
        return stage(**value)
    return stage(value)


class StageCaller:
    """Calls stages, copying the inputs of those that modify them in place (module doc)."""

    def __init__(self) -> None:
        self._modifies: dict[Hashable, bool] = {}

    def __call__(self, key: Hashable, stage: nn.Module, value: Any, first: bool) -> Any:
        """``stage(value)`` as :func:`call_stage`; ``key`` names the stage."""
        known = self._modifies.get(key)
        if known is False or (isinstance(value, torch.Tensor) and not value.requires_grad):
            return call_stage(stage, value, first)  # nothing to copy
        copies: list[torch.Tensor] = []

        def copy(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf:
                x = x.clone()
                copies.append(x)
            return x

        out = call_stage(stage, pytree.tree_map(copy, value), first)
        if known is None and copies:
            self._modifies[key] = any(c._version > 0 for c in copies)
        return out
