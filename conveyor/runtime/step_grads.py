"""One step's gradients apart from those accumulated before it.

``.grad`` accumulates across steps, like ``backward()``. Reductions over ranks (tied
weights' sum, the data-parallel sum) and the step's final scaling (a pair loss's division
by its count) must act on this step's gradient only, so a step puts the earlier gradients
aside first (``.grad`` = None, no copy) and adds them back afterwards:
``.grad = before + reduced, scaled step``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from conveyor.runtime.sharding import local_shard


class StepGradients:
    """Puts the gradients of ``params`` aside for a step and adds them back after it."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._params = list({id(p): p for p in params if p.requires_grad}.values())
        self._before: list[torch.Tensor | None] | None = None

    def any(self) -> bool:
        """Whether some parameter holds a gradient (from an earlier step)."""
        return any(p.grad is not None for p in self._params)

    def put_aside(self) -> None:
        """Before the step: keep each ``.grad`` and set it to None."""
        self._before = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None

    @torch.no_grad()
    def add_back(self) -> None:
        """After the step: ``.grad = before + this step's gradient``."""
        before, self._before = self._before, None
        assert before is not None
        for p, old in zip(self._params, before, strict=True):
            if old is None:
                continue
            if p.grad is not None:
                old.add_(p.grad)
            p.grad = old

    @torch.no_grad()
    def scale(self, factor: float) -> None:
        """Multiply the gradients by ``factor`` (this step's alone between
        :meth:`put_aside` and :meth:`add_back`); nothing when it is 1."""
        if factor == 1.0:  # a scalar loss: every step, nothing to do
            return
        grads = [local_shard(p.grad) for p in self._params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    def give_back(self) -> None:
        """After a failed step: the gradients from before it, as they were."""
        before, self._before = self._before, None
        if before is not None:
            for p, old in zip(self._params, before, strict=True):
                p.grad = old
