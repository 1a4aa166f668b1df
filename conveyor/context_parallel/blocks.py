"""Attention of a rank's queries against one block of keys, forward and backward, with the
log-sum-exp that lets blocks be merged in any order (flash attention's online softmax).

Shapes: queries ``[V, B, H, Lq, D]``, keys and values ``[V, B, H, Lk, D]`` (heads already
repeated for grouped-query attention), where ``V`` is the number of cp ranks this process
computes (1 across processes; ``cp`` in the world of one process, which holds every rank's
share). A mask is a boolean tensor broadcast against the scores ``[V, B, H, Lq, Lk]``, True
where a query may attend a key; None lets every query attend every key. Everything is
computed and returned in float32 (float64 for float64 input).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Dropout:
    """Attention dropout on the probabilities, drawn from a generator seeded per block so
    that the backward redraws the forward's masks. ``p``: the drop rate (0: none)."""

    p: float
    seed: int

    def keep(self, shape: tuple[int, ...], device: torch.device, salt: int) -> Tensor | None:
        """The mask of kept probabilities of the block ``salt`` (None when ``p`` is 0)."""
        if self.p == 0.0:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed * 1_000_003 + salt) % (2**63 - 1))
        return torch.rand(shape, generator=gen, device=device) >= self.p


def _up(t: Tensor) -> Tensor:
    """``t`` in the type the block is computed in: float32, or float64 for float64 input."""
    return t if t.dtype == torch.float64 else t.float()


def _scores(q: Tensor, k: Tensor, scale: float, allowed: Tensor | None) -> Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


def _probabilities(s: Tensor, lse: Tensor) -> Tensor:
    """``exp(s - lse)``, zero where a query attends nothing (its ``lse`` is -inf)."""
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(s - finite.unsqueeze(-1))


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    allowed: Tensor | None,
    keep: Tensor | None = None,
    p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """The block's output (normalized over the block alone) and its log-sum-exp; a query
    that attends no key of the block gets output 0 and log-sum-exp -inf. ``keep``: dropout's
    mask of kept probabilities, ``p`` its rate."""
    s = _scores(_up(q), _up(k), scale, allowed)
    lse = torch.logsumexp(s, dim=-1)
    probs = _probabilities(s, lse)
    if keep is not None:
        probs = probs * keep / (1.0 - p)
    return torch.matmul(probs, _up(v)), lse


def merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial results of the same queries over disjoint keys, as one."""
    total = torch.logaddexp(lse, block_lse)
    finite = torch.where(torch.isinf(total), torch.zeros_like(total), total)
    a = torch.exp(lse - finite).nan_to_num(0.0).unsqueeze(-1)
    b = torch.exp(block_lse - finite).nan_to_num(0.0).unsqueeze(-1)
    return out * a + block_out * b, total


def backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    lse: Tensor,
    delta: Tensor,
    scale: float,
    allowed: Tensor | None,
    keep: Tensor | None = None,
    p: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of the block's queries, keys and values, given the whole attention's
    log-sum-exp ``lse`` and ``delta`` (the rows' sum of output times output gradient)."""
    qf, kf, vf, df = _up(q), _up(k), _up(v), _up(dout)
    probs = _probabilities(_scores(qf, kf, scale, allowed), lse)
    dp = torch.matmul(df, vf.transpose(-1, -2))
    if keep is not None:
        dropped = probs * keep / (1.0 - p)
        dp = dp * keep / (1.0 - p)
    else:
        dropped = probs
    dv = torch.matmul(dropped.transpose(-1, -2), df)
    ds = probs * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    return dq, dk, dv
