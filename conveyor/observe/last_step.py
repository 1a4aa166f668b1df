"""What a pipeline measured of its last training step: per-action timings and waits, the
activation memory, the bubble over every pipeline rank, a Chrome trace.

:class:`LastStep` gives :class:`conveyor.Pipeline` these methods (the pipeline keeps the
step's record; gathering over ranks is :mod:`conveyor.observe.measure`'s).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

from conveyor.observe.measure import memory_report, pipeline_bubble, write_trace
from conveyor.runtime.memory import MemoryReport
from conveyor.runtime.timing import Timing

if TYPE_CHECKING:
    from conveyor.context import Context
    from conveyor.runtime.step_state import StepRecord
    from conveyor.schedules import Schedule


class _Options(Protocol):
    """What the measurements read of the pipeline's options."""

    @property
    def track_memory(self) -> bool: ...


class LastStep:
    """The measurements of the last training step, for :class:`conveyor.Pipeline`."""

    context: Context
    schedule: Schedule
    options: _Options
    _last_train: StepRecord | None

    def _split(self, what: str) -> Any:
        """This rank's parts, or the error that the model is not split yet (the
        pipeline's own)."""
        raise NotImplementedError

    def last_step_timings(self) -> list[Timing]:
        """A :class:`~conveyor.runtime.timing.Timing` per action of this process in the
        last training step, seconds from the step start (start: when the action's inputs
        had arrived, so waits on other ranks are not work)."""
        self._split("pipe.last_step_timings()")
        return list(self._last_train.timings) if self._last_train is not None else []

    def last_step_waits(self) -> list[Timing]:
        """A :class:`~conveyor.runtime.timing.Timing` per wait of this process for another
        rank's output in the last training step (the producer's kind, stage, micro-batch)."""
        self._split("pipe.last_step_waits()")
        return list(self._last_train.waits) if self._last_train is not None else []

    def last_step_memory(self) -> MemoryReport:
        """This process's activation memory in the last training step.

        Returns:
            Bytes autograd kept for backward work (and the split backward kept for W) at
            their peak, beside the peak of the schedule's memory model with the sizes each
            F really saved.

        Raises:
            ConfigError: without ``track_memory=True``, or before any training step.
        """
        self._split("pipe.last_step_memory()")
        return memory_report(self.options.track_memory, self._last_train)

    def measured_bubble(self) -> float:
        """The bubble of the last training step over all pipeline ranks (of this replica):
        1 - busy time / (ranks x (last end - first start)).

        A collective in a distributed world: call it on every rank.
        """
        timings = self.last_step_timings()
        return pipeline_bubble(timings, self.context, self.schedule.ranks)

    def save_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the last training step as one Chrome trace JSON (open it in Perfetto or
        chrome://tracing): a track per rank, an event per action and per transfer wait.

        The file also records the schedule's order and the measured and simulated bubble,
        and with ``track_memory=True`` each action's bytes (``args``: ``saved_bytes``, what
        an F saved; ``held_bytes``, what a micro-batch holds from its B until its W);
        ``conveyor trace FILE --png PICTURE`` draws it. A collective in a distributed
        world: call it on every rank; rank 0 writes (with data parallelism, replica 0's).

        Args:
            path: the file to write.
        """
        timings, waits = self.last_step_timings(), self.last_step_waits()
        record = self._last_train
        memory = record.memory if record is not None else None
        write_trace(path, timings, waits, self.schedule, self.context, memory)
