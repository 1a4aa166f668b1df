"""Gradient clipping by the norm over the whole model, however it is split and sharded."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from conveyor.context import Context
from conveyor.errors import ConfigError
from conveyor.runtime.sharding import local_shard, summed
from conveyor.runtime.transport import collective


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[nn.Parameter],
    copies: set[int],
    ctx: Context,
    max_norm: float,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Clip gradients by the norm of the whole model's gradient, a collective.

    Every rank adds its own shard of each gradient, divided by how many ranks hold that
    same shard (data-parallel replicas and context-parallel ranks, and tensor-parallel
    ranks of an unsharded weight),
    so the sum over the world counts each number once; in float64, the same on all ranks.

    Args:
        params: this process's parameters.
        copies: ``id()`` of the tied copies whose gradient another rank counts.
        ctx: the context (its world is what the norm covers).
        max_norm: the largest norm left.
        norm_type: any p > 0, or ``inf``.

    Returns:
        The total norm before clipping (float32), the same on every rank.

    Raises:
        ConfigError: ``norm_type`` is not > 0.
    """
    p = float(norm_type)
    if not p > 0:
        raise ConfigError(
            f"norm_type must be > 0 or inf, got {norm_type!r}; use 2.0 (the default) or "
            f"float('inf')"
        )
    with_grads = [q for q in params if q.grad is not None]
    # Every replica (dp and cp) holds the same value; one process holds its cp ranks'
    # shares side by side, with one gradient.
    holders = ctx.replicas * ctx.tp_size if ctx.distributed else 1
    parts = [
        (
            torch.linalg.vector_norm(
                local_shard(g), p, dtype=torch.promote_types(g.dtype, torch.float32)
            ).double(),
            holders / _shards(g),
        )
        for g in (summed(q.grad) for q in with_grads if id(q) not in copies and q.grad is not None)
    ]
    zero = torch.zeros((), dtype=torch.float64, device=ctx.device)
    doing = f"rank {ctx.rank}: adding up the gradient norm (pipe.clip_grad_norm_)"
    total: torch.Tensor
    if math.isinf(p):
        total = torch.stack([n for n, _ in parts]).max() if parts else zero
        if ctx.distributed:
            collective(
                lambda: dist.all_reduce(total, op=dist.ReduceOp.MAX, async_op=True),
                ctx.timeout,
                doing,
                "another pipeline rank",
            )
    else:
        total = sum((n.pow(p) / count for n, count in parts), zero)
        if ctx.distributed:
            collective(
                lambda: dist.all_reduce(total, async_op=True),
                ctx.timeout,
                doing,
                "another pipeline rank",
            )
        total = total.pow(1.0 / p)
    total = total.float()
    scale = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for q in with_grads:
        assert q.grad is not None
        grad = local_shard(q.grad)
        grad.mul_(scale.to(grad.device))
    return total


def _shards(t: torch.Tensor) -> int:
    """Into how many pieces a DTensor's placements cut it among the ranks of one pipeline
    rank (1 for a plain tensor): the vocabulary layers' rows over the pipeline ranks
    (a ``"pp"`` mesh dimension) are pieces that no other rank holds."""
    placements = getattr(t, "placements", ())
    mesh = getattr(t, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    count = 1
    for dim, placement in enumerate(placements):
        # Not is_shard(): FSDP over a tensor-parallel weight shards it "strided", which is
        # a shard too. Partial sums were summed (sharding.summed) before.
        over_pp = dim < len(names) and names[dim] == "pp"
        if mesh is not None and not placement.is_replicate() and not over_pp:
            count *= mesh.size(dim)
    return count
