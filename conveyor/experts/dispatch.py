"""The forward of a sharded expert collection: dispatch, local experts, combine.

Each of the ``T`` tokens of this rank is routed to ``k`` experts. The ``T * k``
(token, expert) pairs are sorted by expert; since rank ``r`` of the ep group owns experts
``[r * n, (r + 1) * n)`` (``n = num_experts / ep``), that also sorts them by owner. The
tokens-per-expert counts are exchanged first (one small all-to-all), which gives every
rank its uneven split sizes and the local expert of each row it receives; then the
hidden states go to their owners (all-to-all), the collection's own forward runs there
on its local experts (every received row with one expert and weight 1), the outputs come
back (the reverse all-to-all) and are summed per token with the routing weights.
Dropless: no capacity, no token is lost, so the result is the unsplit collection's up to
float rounding (only the order of the per-token sum of ``k`` terms may differ).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.experts.all_to_all import all_to_all, exchange_counts
from conveyor.runtime.local_part import local_shard


@dataclass(frozen=True)
class ExpertShard:
    """How an expert collection is split.

    Attributes:
        ep_size: ranks of the ep group.
        ep_rank: this rank's place in it (it holds experts
            ``[ep_rank * local, (ep_rank + 1) * local)``).
        experts: experts of the whole collection.
        local: experts held here, ``experts / ep_size``.
        timeout: seconds an all-to-all may wait on a peer.
    """

    ep_size: int
    ep_rank: int
    experts: int
    local: int
    timeout: float


class LocalExperts:
    """The collection as its own forward sees it on this rank: the same module, with
    each expert parameter replaced by this rank's shard and ``num_experts`` by the number of
    local experts (a read-only view; the module is not changed, so concurrent
    micro-batches may each have one)."""

    def __init__(self, module: nn.Module, params: dict[str, torch.Tensor], local: int) -> None:
        # Plain instance attributes (not looked up by __getattr__), which torch.compile
        # traces as such.
        self.__dict__.update(params)
        self.num_experts = local
        self._module = module

    def __getattr__(self, name: str) -> Any:
        """Everything else (``act_fn``, ``config``, ...) from the module itself."""
        return getattr(self.__dict__["_module"], name)


def group_of(module: nn.Module) -> dist.ProcessGroup:
    """The ep group of a sharded collection: its expert parameters' mesh's group."""
    for p in module.parameters(recurse=False):
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return mesh.get_group()  # type: ignore[no-any-return]
    raise RuntimeError(f"{type(module).__name__} has no expert-parallel parameters")


def routed_forward(
    module: nn.Module,
    base_forward: Callable[..., torch.Tensor],
    shard: ExpertShard,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The collection's output for this rank's tokens, its experts spread over the ep group.

    Args:
        module: the sharded collection.
        base_forward: its class's own forward (unbound), run on the local experts.
        shard: how it is split.
        hidden_states: ``[T, hidden]``.
        top_k_index: ``[T, k]`` expert ids in ``[0, experts)``.
        top_k_weights: ``[T, k]`` routing weights.

    Returns:
        ``[T, hidden]`` in ``hidden_states``' dtype.
    """
    group = group_of(module)
    size, n = shard.ep_size, shard.local
    tokens, k = top_k_index.shape[0], top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=shard.experts)
    received = exchange_counts(
        counts, group, shard.timeout
    )  # [size * n]: per sender, per local expert
    splits = torch.cat([counts.view(size, n).sum(1), received.view(size, n).sum(1)]).tolist()
    send, recv = splits[:size], splits[size:]
    rows = all_to_all(hidden_states[order // k], recv, send, group, shard.timeout)
    local_ids = torch.arange(n, device=flat.device).repeat(size)
    ids = torch.repeat_interleave(local_ids, received).unsqueeze(-1)
    ones = torch.ones(ids.shape, dtype=top_k_weights.dtype, device=rows.device)
    params = {name: local_shard(p) for name, p in module.named_parameters(recurse=False)}
    out: torch.Tensor = base_forward(LocalExperts(module, params, n), rows, ids, ones)
    out = _keep_graph(out, rows, params.values())
    back = all_to_all(out, send, recv, group, shard.timeout)  # sorted (token, expert) pairs
    pairs = torch.empty_like(back).index_copy(0, order, back)
    weighted = pairs.view(tokens, k, -1) * top_k_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden_states.dtype)


def _keep_graph(
    out: torch.Tensor, rows: torch.Tensor, params: Iterable[torch.Tensor]
) -> torch.Tensor:
    """``out``, tied to the autograd graph when gradients are being recorded: a rank that
    received no tokens computes an output that depends on nothing, but its reverse
    all-to-all must still run in backward, as every peer's does."""
    if not torch.is_grad_enabled() or out.requires_grad:
        return out
    if rows.requires_grad:
        return out + rows.sum() * 0
    for p in params:
        if p.requires_grad:
            return out + p.reshape(-1)[:1].sum() * 0
    return out
