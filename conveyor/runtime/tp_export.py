"""Tensor parallelism on models captured with ``torch.export`` (transformers decoders).

An export capture reads weights by name and calls ATen operations, so torch's
``ParallelStyle`` s, which hook module calls, would have nothing to hook. The modules a
``tp_plan`` names are therefore kept whole in the capture (:mod:`conveyor.partition.kept`)
and become ``call_module`` nodes, which :func:`conveyor.runtime.sharding.apply_tp`
parallelizes in the stages as it does for fx-captured models. Each is recorded with the
output *one tensor-parallel rank* gets (``use_local_output``: a column-parallel
projection's slice of the features), so the rest of the graph is recorded on the local
shapes: transformers' attention reshapes to ``(batch, seq, -1, head_dim)`` and reads its
head counts from the tensors, the same code its own tensor-parallel plan runs on local
shards (grouped-query attention included: ``repeat_kv`` by the config's ratio).

Kept: ``ColwiseParallel`` / ``RowwiseParallel`` on ``nn.Linear`` and ``nn.Embedding``, the
styles that shard those two, and ``SequenceParallel(use_local_output=True)`` on any module
(a norm whose input is sliced on this rank: its parameters replicated, their gradients
summed over tp). Another style on a module of an export-captured model is a
``ConfigError`` (:func:`check_export_plan`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn

from conveyor.errors import ConfigError
from conveyor.partition.kept import Output


def styles_of(model: nn.Module, tp_plan: Mapping[str, Any]) -> dict[str, tuple[nn.Module, Any]]:
    """Each module ``tp_plan`` chooses (its first matching pattern, as ``apply_tp``):
    name -> (module, style)."""
    out: dict[str, tuple[nn.Module, Any]] = {}
    for name, module in model.named_modules():
        for pattern, style in tp_plan.items():
            if name and fnmatch.fnmatchcase(name, pattern):
                out[name] = (module, style)
                break
    return out


def kept_for_tp(
    model: nn.Module, tp_plan: Mapping[str, Any] | None, size: int
) -> dict[str, Output]:
    """The modules of ``model`` that ``tp_plan`` shards and a capture keeps whole, with the
    output one of ``size`` tensor-parallel ranks gets from each (empty without a plan).

    Args:
        model: The whole model.
        tp_plan: ``{module-name pattern: ParallelStyle}``, or None.
        size: The number of tensor-parallel ranks.

    Returns:
        Module name -> its local output, for each ``nn.Linear`` / ``nn.Embedding`` given a
        ``ColwiseParallel`` or ``RowwiseParallel``, and each module given a
        ``SequenceParallel(use_local_output=True)``.
    """
    if not tp_plan:
        return {}
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    out: dict[str, Output] = {}
    for name, (module, style) in styles_of(model, tp_plan).items():
        if isinstance(style, SequenceParallel) and style.use_local_output:
            out[name] = Output()  # a norm on this rank's slice: shaped as its input
            continue
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        if isinstance(module, nn.Linear):
            features, append, dtype = module.out_features, False, None
        elif isinstance(module, nn.Embedding):
            features, append, dtype = module.embedding_dim, True, module.weight.dtype
        else:
            continue
        gathered = _shard_dim(style.input_layouts[0])
        split = _shard_dim(style.output_layouts[0]) if style.use_local_output else None
        linear_input = isinstance(module, nn.Linear) and gathered == -1
        out[name] = Output(features, append, dtype, None if linear_input else gathered,
                           split, size)  # fmt: skip
    return out


def _shard_dim(placement: Any) -> int | None:
    """The dimension a ``Shard`` placement shards, None for any other placement."""
    from torch.distributed.tensor import Shard

    return int(placement.dim) if isinstance(placement, Shard) else None


def check_export_plan(
    model: nn.Module, tp_plan: Mapping[str, Any], kept: Mapping[str, Output]
) -> None:
    """Every module ``tp_plan`` chooses in an export-captured ``model`` must be kept whole.

    Raises:
        ConfigError: a module with a style that is not ``ColwiseParallel`` /
            ``RowwiseParallel`` on an ``nn.Linear`` / ``nn.Embedding``.
    """
    for name, (module, style) in styles_of(model, tp_plan).items():
        if name not in kept:
            raise ConfigError(
                f"tp_plan gives model.{name} ({type(module).__name__}) a "
                f"{type(style).__name__}, but {type(model).__name__} is captured with "
                f"torch.export, where tp_plan takes ColwiseParallel / RowwiseParallel on "
                f"nn.Linear and nn.Embedding modules and SequenceParallel(use_local_output="
                f"True) only; leave model.{name} out of tp_plan or use one of those"
            )
