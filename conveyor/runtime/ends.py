"""The stage compute's two ends: what the first stage reads and what the last stage's
output becomes.

:class:`StageEnds` is the interface; :class:`ModelEnds`, the default, is the model's own
input and ``loss_fn`` (or the model's own loss). Another implementation may put work of
its own around the stages: passes of the schedule that every pipeline rank runs at the
same tick (:class:`~conveyor.schedules.core.Pass`, whose kinds the implementation
defines; :attr:`~conveyor.runtime.program.Tick.boundary`), a unit of parameters beside
the stages. Every method names its micro-batch: two of a rank's actions may run
interleaved (:mod:`~conveyor.runtime.overlap`), and a recomputed first-stage forward
runs inside its backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from conveyor.errors import ConfigError, PipelineError
from conveyor.losses import output_field
from conveyor.runtime.step_loss import LossTerm, RouterLoss, StepLoss, as_term, counted_term
from conveyor.runtime.step_state import StepState
from conveyor.schedules.core import Pass

LossFn = Callable[[Any, Any], Any]
"""``(output, target) -> scalar`` (a mean over the rows) or ``(total, count)``."""


class StageEnds(Protocol):
    """The two ends of this process's stage compute (module doc)."""

    every_rank: bool
    """Every pipeline rank reads the batch (inputs and targets), not only the rank holding
    the first stage (inputs) and the last (targets)."""

    routed: bool
    """The loss adds a router auxiliary term weighted per step
    (:class:`~conveyor.runtime.step_loss.RouterLoss`)."""

    forward_passes: frozenset[str]
    """The kinds of this implementation's passes that a forward-only step (eval, predict)
    runs; a training step runs every pass."""

    def begin(self, state: StepState, inputs: list[Any] | None, targets: list[Any] | None) -> None:
        """Start a step: its state and this rank's micro-batches (None where not read)."""

    def first_input(self, m: int, value: Any) -> Any:
        """What the first stage runs on for micro-batch ``m``, given its micro-batch."""

    def input_grad(self, m: int, leaves: list[torch.Tensor], grads: list[Any]) -> None:
        """The first stage's backward of ``m`` computed ``grads`` of its input ``leaves``."""

    def last_output(self, m: int, out: Any, recomputing: bool = False) -> list[torch.Tensor]:
        """What the last stage's output of ``m`` becomes (its loss term in the step's loss,
        the output of a predict step, or kept for a later pass); returns the tensors its
        backward differentiates. ``recomputing``: the backward's recompute of the forward,
        which only needs those tensors."""

    def output_grad(self, m: int) -> list[torch.Tensor] | None:
        """The gradients of :meth:`last_output`'s tensors of ``m`` (None: they are the
        loss, whose gradient is 1)."""

    def run_pass(self, step: Pass) -> None:
        """Run a pass of the schedule (a pipeline-wide step of its walk, which no rank's
        stage computes) on this rank."""


def model_loss(out: Any) -> torch.Tensor:
    """The loss a model computed itself (``loss_fn=None``), by one rule: the output if it
    is a one-element tensor; else its ``loss`` (a ``ModelOutput`` / dict entry or
    attribute); else, for a tuple or list (nanoGPT's ``(logits, loss)``), its one 0-dim
    floating-point tensor.

    Raises:
        ConfigError: none of these holds a loss, or a tuple holds several 0-dim tensors
            (names the output and the ``loss_fn`` to write).
    """
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out
    loss = output_field(out, "loss")
    if loss is not None:
        return loss
    if isinstance(out, (tuple, list)):
        found = [i for i, x in enumerate(out) if _scalar(x)]
        if len(found) == 1:
            return out[found[0]]  # type: ignore[no-any-return]
        shapes = ", ".join(_shape(x) for x in out)
        which = "no" if not found else f"{len(found)}"
        pick = found[-1] if found else len(out) - 1
        raise ConfigError(
            f"loss_fn=None takes the loss from the model's output, and a {type(out).__name__} "
            f"output's loss is its one 0-dim tensor, but ({shapes}) holds {which} such "
            f"tensors; pass Pipeline(loss_fn=lambda out, _: out[{pick}]) naming the loss, "
            f"or pass what the model needs to compute one (e.g. its targets)"
        )
    raise ConfigError(
        f"loss_fn=None takes the loss from the model's output, but its "
        f"{type(out).__name__} has no loss; pass what the model needs to compute one "
        f"(e.g. labels in the inputs dict), or give Pipeline a loss_fn"
    )


def _scalar(value: Any) -> bool:
    """A 0-dim floating-point tensor: what a tuple output's loss is."""
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def _shape(value: Any) -> str:
    """A tuple element as the error names it: ``Tensor[4, 8]``, ``Tensor[]``, ``None``."""
    if isinstance(value, torch.Tensor):
        return f"Tensor[{', '.join(map(str, value.shape))}]"
    return "None" if value is None else type(value).__name__


def add_term(state: StepState, term: LossTerm, m: int) -> None:
    """Add micro-batch ``m``'s loss ``term`` to the step's loss (once per micro-batch, by
    whichever stage ends score it)."""
    if state.loss is None:
        state.loss = StepLoss()
    state.loss.add(term, state.sizes[m])


class ModelEnds:
    """The default ends: the first stage runs on the micro-batch as given, and the last
    stage's output is scored by ``loss_fn`` (None: the model's own loss, with its router
    auxiliary term where ``router`` is given). No passes."""

    every_rank = False
    forward_passes: frozenset[str] = frozenset()

    def __init__(self, loss_fn: LossFn | None, router: RouterLoss | None = None) -> None:
        self.loss_fn = loss_fn
        self.router = router
        self.routed = router is not None
        self.state = StepState("train")

    def begin(self, state: StepState, inputs: list[Any] | None, targets: list[Any] | None) -> None:
        """Start a step (the targets are the state's)."""
        self.state = state

    def first_input(self, m: int, value: Any) -> Any:
        """The micro-batch itself."""
        return value

    def input_grad(self, m: int, leaves: list[torch.Tensor], grads: list[Any]) -> None:
        """The model's input gradient goes nowhere."""

    def last_output(self, m: int, out: Any, recomputing: bool = False) -> list[torch.Tensor]:
        """The loss (predict: the output, kept); its scaled total is what B starts from."""
        state = self.state
        if state.mode == "predict":
            state.outputs[m] = pytree.tree_map(
                lambda x: x.detach() if isinstance(x, torch.Tensor) else x, out
            )
            return []
        term = self.term(out, m)
        if not recomputing:
            add_term(state, term, m)
        return [term.root(state.scale)] if state.train else []

    def output_grad(self, m: int) -> list[torch.Tensor] | None:
        """None: the backward starts from the loss."""
        return None

    def run_pass(self, step: Pass) -> None:
        """The default ends have no passes."""
        raise PipelineError(f"the schedule has a pass {step} that nothing runs")

    def term(self, out: Any, m: int) -> LossTerm:
        """The micro-batch's loss as a pair (:func:`~conveyor.runtime.step_loss.as_term`)."""
        state = self.state
        if self.loss_fn is None:
            result: Any = model_loss(out)
            if state.counts is not None:
                count = state.counts[m]
                term = counted_term(result, count)
                # The model's token mean holds coef * aux: weighted by its count.
                aux = self.router.term(out, state.aux_weight, count) if self.router else None
                return term if aux is None else term.plus(aux)
        else:
            assert state.targets is not None
            result = self.loss_fn(out, state.targets[m])
        return as_term(result, state.sizes[m])
