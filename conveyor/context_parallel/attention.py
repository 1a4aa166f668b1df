"""Attention over a whole sequence whose tokens are spread over the cp ranks.

Each rank computes its queries against every rank's keys, one block at a time as the
blocks come round (:mod:`~conveyor.context_parallel.rotation`), merging the partial results
by their log-sum-exp. The backward passes the blocks round again, each with the gradient
of its keys and values so far, and after a full turn every block's gradient is back with
its owner. Queries are taken in tiles and keys in chunks, so no more than one tile's scores
exist at a time; a block a tile attends nothing of (the future, under a causal mask) is
skipped, which is what the chunk layout balances.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from conveyor.context_parallel import blocks
from conveyor.context_parallel.layout import held_index
from conveyor.context_parallel.masks import NOTHING, Rule, Tokens, both, by_data, by_index
from conveyor.context_parallel.rotation import Rotation

TILE = 1024
"""Queries per tile: the scores of one tile against one chunk of keys exist at a time."""


@dataclass(frozen=True)
class Sequence:
    """One micro-batch's sequence, as every cp rank knows it whole.

    Attributes:
        length: Its tokens (a multiple of ``2 * cp``).
        cp: The cp ranks it is spread over.
        doc: ``[B, length]`` the document of each token (packed rows), or None.
        valid: ``[B, length]`` True where a token may be attended, or None.
    """

    length: int
    cp: int
    doc: Tensor | None = None
    valid: Tensor | None = None

    def tokens(self, ranks: list[int]) -> Tokens:
        """The tokens of cp ranks ``ranks`` (stacked in that order); indices on the CPU,
        documents and padding on their device."""
        key = (self.length, self.cp, tuple(ranks))
        index = torch.stack([held_index(self.length, self.cp, r) for r in ranks])

        def pick(t: Tensor | None) -> Tensor | None:
            if t is None:
                return None
            on = _on_device(key, t.device)
            return torch.stack([t[:, i] for i in on])

        return Tokens(index, pick(self.doc), pick(self.valid))


@functools.lru_cache(maxsize=256)
def _on_device(key: tuple[int, int, tuple[int, ...]], device: torch.device) -> Tensor:
    """The indices of a layout's ranks on ``device``, copied there once."""
    length, cp, ranks = key
    return torch.stack([held_index(length, cp, r) for r in ranks]).to(device)


@dataclass(frozen=True)
class Plan:
    """What one attention call needs besides its queries, keys and values.

    Attributes:
        rotation: How blocks move between the cp ranks.
        sequence: The micro-batch's sequence.
        rule: Causal or not, and a sliding window.
        scale: The scores' factor (``1 / sqrt(head_dim)`` by default).
        dropout: Attention dropout (rate 0 outside training).
    """

    rotation: Rotation
    sequence: Sequence
    rule: Rule
    scale: float
    dropout: blocks.Dropout

    def sources(self, step: int) -> list[int]:
        """The cp rank whose block each of this process's ranks holds after ``step`` moves."""
        size = self.rotation.size
        return [(r - step) % size for r in self.rotation.ranks]


def _expand(t: Tensor, groups: int) -> Tensor:
    """Keys or values with each head repeated for the ``groups`` query heads sharing it."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=2)


def _fold(t: Tensor, groups: int) -> Tensor:
    """The gradient of :func:`_expand`'s input: the repeated heads' gradients summed."""
    if groups == 1:
        return t
    v, b, h, length, d = t.shape
    return t.view(v, b, h // groups, groups, length, d).sum(dim=3)


_INDEX_MASKS: dict[tuple[Any, ...], Tensor | None] = {}
"""Masks by index on their device, by the indices they mask: the same for every layer and
micro-batch of a layout, so each is made (and copied to the device) once."""


def _index_mask(rule: Rule, queries: Tensor, keys: Tensor, device: torch.device) -> Tensor | None:
    """:func:`~conveyor.context_parallel.masks.by_index` of runs of consecutive indices
    (``[V, L]`` each), cached by the runs' starts and lengths."""
    key = (rule, device, queries.shape, keys.shape, *queries[:, 0].tolist(), *keys[:, 0].tolist())
    cached = _INDEX_MASKS.get(key, _INDEX_MASKS)
    if cached is not _INDEX_MASKS:
        return cached  # type: ignore[return-value]
    mask = by_index(rule, queries, keys)
    if mask is not None and mask is not NOTHING:
        mask = mask.to(device)
    if len(_INDEX_MASKS) > 4096:
        _INDEX_MASKS.clear()
    _INDEX_MASKS[key] = mask
    return mask


