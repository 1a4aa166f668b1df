"""The work of one action on this process's stages: F, B, W, recompute and the loss.

:class:`StageCompute` knows nothing of ranks or transfers: the run loop hands it an
action's input and passes on what it returns. It keeps what a step needs between actions
(saved activations from F to B, the split backward's pending W work, recompute stashes).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from conveyor.errors import PipelineError
from conveyor.partition.describe import shape_of
from conveyor.runtime.call import StageCaller
from conveyor.runtime.compiled import CompileStats
from conveyor.runtime.deferred_linear import LinearWeightStore
from conveyor.runtime.ends import LossFn, StageEnds
from conveyor.runtime.memory import ActivationMeter
from conveyor.runtime.recompute import (
    discard_saved,
    replay_rng,
    rng_state,
    shape_only,
)
from conveyor.runtime.split_backward import backward_input
from conveyor.runtime.step_state import StepState
from conveyor.runtime.wire import TensorMeta
from conveyor.schedules import Action

__all__ = ["LossFn", "StageCompute", "grad_leaves"]


def grad_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of ``value`` that require gradients."""
    if isinstance(value, torch.Tensor):  # the common case, without a tree walk
        return [value] if value.requires_grad else []
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor) and x.requires_grad]


def _track_float(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        if x.requires_grad and x.is_leaf:
            return x  # already tracked (an input the first end made a leaf)
        return x.detach().requires_grad_()
    return x


class StageCompute:
    """Runs F, B and W of the stages this process holds (see the module doc)."""

    def __init__(
        self,
        stages: dict[int, nn.Module],
        last_stage: int,
        split_backward: bool,
        ends: StageEnds,
        device: torch.device,
        *,
        recompute: frozenset[int],
        autocast: torch.dtype | None,
        meter: ActivationMeter | None,
        compiled: CompileStats | None = None,
    ) -> None:
        self.stages = stages
        # Compiled stages: their compile time and graphs (their linear layers are routed
        # as compiled code needs).
        self.compiled = compiled
        self.last_stage = last_stage
        self.split_backward = split_backward
        # What the first stage reads and what the last stage's output becomes.
        self.ends = ends
        self.device = device
        self.recompute = frozenset(s for s in recompute if s in stages)
        self.autocast = autocast
        self.meter = meter
        # Neither option: the forward runs exactly the original, option-free code.
        self._plain = not self.recompute and autocast is None
        self.params: dict[int, list[torch.Tensor]] = {
            s: [p for p in stage.parameters() if p.requires_grad] for s, stage in stages.items()
        }
        self._store = LinearWeightStore(
            [p for ps in self.params.values() for p in ps], opaque=compiled is not None
        )
        self._call = StageCaller()
        # Per stage held here: 'dtype[shape]' of each value its first forward sent on.
        self.sent_shapes: dict[int, list[str]] = {}
        self.step = StepState("train")

    def begin(self, step: StepState) -> None:
        """Start a step: what it needs and builds is ``step``'s."""
        self.step = step

    def gathered(self, stage: int) -> None:
        """FSDP gathered ``stage``: its gathered tensors are what autograd sees this step,
        so the split backward and the meter work on them."""
        params: list[torch.Tensor] = [p for p in self.stages[stage].parameters() if p.requires_grad]
        self.params[stage] = params
        self._store.add_params(params)
        if self.meter is not None:
            self.meter.exclude(params)

    def gradient_metas(self, producer: Action) -> list[TensorMeta]:
        """Shapes of the gradients ``producer`` (a B of the next stage) sends here: those
        of the outputs this process's F of the same micro-batch saved."""
        saved = self.step.saved.get((producer.stage - 1, producer.microbatch))
        if saved is None:
            raise PipelineError(
                f"gradients for stage {producer.stage - 1} micro-batch {producer.microbatch} "
                f"are received before its forward ran; the schedule is inconsistent"
            )
        return [TensorMeta(tuple(t.shape), t.dtype, False) for t in saved[1]]

    # ----------------------------------------------------------------- F
    def forward(self, action: Action, value: Any) -> Any:
        """F of ``action``: ``value`` is the stage input (the micro-batch for stage 0);
        returns the output to pass on, or None on the last stage."""
        if self.compiled is None:
            return self._forward(action, value)
        with self.compiled.timing(action.stage):
            return self._forward(action, value)

    def _timing(self, stage: int) -> contextlib.AbstractContextManager[None]:
        """Compiled stages: count the compile time spent in the block as ``stage``'s."""
        if self.compiled is None:
            return contextlib.nullcontext()
        return self.compiled.timing(stage)

    def _forward(self, action: Action, value: Any) -> Any:
        s, m = action.stage, action.microbatch
        train = self.step.train
        if s == 0:
            value = self.ends.first_input(m, value)
            if train and self.split_backward:
                # Track the input's gradient (then dropped) so that B, not W, walks the
                # stage's input path: the first stage's B and W then cost what the
                # schedule assumes of every stage, instead of B nothing and W everything.
                value = pytree.tree_map(_track_float, value)
        in_leaves = grad_leaves(value) if train else []
        roots: list[torch.Tensor] | None = None
        if not self._plain:
            out, roots = self._forward_with_options(s, m, value)
        elif train and self.split_backward:
            with self._store.capture((s, m)):
                out = self._call(s, self.stages[s], value, s == 0)
        else:
            out = self._call(s, self.stages[s], value, s == 0)
        if s < self.last_stage:
            if s not in self.sent_shapes:
                values = out if isinstance(out, tuple) else (out,)
                self.sent_shapes[s] = [shape_of(v) for v in values]
            if train:
                outs = grad_leaves(out)
                if self.step.stash and (s, m) in self.step.stash:  # recomputed at B: shapes only
                    outs = [shape_only(t) for t in outs]
                self.step.saved[(s, m)] = (in_leaves, outs)
            return out
        if roots is None:
            roots = self.ends.last_output(m, out)
        if train:
            # A recomputed last stage keeps shapes only: B recomputes the loss too.
            if self.step.stash and (s, m) in self.step.stash:
                roots = [shape_only(t) for t in roots]
            self.step.saved[(s, m)] = (in_leaves, roots)
        return None

    def _forward_with_options(
        self, s: int, m: int, value: Any
    ) -> tuple[Any, list[torch.Tensor] | None]:
        """F under autocast and/or recompute; returns the output and, on the last stage,
        what its end made of it (:meth:`StageEnds.last_output`), under the same autocast."""
        recompute = self.step.train and s in self.recompute and (s, m) not in self.step.adjacent
        if recompute:
            self.step.stash[(s, m)] = (value, rng_state(self.device))
            if self.meter is not None:  # the kept input is what recompute holds
                self.meter.track(
                    [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]
                )
        capture = self.step.train and self.split_backward and not recompute
        roots = None
        with contextlib.ExitStack() as stack:
            if self.autocast is not None:
                stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast))
            if recompute:
                # Build the graph (outputs know which of them need gradients), save nothing.
                stack.enter_context(discard_saved())
            with self._store.capture((s, m)) if capture else contextlib.nullcontext():
                out = self._call(s, self.stages[s], value, s == 0)
            if s == self.last_stage:
                roots = self.ends.last_output(m, out)
        return out, roots

    def _rerun(self, s: int, m: int) -> list[torch.Tensor]:
        """B of a recompute stage: its forward again, from the kept input (the first
        stage's as its end gave it) and RNG state; returns the outputs to differentiate."""
        value, rng = self.step.stash[(s, m)]
        with contextlib.ExitStack() as stack:
            stack.enter_context(replay_rng(rng, self.device))
            if self.autocast is not None:
                stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast))
            split = self.split_backward
            with self._store.capture((s, m)) if split else contextlib.nullcontext():
                out = self._call(s, self.stages[s], value, s == 0)
            if s == self.last_stage:
                outs = self.ends.last_output(m, out, recomputing=True)
            else:
                outs = grad_leaves(out)
        # Dropped only now: an error in the forward above is then named a recompute.
        del self.step.stash[(s, m)]
        return outs

    def reruns(self, stage: int, microbatch: int) -> bool:
        """Whether B of (``stage``, ``microbatch``) is still to recompute its forward (after
        an error: whether that recompute failed)."""
        return (stage, microbatch) in self.step.stash

    # ----------------------------------------------------------------- B and W
    def backward(self, action: Action, grads: list[torch.Tensor] | None) -> Any:
        """B of ``action`` given the gradients of its outputs (None on the last stage);
        returns the input gradients to pass on, or None on the first stage."""
        if self.compiled is None:
            return self._backward(action, grads)
        with self.compiled.timing(action.stage):
            return self._backward(action, grads)

    def _backward(self, action: Action, grads: list[torch.Tensor] | None) -> Any:
        s, m = action.stage, action.microbatch
        in_leaves, outs = self.step.saved.pop((s, m))
        if self.step.stash and (s, m) in self.step.stash:
            outs = self._rerun(s, m)
        if self.split_backward:
            got = backward_input(outs, grads, in_leaves, self._store.collector((s, m)))
            del outs  # the graph is freed: what W needs is in the store
            self.step.pending_w.add((s, m))
            if self.meter is not None:
                self.meter.track(self._store.kept((s, m)))  # held until W
        else:
            if outs:
                torch.autograd.backward(outs, grads)
            got = [x.grad for x in in_leaves]
        if s == 0:
            self.ends.input_grad(m, in_leaves, list(got))
            return None
        return [
            g if g is not None else torch.zeros_like(x) for g, x in zip(got, in_leaves, strict=True)
        ]

    def weight_grads(self, stage: int, microbatches: list[int]) -> None:
        """W of ``stage`` for ``microbatches``: their kept weight gradients added."""
        keys = [(stage, m) for m in microbatches]
        for key in keys:
            self.step.pending_w.remove(key)
        with self._timing(stage):
            self._store.flush(keys)

    def leftovers(self) -> list[tuple[int, int]]:
        """(stage, micro-batch) whose activations or W work the step never consumed."""
        return [*self.step.saved, *self.step.pending_w]
