"""Callbacks: the hooks of :meth:`conveyor.Trainer.fit` and the built-in ones.

Every hook runs on every rank with the same :class:`~conveyor.training.history.FitState`
(losses and metrics are the same on every rank), so a callback may call collectives
(``pipe.measured_bubble()``); the built-ins that print or write do so on rank 0 only.
Built-ins, after the seeds' hooks: :class:`LossMonitor` (MindSpore's ``LossMonitor``,
Colossal-AI's ``LossHook``), :class:`EvalMonitor` (``LogMetricByEpochHook``),
:class:`LRSchedule` (``LRSchedulerHook``, by step or by epoch), :class:`ProgressBar`,
and in :mod:`conveyor.training.loggers` CSV and TensorBoard logging. The base class
:class:`Callback` is the trainer's (:mod:`conveyor.training.trainer`, which calls its
hooks); it is importable from here too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from conveyor.errors import ConfigError
from conveyor.training.history import FitState
from conveyor.training.trainer import Callback, Trainer

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from conveyor.observe.progress import Progress


def _printer(state: FitState, out: Callable[[str], Any] | None) -> Callable[[str], Any] | None:
    """``out`` (default ``print``) on rank 0, ``None`` elsewhere."""
    if state.pipe.context.rank != 0:
        return None
    return out if out is not None else (lambda line: print(line, flush=True))


class LossMonitor(Callback):
    """Print the step's loss and learning rate every ``every`` steps (rank 0).

    Args:
        every: Steps between lines.
        out: Where lines go (default ``print``).

    Raises:
        ConfigError: ``every`` is not a positive int.
    """

    def __init__(self, every: int = 1, out: Callable[[str], Any] | None = None) -> None:
        if not isinstance(every, int) or every < 1:
            raise ConfigError(f"LossMonitor(every=...) must be an int >= 1, got {every!r}")
        self.every = every
        self.out = out

    def on_step_end(self, trainer: Trainer, state: FitState) -> None:
        """Print ``step N  epoch E  loss L  lr R`` every ``every`` steps."""
        out = _printer(state, self.out)
        if out is not None and state.step % self.every == 0:
            out(
                f"step {state.step}  epoch {state.epoch + 1}  loss {state.loss:.4f}  "
                f"lr {state.learning_rate:.4g}"
            )


class EvalMonitor(Callback):
    """Print each evaluation's values (rank 0): ``eval at step N: loss L  accuracy A``.

    Args:
        out: Where lines go (default ``print``).
    """

    def __init__(self, out: Callable[[str], Any] | None = None) -> None:
        self.out = out

    def on_eval_end(self, trainer: Trainer, state: FitState) -> None:
        """Print the evaluation's values."""
        out = _printer(state, self.out)
        if out is not None:
            values = "  ".join(f"{k} {v:.4f}" for k, v in state.metrics.items() if k != "step")
            out(f"eval at step {state.step} (epoch {state.epoch + 1}): {values}")


class LRSchedule(Callback):
    """Step a learning-rate scheduler after every optimizer step or after every epoch.

    ``Trainer(lr_scheduler=...)`` steps by optimizer step; this callback is for schedules
    by epoch (Colossal-AI's ``LRSchedulerHook(lr_scheduler, by_epoch=True)``). Its state
    is kept in checkpoints.

    Args:
        scheduler: A ``torch.optim.lr_scheduler`` scheduler over the trainer's optimizer.
        by: ``"step"`` or ``"epoch"``.

    Raises:
        ConfigError: ``by`` is neither, or ``scheduler`` has no ``step()``.
    """

    def __init__(self, scheduler: LRScheduler, by: str = "epoch") -> None:
        if by not in ("step", "epoch"):
            raise ConfigError(f"LRSchedule(by=...) must be 'step' or 'epoch', got {by!r}")
        if not callable(getattr(scheduler, "step", None)):
            raise ConfigError(
                f"LRSchedule needs a torch.optim.lr_scheduler scheduler, got "
                f"{type(scheduler).__name__}"
            )
        self.scheduler = scheduler
        self.by = by

    def on_step_end(self, trainer: Trainer, state: FitState) -> None:
        """Step the scheduler when it goes by step."""
        if self.by == "step":
            self.scheduler.step()

    def on_epoch_end(self, trainer: Trainer, state: FitState) -> None:
        """Step the scheduler when it goes by epoch."""
        if self.by == "epoch":
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state."""
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scheduler's state."""
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])


class ProgressBar(Callback):
    """Training progress through :class:`conveyor.observe.progress.Progress`.

    Rank 0 prints ``step N  loss L  T ms/step  S samples/s  bubble B`` every ``every``
    steps and after the first; on a terminal it also shows a tqdm bar. Measuring the
    bubble is a collective: every rank runs this callback.

    Args:
        every: Steps between log lines (default: a tenth of the fit).
        desc: The bar's label.
    """

    def __init__(self, every: int | None = None, desc: str = "train") -> None:
        self.every = every
        self.desc = desc
        self.progress: Progress | None = None

    def on_fit_start(self, trainer: Trainer, state: FitState) -> None:
        """Open the bar for the steps left."""
        from conveyor.observe.progress import Progress

        left = state.max_steps - state.start_step
        every = self.every if self.every is not None else max(state.max_steps // 10, 1)
        self.progress = Progress(state.pipe, left, every=every, desc=self.desc)
        self.progress.count = state.start_step

    def on_step_end(self, trainer: Trainer, state: FitState) -> None:
        """Advance the bar by one step."""
        if self.progress is not None:
            self.progress.step(state.loss, state.samples)

    def on_fit_end(self, trainer: Trainer, state: FitState) -> None:
        """Close the bar."""
        if self.progress is not None:
            self.progress.close()
            self.progress = None


__all__ = ["Callback", "EvalMonitor", "LRSchedule", "LossMonitor", "ProgressBar"]
