"""What a fit returns and what callbacks see: :class:`History` and :class:`FitState`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.pipeline import Pipeline


@dataclass
class History:
    """The record of one :meth:`conveyor.Trainer.fit` call.

    Attributes:
        losses: One float per optimizer step of this call: the whole (global) batch's loss,
            the same on every rank.
        evals: One dict per evaluation: ``"step"`` (the optimizer steps done, resumed ones
            included), ``"loss"`` and each metric, sample-weighted over the evaluation data
            and the same on every rank.
        start_step: The step this call started from (above 0 when it resumed).
        learning_rates: The first parameter group's learning rate used by each step.
    """

    losses: list[float] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    start_step: int = 0
    learning_rates: list[float] = field(default_factory=list)


@dataclass
class FitState:
    """Where a fit stands; every callback hook gets it.

    Attributes:
        pipe: The pipeline being trained.
        step: Optimizer steps done, resumed ones included.
        epoch: The current epoch (0-based; after ``on_epoch_end`` of epoch e it is still e).
        steps_per_epoch: Optimizer steps in one epoch.
        max_steps: The step the fit ends at.
        start_step: The step the fit started from.
        resumed: Whether the fit continued from a checkpoint.
        loss: The last step's loss (whole batch, every rank).
        learning_rate: The first parameter group's learning rate of the last step.
        samples: The last step's global batch size.
        metrics: The last evaluation's values (see :attr:`History.evals`), or empty.
        history: The fit's :class:`History` so far.
        metric_names: The names the evaluations report (``"loss"`` and each metric).
    """

    pipe: Pipeline
    step: int
    epoch: int
    steps_per_epoch: int
    max_steps: int
    start_step: int
    resumed: bool
    history: History
    metric_names: tuple[str, ...] = ()
    loss: float = float("nan")
    learning_rate: float = float("nan")
    samples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
