"""Backward split in two: B (input gradients, now) and W (weight gradients, later).

As the Zero Bubble paper's implementation does, only the weight GEMMs wait for W. B is one
ordinary autograd backward of the stage, into its inputs and into every parameter,
that frees the micro-batch's graph as it goes: the deferred calls
(:mod:`conveyor.runtime.deferred_linear`: linear layers, convolutions, experts' linears)
return no weight gradient and leave their input and output gradient in the store instead,
and every other weight (norms, embeddings, a position parameter, a weight whose gradient
reads the op's output) gets its gradient here, added to ``.grad``. So from B to W a
micro-batch holds only what its weights' backward reads
(:mod:`conveyor.runtime.deferred_grads` lists it per op kind), and W is the deferred
GEMMs alone (:meth:`~conveyor.runtime.deferred_linear.LinearWeightStore.flush`).

A weight used twice in one stage leaves one entry per use (each adds its own part); a
weight used by a deferred call and by another op gets the other op's part in B and the
call's in W. Compiled stages (``Pipeline(compile=...)``): a compiled region's backward is
one node; its linear GEMMs stay outside the compiled graphs
(:mod:`conveyor.runtime.opaque_linear`) and hand (X, dY) to the store while B's
``collect`` block is open, and every other gradient of the region comes from B's call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

Collect = Callable[[bool], contextlib.AbstractContextManager[Any]]
"""``collect(True)`` keeps compiled linears' (X, dY) for W, ``collect(False)`` drops them."""


def _no_collect(keep: bool) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def backward_input(
    outputs: list[torch.Tensor],
    grads: list[torch.Tensor] | None,
    inputs: list[torch.Tensor],
    collect: Collect = _no_collect,
) -> list[torch.Tensor | None]:
    """B: the gradients of ``inputs`` (None where an input gets none), with every
    parameter gradient that is not deferred to W added to its ``.grad``; the graph of
    ``outputs`` is freed.

    An ordinary backward (the deferred calls return no weight gradient): parameters get
    theirs as autograd accumulates them, FSDP's hooks gather and reshard as they do for any
    backward. ``inputs`` are leaves (a stage's received values); ``collect``: the store's
    sink for compiled linears (module doc)."""
    if not outputs:
        return [None] * len(inputs)
    wanted = [x for x in inputs if x.requires_grad]
    # The leaves' .grad are read and then restored: a gradient is only handed on.
    before = [x.grad for x in wanted]
    for x in wanted:
        x.grad = None
    with collect(True):
        torch.autograd.backward(outputs, grads)
    found: dict[int, torch.Tensor | None] = {}
    for x, old in zip(wanted, before, strict=True):
        found[id(x)], x.grad = x.grad, old
    return [found.get(id(x)) for x in inputs]
