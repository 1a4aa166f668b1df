"""Model to stage modules. ``balance`` and the annotation rules are pure Python; the
splitters need torch and are imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor.partition.cuts import balance

if TYPE_CHECKING:
    from conveyor.partition.annotations import set_stage, stage_of
    from conveyor.partition.capture import NeedsSample
    from conveyor.partition.execution import ExecutionSequence, sequence
    from conveyor.partition.graph import layer_count, split_graph
    from conveyor.partition.sequential import layers_of, parameter_costs, split_sequential
    from conveyor.partition.split import shared_parameters, split_model

__all__ = [
    "ExecutionSequence",
    "NeedsSample",
    "balance",
    "layer_count",
    "layers_of",
    "parameter_costs",
    "sequence",
    "set_stage",
    "shared_parameters",
    "split_graph",
    "split_model",
    "split_sequential",
    "stage_of",
]

_LAZY = {
    "layers_of": "sequential",
    "parameter_costs": "sequential",
    "split_sequential": "sequential",
    "set_stage": "annotations",
    "stage_of": "annotations",
    "split_graph": "graph",
    "layer_count": "graph",
    "NeedsSample": "capture",
    "ExecutionSequence": "execution",
    "sequence": "execution",
    "shared_parameters": "split",
    "split_model": "split",
}


def __getattr__(name: str) -> Any:
    """Import a splitter's module on first use of one of its names."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"conveyor.partition.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'conveyor.partition' has no attribute {name!r}")
