"""One step's state on this process, from its start to its :class:`StepRecord`.

The engine and the stage compute are long-lived; what a step accumulates (activations
saved from F to B, W work, recompute stashes, outputs, the loss sums, timings, memory
bytes) lives in one :class:`StepState`, made when the step starts and turned into the
step's :class:`StepRecord` at its end. Two long-lived objects hold a step's values
too, each until the step has used them: the channel (values in flight between actions
and ranks, and the first rank's header broadcast until the step's end) and the
:class:`~conveyor.runtime.deferred_linear.LinearWeightStore` (each micro-batch's
``(X, dY)`` from B until its W). What they keep across steps is deliberate: the output
descriptions already exchanged, per input signature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from conveyor.runtime.memory import MemoryReport
from conveyor.runtime.recompute import RngState
from conveyor.runtime.step_loss import StepLoss
from conveyor.runtime.timing import Timing

Mode = Literal["train", "eval", "predict"]
Key = tuple[int, int]  # (stage, micro-batch)


@dataclass(frozen=True)
class StepRecord:
    """What one step did on this process.

    ``sums``: the pipeline's loss sums (:func:`~conveyor.runtime.step_loss.pack`: total,
    count, rows, pair) as the rank holding the last stage sent them to every pipeline
    rank (None in ``predict``); ``outputs``: the last stage's micro-batch outputs (``predict``);
    ``timings``: (rank, kind, stage, micro-batch, start, end) per action, seconds from the
    step start, start once its inputs had arrived; ``waits``: the same for each wait on
    another rank (the producer's kind, stage and micro-batch) and each expert all-to-all
    from its post to its end (kind ``"A"``, the posting action's stage and micro-batch);
    ``memory``: activation
    memory (``track_memory``), else None.
    """

    mode: Mode
    sums: torch.Tensor | None
    outputs: list[Any]
    timings: list[Timing]
    waits: list[Timing]
    memory: MemoryReport | None


@dataclass
class StepState:
    """A step in progress: what it was given, and what it has built so far.

    Given: ``mode``; ``targets`` per micro-batch (on the last stage's process, with a
    ``loss_fn``); ``sizes``, the micro-batches' rows (a scalar loss is weighted by them);
    ``counts``, the tokens a model's own token loss divides each micro-batch's by;
    ``scale``, what each loss total is multiplied by before its backward
    (:mod:`~conveyor.runtime.step_loss`); ``adjacent``, (stage, micro-batch) whose B
    follows its F at once (recompute keeps their activations); ``t0``, the step's start;
    ``aux_weight``, a model's router auxiliary loss's weight (``loss_fn=None``).
    """

    mode: Mode
    targets: list[Any] | None = None
    sizes: tuple[int, ...] = ()
    counts: tuple[int, ...] | None = None
    scale: float = 1.0
    adjacent: frozenset[Key] = frozenset()
    t0: float = 0.0
    # A router auxiliary loss's weight (step_loss.router_weight); None without one.
    aux_weight: float | None = None
    # F to B: (input leaves, output leaves) per (stage, micro-batch).
    saved: dict[Key, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    # B to W: whose W is still to run (what it reads is in the linear weight store).
    pending_w: set[Key] = field(default_factory=set)
    # Recompute stages: (stage input, RNG state) per (stage, micro-batch), from F to B.
    stash: dict[Key, tuple[Any, RngState]] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    loss: StepLoss | None = None
    timings: list[Timing] = field(default_factory=list)
    # Each expert all-to-all: kind "A", the stage and micro-batch of the action posting it.
    exchanges: list[Timing] = field(default_factory=list)
    forward_bytes: dict[Key, int] = field(default_factory=dict)
    backward_bytes: dict[Key, int] = field(default_factory=dict)

    @property
    def train(self) -> bool:
        """Whether the step computes gradients."""
        return self.mode == "train"

    def record(
        self, sums: torch.Tensor | None, waits: list[Timing], memory: MemoryReport | None
    ) -> StepRecord:
        """The finished step's record."""
        outputs = [self.outputs[k] for k in sorted(self.outputs)]
        return StepRecord(self.mode, sums, outputs, self.timings, waits, memory)
