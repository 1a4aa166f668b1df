"""What a stage is, asked in one place: how the model was split to make it, and which
modules its forward calls. The layers above (sharding, the build) ask these instead of
testing partition's stage types themselves."""

from __future__ import annotations

from typing import Literal

from torch import fx, nn

from conveyor.partition.execution import ExecutionSequence
from conveyor.partition.sequential import SequentialStage

SplitMethod = Literal["layers", "sequence", "fx", "export"]
"""How a model was split: a layer list, an execution sequence, or a graph captured with
``torch.fx`` or ``torch.export``."""

METHOD = "conveyor_method"  # GraphModule.meta key: the SplitMethod that captured it


def split_method(stage: nn.Module) -> SplitMethod:
    """How the split that made ``stage`` captured the model."""
    if isinstance(stage, fx.GraphModule):
        method: SplitMethod = stage.meta.get(METHOD, "fx")
        return method
    if isinstance(stage, ExecutionSequence):
        return "sequence"
    return "layers"


def called_modules(stage: nn.Module) -> list[nn.Module]:
    """The modules ``stage``'s forward calls directly, in order (none for a module that
    is not one of partition's stages)."""
    if isinstance(stage, (SequentialStage, ExecutionSequence)):
        return stage.called_modules()
    if isinstance(stage, fx.GraphModule):
        calls = [n for n in stage.graph.nodes if n.op == "call_module"]
        return [stage.get_submodule(str(n.target)) for n in calls]
    if isinstance(stage, nn.Sequential):  # a layer list used as a stage as it is
        return list(stage.children())
    return []
