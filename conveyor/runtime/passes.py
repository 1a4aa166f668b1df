"""What the run loop asks of the vocabulary passes (vocabulary parallelism): the interface
:class:`~conveyor.vocab.runner.VocabRunner` implements, so the runtime names no layer
above it."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from conveyor.runtime.step_state import StepState
from conveyor.schedules.core import VocabAction


class Passes(Protocol):
    """The vocabulary passes of a step on this rank, and their hand-offs with the first
    and last stages."""

    current: int
    """The micro-batch the first stage is running (its input embedding's stand-in reads it)."""

    def begin(self, state: StepState, inputs: list[Any] | None, targets: list[Any] | None) -> None:
        """Start a step: its state and this rank's micro-batches."""

    def run(self, action: VocabAction) -> None:
        """Run one pass."""

    def stage_input(self, m: int, value: Any) -> Any:
        """What the first stage runs on for micro-batch ``m``, given its micro-batch."""

    def embedded(self, m: int) -> torch.Tensor | None:
        """The input embedding of micro-batch ``m`` (an autograd leaf) where it is here."""

    def input_grad(self, m: int, grad: torch.Tensor | None) -> None:
        """The first stage's backward computed the embedding's gradient of ``m``."""

    def hidden_of(self, out: Any) -> torch.Tensor:
        """The last stage's output as the hidden states the output layer takes."""

    def keep_hidden(self, m: int, hidden: torch.Tensor) -> None:
        """Keep the last stage's hidden states of ``m`` for its S pass."""

    def hidden_grad(self, m: int) -> list[torch.Tensor]:
        """The gradient of the last stage's output of ``m`` (from its T pass)."""
