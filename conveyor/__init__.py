"""conveyor: pipeline-parallel training for PyTorch.

Names that need torch are imported on first use, so the pure-Python parts (schedules,
simulator, ``conveyor simulate``) start without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor.errors import ConfigError, ConveyorError, PipelineError, ScheduleError
from conveyor.partition.cuts import balance

if TYPE_CHECKING:
    from conveyor import checkpoint, losses
    from conveyor.checkpoint import CheckpointError, load, load_model_state, save
    from conveyor.checkpoint.pretrained import save_pretrained
    from conveyor.context import Context, init
    from conveyor.partition.annotations import set_stage
    from conveyor.partition.execution import sequence
    from conveyor.pipeline import Pipeline
    from conveyor.planning.planner import plan
    from conveyor.planning.profiler import profile
    from conveyor.training import Trainer
    from conveyor.weights import empty_weights, materialize

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Context",
    "ConveyorError",
    "Pipeline",
    "PipelineError",
    "ScheduleError",
    "Trainer",
    "balance",
    "checkpoint",
    "empty_weights",
    "init",
    "load",
    "load_model_state",
    "losses",
    "materialize",
    "plan",
    "profile",
    "save",
    "save_pretrained",
    "sequence",
    "set_stage",
]
__version__ = "0.1.0"

_LAZY = {
    "CheckpointError": "conveyor.checkpoint",
    "Context": "conveyor.context",
    "init": "conveyor.context",
    "load": "conveyor.checkpoint",
    "load_model_state": "conveyor.checkpoint",
    "save": "conveyor.checkpoint",
    "save_pretrained": "conveyor.checkpoint.pretrained",
    "Pipeline": "conveyor.pipeline",
    "plan": "conveyor.planning.planner",
    "profile": "conveyor.planning.profiler",
    "sequence": "conveyor.partition.execution",
    "set_stage": "conveyor.partition.annotations",
    "Trainer": "conveyor.training",
    "empty_weights": "conveyor.weights",
    "materialize": "conveyor.weights",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in ("checkpoint", "losses"):  # conveyor.losses.X without importing it first
        return importlib.import_module(f"conveyor.{name}")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
