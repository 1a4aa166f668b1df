"""Over which ranks each gradient is summed under expert parallelism.

A replica's expert shard gets gradient from every token of its ep group routed to those
experts (the all-to-all brought them); the other ``dp / ep`` replicas that hold the same
experts (same ``ep_rank``) saw the rest of the batch. So an expert parameter's gradient is
summed over :attr:`~conveyor.context.Context.expert_replica_group`, not over the ep group
(which holds other experts) nor the whole dp group; every other parameter over the
whole dp group, as without expert parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert shard: a DTensor on a mesh with an ``ep`` dimension."""
    mesh = getattr(param, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return "ep" in names


def reduction_group(param: torch.Tensor, ctx: Any) -> dist.ProcessGroup | None:
    """The process group ``param``'s gradient is summed over in data parallelism.

    Args:
        param: a parameter of this rank's stages.
        ctx: the :class:`~conveyor.context.Context`.

    Returns:
        ``ctx.expert_replica_group`` for expert shards, else ``ctx.replica_group`` (every
        data-parallel replica and context-parallel rank).
    """
    group: dist.ProcessGroup | None = (
        ctx.expert_replica_group if is_expert_parameter(param) else ctx.replica_group
    )
    return group
