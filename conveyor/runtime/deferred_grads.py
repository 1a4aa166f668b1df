"""What a micro-batch keeps from its B until its W, and what W does with it.

Under a split backward, B computes every gradient except the weight gradients of the
deferred operations (:mod:`conveyor.runtime.deferred_linear`), and the autograd graph is
freed at B. Each deferred call leaves one entry here: the weight's input and output
gradient, the two tensors its weight gradient reads, and nothing else of the graph. W adds
each entry's weight gradient into ``.grad`` in place, one micro-batch at a time, and drops
the entry as soon as it is used (no concatenated copy of several micro-batches).

What is kept, per op kind (one entry per call; tensors shared between entries, such as the
one input of a query, key and value projection, are kept once):

- linear (``F.linear``, ``x @ weight``, ``torch.addmm``): its input ``X`` and output
  gradient ``dY`` (``dW = dYᵀ X``, ``db = Σ dY``);
- convolution: its input and output gradient (``torch.nn.grad.conv*d_weight``);
- an expert's linear on one expert of a parameter (``experts.w[e]``): the same, added into
  that expert's part of the gradient.

Every other weight (norms, embeddings, positions, weights of operations without an entry
kind) gets its gradient in B, from the same backward call that computes the input
gradients, so nothing of it is kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def add_grad(param: torch.Tensor, index: Any, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``param.grad`` (to its ``[index]`` part when ``index`` is not
    None), in the parameter's dtype; the first gradient is taken as it is."""
    grad = grad.to(param.dtype)
    if index is None:
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)
        return
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    param.grad[index].add_(grad)


@dataclass
class LinearGrad:
    """A linear call's weight gradient to come: ``weight[index]`` (``index`` None: the
    whole weight) and ``bias`` get ``dYᵀ X`` (``Xᵀ dY`` for ``x @ weight``:
    ``transposed``) and ``Σ dY``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    x: torch.Tensor
    dy: torch.Tensor
    index: Any = None
    transposed: bool = False

    def kept(self) -> tuple[torch.Tensor, ...]:
        """The tensors held for W."""
        return self.x, self.dy

    def add(self) -> None:
        """Add the weight (and bias) gradient; one GEMM, into ``.grad`` in place where
        the dtypes allow."""
        x = self.x.reshape(-1, self.x.shape[-1])
        dy = self.dy.reshape(-1, self.dy.shape[-1])
        weight, index = self.weight, self.index
        left, right = (x.t(), dy) if self.transposed else (dy.t(), x)
        if index is None and dy.dtype == weight.dtype and weight.grad is not None:
            weight.grad.addmm_(left, right)
        else:  # the first gradient, an expert's part, or autocast's low-precision GEMM
            add_grad(weight, index, left @ right)
        if self.bias is not None:
            add_grad(self.bias, index, dy.sum(0, dtype=self.bias.dtype))


ConvWeight = Callable[..., torch.Tensor]


@dataclass
class ConvGrad:
    """A convolution's weight gradient to come (``torch.nn.grad.conv{1,2,3}d_weight``
    with the call's stride, padding, dilation and groups)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    x: torch.Tensor
    dy: torch.Tensor
    of_weight: ConvWeight
    spec: tuple[Any, Any, Any, int]

    def kept(self) -> tuple[torch.Tensor, ...]:
        """The tensors held for W."""
        return self.x, self.dy

    def add(self) -> None:
        """Add the weight (and bias) gradient."""
        stride, padding, dilation, groups = self.spec
        shape = self.weight.shape
        gw = self.of_weight(self.x, shape, self.dy, stride, padding, dilation, groups)
        add_grad(self.weight, None, gw)
        if self.bias is not None:
            dims = [d for d in range(self.dy.dim()) if d != 1]
            add_grad(self.bias, None, self.dy.sum(dims, dtype=self.bias.dtype))


Entry = LinearGrad | ConvGrad


@torch.no_grad()
def run(entries: list[Entry]) -> None:
    """W of one micro-batch: each entry's gradient added, and the entry dropped as soon as
    it is used (its input and output gradient freed unless another entry shares them)."""
    entries.reverse()  # popped from the end: the order they were kept in
    while entries:
        entries.pop().add()
