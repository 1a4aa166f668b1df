"""Time one unit on one micro-batch: F, B, W and the whole backward, and size its bytes (the
measured source of :class:`~conveyor.planning.costs.UnitCost`).

The unit's F, B and W are timed the way the runtime runs them (``LinearWeightStore``
capture, ``backward_input``, ``flush``), and its whole backward the
way non-split schedules run it. Times are medians over ``repeats`` after ``warmup`` runs.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from conveyor.planning.costs import UnitCost
from conveyor.runtime.call import StageCaller
from conveyor.runtime.compute import LossFn, grad_leaves
from conveyor.runtime.deferred_linear import LinearWeightStore
from conveyor.runtime.ends import model_loss
from conveyor.runtime.memory import ActivationMeter
from conveyor.runtime.split_backward import backward_input


def _loss(loss_fn: LossFn | None, out: Any, target: Any) -> torch.Tensor | None:
    """The loss the last unit differentiates: a pair's total (its count only scales it)."""
    if loss_fn is None:
        return None
    result = loss_fn(out, target)
    loss: torch.Tensor = result[0] if isinstance(result, tuple) else result
    return loss


def own_loss(out: Any, target: Any) -> torch.Tensor:
    """The loss a model computes itself (``loss_fn=None``), read from its output as the
    pipeline reads it; ``target`` is unused (the labels are among the inputs)."""
    return model_loss(out)


class Clock:
    """Wall-clock seconds that include the work queued on ``device``.

    Args:
        device: Where the measured work runs; on CUDA every reading synchronizes first.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        """Seconds since an arbitrary start, after the device's queued work is done.

        Returns:
            ``time.perf_counter()`` after a synchronize on CUDA.
        """
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def measure_unit(
    index: int,
    unit: nn.Module,
    value: Any,
    target: Any,
    loss_fn: LossFn | None,
    repeats: int,
    warmup: int,
    clock: Clock,
) -> tuple[UnitCost, Any]:
    """Time and size one unit on one micro-batch.

    Gradients already in the unit's ``.grad`` are left as they were.

    Args:
        index: The unit's position in the model (unit 0 receives the model input).
        unit: The unit's module.
        value: Its input: the micro-batch, or the previous unit's output.
        target: The micro-batch's targets (used only with ``loss_fn``).
        loss_fn: The loss, for the last unit only; other units backward from ones.
        repeats: Timed runs; the median is kept.
        warmup: Untimed runs before them.
        clock: What times the runs.

    Returns:
        The unit's profile and its output, detached (the next unit's input).
    """
    first = index == 0
    params: list[torch.Tensor] = [p for p in unit.parameters() if p.requires_grad]
    store = LinearWeightStore(params)
    keep = [p.grad for p in params]
    call = StageCaller()

    def forward(split: bool) -> tuple[Any, list[torch.Tensor], list[torch.Tensor], Any]:
        x = _fresh(value)
        ins = grad_leaves(x)
        if split:
            with store.capture((0, 0)):
                out = call(index, unit, x, first)
                loss = _loss(loss_fn, out, target)
        else:
            out = call(index, unit, x, first)
            loss = _loss(loss_fn, out, target)
        outs = [loss] if loss is not None else grad_leaves(out)
        return out, ins, outs, loss

    def out_grads(outs: list[torch.Tensor], loss: Any) -> list[torch.Tensor] | None:
        return None if loss is not None else [torch.ones_like(o) for o in outs]

    f_split, f_plain, b_in, b_w, b_all = [], [], [], [], []
    for r in range(warmup + repeats):
        t0 = clock.now()
        out, ins, outs, loss = forward(split=True)
        t1 = clock.now()
        grads = out_grads(outs, loss)
        if outs:
            backward_input(outs, grads, ins)
        t2 = clock.now()
        store.flush([(0, 0)])
        t3 = clock.now()
        out, ins, outs, loss = forward(split=False)
        t4 = clock.now()
        grads = out_grads(outs, loss)
        if outs:
            torch.autograd.backward(outs, grads)
        t5 = clock.now()
        if r >= warmup:
            f_split.append(t1 - t0)
            b_in.append(t2 - t1)
            b_w.append(t3 - t2)
            f_plain.append(t4 - t3)
            b_all.append(t5 - t4)
    for p, g in zip(params, keep, strict=True):
        p.grad = g

    meter = ActivationMeter(unit.parameters())  # the bytes autograd saves, as a step counts
    with meter.hooks():
        out, _, _, _ = forward(split=False)
    saved = meter.taken
    med = statistics.median
    layer = UnitCost(
        name=f"unit {index}: {_describe(unit)}",
        forward=med(f_split),
        forward_plain=med(f_plain),
        backward_input=med(b_in),
        backward_weight=med(b_w),
        backward=med(b_all),
        activations=saved,
        parameters=sum(p.numel() * p.element_size() for p in unit.parameters()),
        output=_nbytes(out) if loss_fn is None else 0,
        params=sum(p.numel() for p in unit.parameters()),
        tensors=len(params),
        input=0 if first else _nbytes(value),
    )
    detached = pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out)
    return layer, detached


def _nbytes(value: Any) -> int:
    return sum(
        x.numel() * x.element_size()
        for x in pytree.tree_leaves(value)
        if isinstance(x, torch.Tensor)
    )


def _fresh(value: Any) -> Any:
    """Detached copy of ``value`` whose float tensors require grad (a received input)."""

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.detach()
            if x.is_floating_point():
                x.requires_grad_(True)
        return x

    return pytree.tree_map(leaf, value)


def _describe(unit: nn.Module) -> str:
    children = list(unit.named_children())
    if len(children) == 1:
        name, child = children[0]
        return f"{name} ({type(child).__name__})"
    return type(unit).__name__


__all__ = ["Clock", "LossFn", "measure_unit", "own_loss"]
