"""Training loops over a :class:`conveyor.Pipeline`: :class:`Trainer`, its callbacks and
metrics.

``conveyor.Trainer(pipe, optimizer).fit(data, batch_size=..., epochs=...)`` is the loop
every example used to write: sharded data for data parallelism, whole-model gradient
clipping, learning-rate schedules, evaluation with metrics, logging, checkpoints and exact
resumption.
"""

from __future__ import annotations

from conveyor.training.callbacks import (
    EvalMonitor,
    LossMonitor,
    LRSchedule,
    ProgressBar,
)
from conveyor.training.evaluate import accuracy
from conveyor.training.history import FitState, History
from conveyor.training.loggers import CSVLogger, TensorBoard
from conveyor.training.trainer import Callback, Trainer

__all__ = [
    "CSVLogger",
    "Callback",
    "EvalMonitor",
    "FitState",
    "History",
    "LRSchedule",
    "LossMonitor",
    "ProgressBar",
    "TensorBoard",
    "Trainer",
    "accuracy",
]
