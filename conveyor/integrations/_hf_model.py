"""The pieces of :class:`~conveyor.integrations.transformers.PipelineTrainer` that stand
for the model: this rank's stages as one module, the whole state dict gathered, weights
read back from a transformers directory, and the key/value cache turned off (shared with
the Lightning strategy)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.pipeline import Pipeline
from conveyor.weights import give_values


def without_cache(model: nn.Module) -> None:
    """Turn off a transformers model's key/value cache (``config.use_cache = False``): a
    cache cannot cross stages, and training does not use one."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False


class Stages(nn.Module):
    """This rank's stages as one module: what the trainer's loop steps and zeroes.

    Args:
        pipe: The pipeline.
        model: The model it was built from (its modes follow the stages': a model captured
            with torch.export reads dropout and batch norm modes from it).
    """

    def __init__(self, pipe: Pipeline, model: nn.Module) -> None:
        super().__init__()
        self.stages = nn.ModuleList(pipe.stages)
        # This rank's vocabulary rows (vocab_parallel): zeroed and clipped with the stages.
        self.vocab = pipe.vocab_layers
        self.__dict__["original"] = model  # not a submodule: its parameters are not ours

    def train(self, mode: bool = True) -> Stages:
        """Set training mode on the stages and on the model."""
        super().train(mode)
        self.__dict__["original"].train(mode)  # captured graphs read the model's modes
        return self


def gather_state_dict(pipe: Pipeline, model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0 (``{}`` elsewhere), from every stage.

    Replica 0's ranks (data-parallel replica 0, cp rank 0: ``ctx.replica_rank == 0``) send
    their stages' entries (original names; FSDP and tensor-parallel shards gathered first,
    a collective among their holders) to rank 0; entries no stage holds come from
    ``model``. A collective: call it on every rank.

    Args:
        pipe: The pipeline.
        model: The model it was built from.

    Returns:
        The state dict (CPU tensors) on rank 0, ``{}`` on the other ranks.
    """
    ctx = pipe.context
    local: dict[str, torch.Tensor] = {}
    for name, value in pipe.state_dict().items():
        if hasattr(value, "full_tensor"):  # FSDP / tensor-parallel shards
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            local[name] = value.detach().to("cpu", copy=True)
    parts: list[Any] = [local]
    if ctx.distributed:
        mine = local if ctx.replica_rank == 0 and ctx.tp_rank == 0 else {}
        parts = [{} for _ in range(ctx.world_size)] if ctx.rank == 0 else []
        dist.gather_object(mine, parts if ctx.rank == 0 else None, dst=0)
    if ctx.rank != 0:
        return {}
    whole: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, value in part.items():
            whole.setdefault(name, value)
    for name, value in model.state_dict().items():  # buffers no stage holds
        whole.setdefault(name, value.detach().cpu())
    return whole


def read_pretrained(pipe: Pipeline, model: nn.Module, path: str) -> None:
    """Load this rank's tensors (every state-dict entry of its stages) from the
    transformers directory ``path``, as ``Pipeline(weights=path)`` would have: each rank
    reads only its own tensors, a sharded one (FSDP, tensor parallel, vocabulary rows)
    cut to its shard.

    Args:
        pipe: The pipeline.
        model: The model it was built from (its names).
        path: A directory ``save_pretrained`` (or transformers) wrote.

    Raises:
        CheckpointError: The directory lacks a tensor or holds another shape (named).
    """
    holder = pipe.vocab_layers
    modules = [*pipe.stages, *([holder] if holder is not None else [])]
    give_values(model, modules, pipe.context.device, path, init_seed=0)
