"""Logging a fit to files on rank 0: :class:`CSVLogger` and :class:`TensorBoard`."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from conveyor.errors import ConfigError
from conveyor.training.history import FitState
from conveyor.training.trainer import Callback

if TYPE_CHECKING:
    from conveyor.training.trainer import Trainer


class CSVLogger(Callback):
    """One CSV row per optimizer step, written by rank 0.

    Columns: ``step, epoch, loss, lr``, then ``eval_<name>`` for the evaluation loss and
    each metric (filled on the rows of steps followed by an evaluation, else empty). A
    resumed fit appends to the file; a fresh one replaces it.

    Args:
        path: The CSV file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: TextIO | None = None
        self._writer: Any = None
        self._row: dict[str, Any] | None = None
        self._columns: list[str] = []

    def on_fit_start(self, trainer: Trainer, state: FitState) -> None:
        """Open the file (rank 0) and write the header if it is new."""
        if state.pipe.context.rank != 0:
            return
        self._columns = ["step", "epoch", "loss", "lr", *(f"eval_{n}" for n in state.metric_names)]
        append = state.resumed and self.path.is_file()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if append else "w", newline="")  # noqa: SIM115
        self._writer = csv.DictWriter(self._file, fieldnames=self._columns, restval="")
        if not append:
            self._writer.writeheader()

    def _flush(self) -> None:
        if self._row is not None and self._file is not None:
            self._writer.writerow(self._row)
            self._file.flush()
        self._row = None

    def on_step_end(self, trainer: Trainer, state: FitState) -> None:
        """Start the step's row (written once its evaluation, if any, is known)."""
        if self._file is None:
            return
        self._flush()
        self._row = {
            "step": state.step,
            "epoch": state.epoch + 1,
            "loss": repr(state.loss),
            "lr": repr(state.learning_rate),
        }

    def on_eval_end(self, trainer: Trainer, state: FitState) -> None:
        """Add the evaluation to the step's row."""
        if self._file is None:
            return
        if self._row is None:  # an evaluation before any step of this fit
            self._row = {"step": state.step, "epoch": state.epoch + 1}
        for name, value in state.metrics.items():
            if f"eval_{name}" in self._columns:
                self._row[f"eval_{name}"] = repr(value)

    def on_fit_end(self, trainer: Trainer, state: FitState) -> None:
        """Write the last row and close the file."""
        self._flush()
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoard(Callback):
    """Scalars for TensorBoard (rank 0): ``train/loss`` and ``train/lr`` per step,
    ``eval/<name>`` per evaluation, against the optimizer step.

    Needs the ``tensorboard`` package (``pip install 'conveyor[tensorboard]'``); the error
    says so at construction.

    Args:
        log_dir: The directory event files go to (``tensorboard --logdir`` it).

    Raises:
        ConfigError: ``tensorboard`` is not installed.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ConfigError(
                "TensorBoard logging needs the tensorboard package; install it with pip "
                "install 'conveyor[tensorboard]' (or pip install tensorboard), or use "
                "CSVLogger"
            ) from error
        self.log_dir = Path(log_dir)
        self._make = SummaryWriter
        self.writer: Any = None

    def on_fit_start(self, trainer: Trainer, state: FitState) -> None:
        """Open the writer on rank 0."""
        if state.pipe.context.rank == 0:
            self.writer = self._make(log_dir=str(self.log_dir))

    def on_step_end(self, trainer: Trainer, state: FitState) -> None:
        """Write the step's loss and learning rate."""
        if self.writer is not None:
            self.writer.add_scalar("train/loss", state.loss, state.step)
            if not math.isnan(state.learning_rate):
                self.writer.add_scalar("train/lr", state.learning_rate, state.step)

    def on_eval_end(self, trainer: Trainer, state: FitState) -> None:
        """Write the evaluation's values."""
        if self.writer is not None:
            for name, value in state.metrics.items():
                if name != "step":
                    self.writer.add_scalar(f"eval/{name}", value, state.step)

    def on_fit_end(self, trainer: Trainer, state: FitState) -> None:
        """Flush and close the writer."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
