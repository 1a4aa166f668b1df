"""The stage ends under context parallelism: the ends a pipeline has otherwise (the
model's input and loss, or vocabulary parallelism's), with each micro-batch cut to this
process's share of the sequence on the way in (:class:`~conveyor.context_parallel.cut.Cut`)
and a predict step's outputs joined back into whole sequences on the way out.

Everything else is the inner ends': the loss of a cp rank's share is a partial sum over its
tokens, and the cp ranks add up like data-parallel replicas (the step's replica group is
dp x cp).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils import _pytree as pytree

from conveyor.context_parallel import layout
from conveyor.context_parallel.cut import Cut
from conveyor.runtime.ends import StageEnds
from conveyor.runtime.step_state import StepState

Gather = Callable[[Tensor], list[Tensor]]
"""Every cp rank's copy of a tensor of the same shape, by cp rank."""


class SequenceEnds:
    """``inner`` ends, the sequence cut by ``cut`` (module doc); ``gather`` collects a
    predict step's outputs from the cp ranks (None in one process, which holds them all)."""

    def __init__(self, inner: StageEnds, cut: Cut, gather: Gather | None) -> None:
        self.inner, self.cut, self.gather = inner, cut, gather
        self.every_rank = inner.every_rank
        self.routed = inner.routed
        self.forward_passes: frozenset[str] = getattr(inner, "forward_passes", frozenset())
        self._inputs: list[Any] | None = None

    def begin(self, state: StepState, inputs: list[Any] | None, targets: list[Any] | None) -> None:
        """Cut the micro-batches (the inner ends read this process's share: vocabulary
        parallelism embeds and scores it on every rank) and the targets a ``loss_fn``
        reads, then start the inner ends' step; a predict step's outputs are joined into
        whole sequences as the inner ends keep them."""
        if state.targets is not None:
            state.targets = [self._targets(m, t) for m, t in enumerate(state.targets)]
        if state.mode == "predict":
            state.outputs = _Joined(self._join)
        self.state = state
        self._inputs = None if inputs is None else [self.cut.inputs(v) for v in inputs]
        self.inner.begin(state, self._inputs, state.targets)

    def _targets(self, m: int, value: Any) -> Any:
        length = next(
            (
                t.size(1)
                for t in pytree.tree_leaves(value)
                if isinstance(t, Tensor) and t.dim() >= 2
            ),
            None,
        )
        return value if length is None else self.cut.targets(value, length)

    def first_input(self, m: int, value: Any) -> Any:
        """The inner ends' first input of this process's share of micro-batch ``m``."""
        cut = self._inputs[m] if self._inputs is not None else self.cut.inputs(value)
        return self.inner.first_input(m, cut)

    def input_grad(self, m: int, leaves: list[Tensor], grads: list[Any]) -> None:
        """The inner ends'."""
        self.inner.input_grad(m, leaves, grads)

    def last_output(self, m: int, out: Any, recomputing: bool = False) -> list[Tensor]:
        """The inner ends'."""
        return self.inner.last_output(m, out, recomputing)

    def _join(self, value: Any) -> Any:
        if not isinstance(value, Tensor) or value.dim() < 2:
            return value
        gather = self.gather
        # In one process every rank's share is stacked on the rows.
        parts = list(value.chunk(len(self.cut.ranks))) if gather is None else gather(value)
        return layout.join(parts, 1)

    def output_grad(self, m: int) -> list[Tensor] | None:
        """The inner ends'."""
        return self.inner.output_grad(m)

    def run_pass(self, step: Any) -> None:
        """The inner ends'."""
        self.inner.run_pass(step)


class _Joined(dict[int, Any]):
    """A predict step's outputs by micro-batch: each kept as whole sequences, joined from
    every cp rank's share (by ``join``) as the inner ends keep it."""

    def __init__(self, join: Callable[[Any], Any]) -> None:
        super().__init__()
        self.join = join

    def __setitem__(self, m: int, value: Any) -> None:
        super().__setitem__(m, pytree.tree_map(self.join, value))


def gather_over(group: dist.ProcessGroup, size: int) -> Gather:
    """:data:`Gather` over the cp ranks' ``group`` (an all-gather that every cp rank posts
    at the same point of the same program)."""

    def gather(t: Tensor) -> list[Tensor]:
        t = t.contiguous()
        whole = torch.empty((size * t.size(0), *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(whole, t, group=group)
        return list(whole.chunk(size))

    return gather
