"""Checks and text of :class:`conveyor.Pipeline` kept out of ``pipeline.py``: the step
arguments' check, the not-split-yet error, the memory report's checks and ``print(pipe)``."""

from __future__ import annotations

from typing import Any

from conveyor._build import RankParts
from conveyor._options import check_step
from conveyor.errors import ConfigError
from conveyor.runtime.compute import LossFn
from conveyor.runtime.memory import MemoryReport
from conveyor.runtime.step_state import Mode, StepRecord
from conveyor.schedules import Schedule


def not_split(what: str, model: Any) -> ConfigError:
    """The error of a call that needs a split made on the first batch, before it."""
    return ConfigError(
        f"{what} needs the split, which is made on the first batch: "
        f"{type(model).__name__} is captured with torch.export on a sample; run "
        f"a train_step first, or pass sample=(inputs, targets) to Pipeline to split "
        f"it at construction"
    )


def step_inputs(mode: Mode, loss_fn: LossFn | None, inputs: Any, targets: Any, cut: Any) -> Any:
    """Check a step's arguments; returns the inputs a capture samples (with micro-batches
    ``cut`` by the user: the first one's)."""
    if cut is not None:
        if inputs is not None or targets is not None:
            raise ConfigError(
                "pass either the batch (inputs, targets) or microbatches=[(inputs, "
                "targets), ...] cut by you, not both"
            )
        if isinstance(cut, (list, tuple)) and cut and isinstance(cut[0], tuple):
            return cut[0][0]  # the first micro-batch: a capture's sample
    elif mode != "predict":
        check_step(loss_fn, inputs, targets)
    return inputs


def pipeline_repr(
    schedule: Schedule, microbatches: int, distributed: bool, parts: RankParts | None, split: str
) -> str:
    """``print(pipe)``: the schedule line, then the split (``split``) and what compiling
    cost per stage held here."""
    where = "" if distributed else ", in one process"
    head = (
        f"Pipeline({schedule.name}, {schedule.ranks} ranks x {schedule.chunks} chunks = "
        f"{schedule.stages} stages, {microbatches} micro-batches{where})"
    )
    if parts is None:
        return head + "\nnot split yet: the model is captured on the first batch"
    return head + "\n" + split + parts.compile_note()


def step_memory(tracked: bool, record: StepRecord | None) -> MemoryReport:
    """The last training step's memory report (``pipe.last_step_memory()``)."""
    if not tracked:
        raise ConfigError("memory is measured only with Pipeline(..., track_memory=True)")
    if record is None or record.memory is None:
        raise ConfigError("no training step has run yet; call train_step first")
    return record.memory
