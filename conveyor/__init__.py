"""conveyor: pipeline-parallel training for PyTorch."""

from __future__ import annotations

from conveyor.context import Context, init
from conveyor.errors import ConfigError, ConveyorError, PipelineError, ScheduleError
from conveyor.partition import balance
from conveyor.pipeline import Pipeline

__all__ = [
    "ConfigError",
    "Context",
    "ConveyorError",
    "Pipeline",
    "PipelineError",
    "ScheduleError",
    "balance",
    "init",
]
__version__ = "0.1.0"
