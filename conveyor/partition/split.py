"""``split_model``: one entry point for every way of naming stages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from conveyor.errors import ConfigError
from conveyor.partition.annotations import chain_sizes, stage_of, whole_stage
from conveyor.partition.execution import ExecutionSequence, split_sequence
from conveyor.partition.graph import split_graph
from conveyor.partition.kept import Kept
from conveyor.partition.sequential import layers_of, split_sequential

Model = nn.Module | Sequence[nn.Module]


def split_model(
    model: Model,
    stages: int,
    balance: Sequence[int] | None = None,
    sample: Any = None,
    placement: Sequence[int] | None = None,
    kept: Kept | None = None,
) -> list[nn.Module]:
    """Cut ``model`` into ``stages`` stage modules.

    - an execution sequence (:func:`conveyor.sequence`): whole steps, by ``balance``,
      annotations, or parameter counts;
    - a layer list (``nn.Sequential``, ``nn.ModuleList``, list of modules): whole layers, by
      ``balance``, annotations, or parameter counts. An ``nn.Sequential`` annotated
      inside a layer (not only on its layers) is split as a graph instead;
    - any other module: captured as a graph (``torch.fx``, or ``torch.export`` on
      ``sample``, one micro-batch of its input, where fx cannot trace it) and split by
      annotations, or by ``balance`` counting leaf-module calls and operations that read a
      parameter, or by parameter counts preferring cuts between blocks.

    An automatic split uses ``placement`` to give every rank parameters when the model
    has too few layers with parameters for every stage.

    Stage 0 takes the model's arguments; stage s > 0 takes stage s - 1's output; the last
    returns the model's output. Parameters and buffers are the model's own objects under
    their original names.

    Args:
        model: A module, a layer list or an execution sequence.
        stages: How many stages to make.
        balance: Layers (or steps) per stage; None to cut by annotations or balance.
        sample: One micro-batch of the model's input, for a model fx cannot trace.
        placement: The rank of each stage.
        kept: Modules a torch.export capture keeps whole as calls, besides the expert
            collections (:mod:`conveyor.partition.kept`; the tp_plan's).

    Returns:
        The stage modules, in order.

    Raises:
        NeedsSample: fx cannot trace the model and no sample was given.
        ConfigError: The model cannot be captured, or the annotations or ``balance`` do
            not fit ``stages``.
    """
    if isinstance(model, ExecutionSequence):
        return split_sequence(model, stages, balance, placement)
    if isinstance(model, nn.Module) and not isinstance(model, (nn.Sequential, nn.ModuleList)):
        return split_graph(model, stages, balance, sample, placement, kept)
    layers = layers_of(model)
    if not any(stage_of(m) is not None for _, layer in layers for m in layer.modules()):
        return list(split_sequential(model, stages, balance, placement))
    if balance is not None:
        raise ConfigError(
            "the model has pipeline_stage annotations and a balance was given too; pass one "
            "of them (balance=None to use the annotations)"
        )
    if isinstance(model, nn.Sequential) and any(
        stage_of(m) is not None for _, layer in layers for m in list(layer.modules())[1:]
    ):
        return split_graph(model, stages, sample=sample, kept=kept)
    marks = [(f"model.{name}", whole_stage(m, f"model.{name}")) for name, m in layers]
    sizes = chain_sizes(marks, stages)
    return list(split_sequential(model, stages, sizes))


def shared_parameters(stages: Sequence[nn.Module]) -> list[tuple[str, list[int]]]:
    """The ``Parameter`` objects that more than one stage holds.

    Their gradients must be summed over those stages.

    Args:
        stages: The stage modules.

    Returns:
        (name, stage indices) of each, named as the first holding stage names it (an
        original model name); ordered by first stage, then by position in that stage's
        ``named_parameters()``.
    """
    where: dict[int, tuple[str, list[int]]] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            entry = where.setdefault(id(p), (name, []))
            if s not in entry[1]:
                entry[1].append(s)
    return [(name, held) for name, held in where.values() if len(held) > 1]
