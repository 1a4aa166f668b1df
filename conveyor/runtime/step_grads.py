"""One step's gradients apart from those accumulated before it.

``.grad`` accumulates across steps, like ``backward()``. Reductions over ranks (tied
weights' sum, the data-parallel mean) must act on this step's gradient only, so a step
that reduces puts the earlier gradients aside first (``.grad`` = None, no copy) and adds
them back afterwards: ``.grad = before + reduced step``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class StepGradients:
    """Puts the gradients of ``params`` aside for a step and adds them back after it."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self._params = list({id(p): p for p in params if p.requires_grad}.values())
        self._before: list[torch.Tensor | None] | None = None

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

    def give_back(self) -> None:
        """After a failed step: the gradients from before it, as they were."""
        before, self._before = self._before, None
        if before is not None:
            for p, old in zip(self._params, before, strict=True):
                p.grad = old
