"""The error every checkpoint failure is raised as."""

from __future__ import annotations

from conveyor.errors import ConveyorError


class CheckpointError(ConveyorError, RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model it is loaded into."""

    __module__ = "conveyor.checkpoint"  # where it is imported from, as tracebacks show it
