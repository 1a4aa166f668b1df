"""The error every checkpoint failure is raised as."""

from __future__ import annotations

from conveyor.errors import ConveyorError


class CheckpointError(ConveyorError, RuntimeError):
    """A checkpoint cannot be written, is missing or damaged, or does not fit the model.

    Raised by :func:`~conveyor.checkpoint.save`, :func:`~conveyor.checkpoint.load` and
    :func:`~conveyor.checkpoint.load_model_state`; the message says what to do.
    """

    __module__ = "conveyor.checkpoint"  # where it is imported from, as tracebacks show it
