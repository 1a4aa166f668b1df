"""Token cross-entropy from vocabulary shards: each rank's statistics, their combination,
and each rank's gradient. The full logits exist nowhere; the result is
``F.cross_entropy``'s (sum over the tokens whose target is not ``ignore_index``, with its
label smoothing) up to float rounding.

With ``p`` ranks holding logit columns ``Y_r`` of each token: ``l_r = logsumexp Y_r``
(``-inf`` for no columns), ``t_r`` the target's logit where rank r holds the target (else
0) and ``z_r = sum Y_r`` (for label smoothing only). Gathered: ``lse = logsumexp_r l_r``,
``t = sum t_r``, ``z = sum z_r``, and the token's loss is ``(1 - e)(lse - t) + e(lse - z /
V)``. Its gradient in ``Y_r`` is ``softmax - (1 - e) onehot - e / V``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

STATS = 3
"""Statistics per token a rank contributes: log-sum-exp, target logit, sum."""


class Targets(NamedTuple):
    """A micro-batch's targets as one rank sees them: per token (flattened), whether it
    counts, and the target's column in this rank's rows (-1: held elsewhere)."""

    valid: torch.Tensor
    column: torch.Tensor


def local_targets(
    targets: torch.Tensor, ignore_index: int, shift: bool, lo: int, hi: int
) -> Targets:
    """The flattened targets of a micro-batch for rows ``[lo, hi)`` (``shift``: position i
    predicts target i + 1; each row's last position predicts nothing)."""
    if shift:
        pad = torch.full_like(targets[..., :1], ignore_index)
        targets = torch.cat([targets[..., 1:], pad], dim=-1)
    flat = targets.reshape(-1)
    valid = flat.ne(ignore_index)
    mine = valid & (flat >= lo) & (flat < hi)
    column = torch.where(mine, flat - lo, torch.full_like(flat, -1))
    return Targets(valid, column)


def shard_stats(logits: torch.Tensor, targets: Targets, smoothing: float) -> torch.Tensor:
    """This rank's statistics ``[STATS, tokens]`` (float32) of its logit columns
    ``logits`` ``[tokens, columns]`` (module doc; the sum only with ``smoothing``)."""
    tokens, columns = logits.shape
    out = logits.new_zeros((STATS, tokens), dtype=torch.float32)
    if columns == 0:
        out[0] = float("-inf")
        return out
    wide = logits.float()
    out[0] = torch.logsumexp(wide, dim=1)
    held = targets.column >= 0
    picked = wide.gather(1, targets.column.clamp(min=0)[:, None])[:, 0]
    out[1] = torch.where(held, picked, torch.zeros_like(picked))
    if smoothing:
        out[2] = wide.sum(dim=1)
    return out


class Combined(NamedTuple):
    """The gathered statistics of every token: its log-sum-exp and loss (float32)."""

    lse: torch.Tensor
    loss: torch.Tensor


def combine(gathered: torch.Tensor, rows: int, smoothing: float) -> Combined:
    """Every rank's statistics ``[ranks, STATS, tokens]`` combined (module doc)."""
    lse = torch.logsumexp(gathered[:, 0], dim=0)
    loss = lse - gathered[:, 1].sum(dim=0)
    if smoothing:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - gathered[:, 2].sum(dim=0) / rows)
    return Combined(lse, loss)


def shard_grad(
    logits: torch.Tensor,
    lse: torch.Tensor,
    targets: Targets,
    weight: torch.Tensor,
    rows: int,
    smoothing: float,
) -> torch.Tensor:
    """The gradient (float32) of ``sum(weight * loss)`` in this rank's logit columns:
    ``weight`` per token (0 where it does not count). Computed in ``logits``' memory when
    it is float32 (the logits are not needed after it)."""
    grad = logits if logits.dtype == torch.float32 else logits.float()
    if grad.shape[1] == 0:  # a rank holding no rows: no columns, nothing to scatter into
        return grad
    grad = torch.sub(grad, lse[:, None], out=grad).exp_()
    if smoothing:
        grad -= smoothing / rows
    held = (targets.column >= 0).to(grad.dtype)[:, None]
    grad.scatter_add_(1, targets.column.clamp(min=0)[:, None], held * (smoothing - 1.0))
    return grad.mul_(weight[:, None])