def _pieces(
    plan: Plan, queries: Tokens, keys: Tokens, length: int, step: int, device: torch.device
) -> list[Any]:
    """The (query tile, key chunk) pairs that attend something, as ``(rows, cols, mask,
    salt)`` with ``rows`` / ``cols`` as (start, length). Tiles never span the two chunks a
    rank holds (each a run of consecutive indices), so a tile of the early chunk skips the
    late chunks it cannot see."""
    out = []
    chunk = length // 2
    starts = [c + t for c in (0, chunk) for t in range(0, chunk, TILE)]
    for n, start in enumerate(starts):
        rows = (start, min(TILE, chunk - start % chunk))
        for k, first in enumerate((0, chunk)):
            cols = (first, chunk)
            index = _index_mask(
                plan.rule, queries.index.narrow(-1, *rows), keys.index.narrow(-1, *cols), device
            )
            if index is NOTHING:
                continue
            mask = both(index, by_data(queries.narrow(*rows), keys.narrow(*cols)))
            salt = ((plan.rotation.ranks[0] * plan.rotation.size + step) * len(starts) + n) * 2 + k
            out.append((rows, cols, mask, salt))
    return out


def attend(q: Tensor, k: Tensor, v: Tensor, plan: Plan) -> tuple[Tensor, Tensor]:
    """The attention of this process's queries over the whole sequence: its output (float32)
    and log-sum-exp. ``q``: ``[V, B, H, L, D]``; ``k``, ``v``: ``[V, B, Hkv, L, D]``."""
    groups = q.size(2) // k.size(2)
    length = q.size(3)
    device = q.device
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=dtype, device=device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=dtype, device=device)
    queries = plan.sequence.tokens(list(plan.rotation.ranks))
    block = torch.stack([k, v], dim=1)
    size, turn = plan.rotation.size, plan.rotation.turn()
    for step in range(size):
        move = turn.start(block, "keys and values") if step + 1 < size else None
        keys = plan.sequence.tokens(plan.sources(step))
        kb, vb = _expand(block[:, 0], groups), _expand(block[:, 1], groups)
        for (r0, rn), (c0, cn), mask, salt in _pieces(plan, queries, keys, length, step, device):
            qt = q.narrow(3, r0, rn)
            keep = plan.dropout.keep((*qt.shape[:-1], cn), device, salt)
            o, s = blocks.forward(
                qt, kb.narrow(3, c0, cn), vb.narrow(3, c0, cn), plan.scale, mask, keep,
                plan.dropout.p,
            )  # fmt: skip
            merged, total = blocks.merge(out.narrow(3, r0, rn), lse.narrow(3, r0, rn), o, s)
            out.narrow(3, r0, rn).copy_(merged)
            lse.narrow(3, r0, rn).copy_(total)
        if move is not None:
            block = move.result()
    return out, lse


def attend_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, plan: Plan
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`attend`'s ``q``, ``k`` and ``v`` (float32), given ``out``,
    ``lse`` and the output's gradient ``dout``."""
    groups = q.size(2) // k.size(2)
    length = q.size(3)
    device = q.device
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    delta = (dout.to(dtype) * out.to(dtype)).sum(dim=-1)
    dq = torch.zeros(q.shape, dtype=dtype, device=device)
    queries = plan.sequence.tokens(list(plan.rotation.ranks))
    block = torch.stack([k, v], dim=1)
    held = torch.zeros(block.shape, dtype=dtype, device=device)  # its dk, dv so far
    size, turn = plan.rotation.size, plan.rotation.turn()
    for step in range(size):
        move = turn.start(block, "keys and values") if step + 1 < size else None
        keys = plan.sequence.tokens(plan.sources(step))
        kb, vb = _expand(block[:, 0], groups), _expand(block[:, 1], groups)
        dk = torch.zeros(kb.shape, dtype=dtype, device=device)
        dv = torch.zeros(kb.shape, dtype=dtype, device=device)
        for (r0, rn), (c0, cn), mask, salt in _pieces(plan, queries, keys, length, step, device):
            qt = q.narrow(3, r0, rn)
            keep = plan.dropout.keep((*qt.shape[:-1], cn), device, salt)
            gq, gk, gv = blocks.backward(
                qt, kb.narrow(3, c0, cn), vb.narrow(3, c0, cn), dout.narrow(3, r0, rn),
                lse.narrow(3, r0, rn), delta.narrow(3, r0, rn), plan.scale, mask, keep,
                plan.dropout.p,
            )  # fmt: skip
            dq.narrow(3, r0, rn).add_(gq)
            dk.narrow(3, c0, cn).add_(gk)
            dv.narrow(3, c0, cn).add_(gv)
        held = held + torch.stack([_fold(dk, groups), _fold(dv, groups)], dim=1)
        # The block's gradient goes on with it; after the last step it reaches its owner.
        returned = turn.give(held, last=step + 1 == size)
        if move is not None:
            block = move.result()
        held = returned.result()
    return dq, held[:, 0], held[:, 1]


class RingAttention(torch.autograd.Function):
    """:func:`attend` with its backward (:func:`attend_backward`)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, plan: Plan) -> Tensor:
        out, lse = attend(q, k, v, plan)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.plan = plan
        return result

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attend_backward(q, k, v, out, lse, dout, ctx.plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
