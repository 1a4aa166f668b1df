"""Context-parallel attention as one operator, ``conveyor::cp_attention``, with its
backward as another: ``torch.export`` and ``torch.compile`` keep each as one opaque call
(the transfers inside are not traced), and a captured graph carries the per-micro-batch
documents and padding into it as ordinary inputs.

The operator finds how its cp ranks talk by a small integer ``key`` (:func:`register`): a
process may run several pipelines, each with its own cp layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from conveyor.context_parallel.attention import Plan, Sequence, attend, attend_backward
from conveyor.context_parallel.blocks import Dropout
from conveyor.context_parallel.masks import Rule
from conveyor.context_parallel.rotation import Rotation

_ROTATIONS: dict[int, Rotation] = {}


def register(rotation: Rotation) -> int:
    """The key the operator finds ``rotation`` by (the same key for an equal one)."""
    for key, known in _ROTATIONS.items():
        if known is rotation:
            return key
    key = len(_ROTATIONS)
    _ROTATIONS[key] = rotation
    return key


def _plan(
    q: Tensor, key: int, doc: Tensor | None, valid: Tensor | None, causal: bool, window: int,
    scale: float, dropout_p: float, seed: Tensor,
) -> Plan:  # fmt: skip
    rotation = _ROTATIONS[key]
    length = q.size(2) * rotation.size
    rows = q.size(0) // len(rotation.ranks)  # stacked ranks repeat doc and valid
    doc = None if doc is None else doc[:rows]
    valid = None if valid is None else valid[:rows]
    rule = Rule(causal, window if window > 0 else None)
    drop = Dropout(dropout_p, int(seed) if dropout_p > 0 else 0)
    return Plan(rotation, Sequence(length, rotation.size, doc, valid), rule, scale, drop)


def _stacked(t: Tensor, ranks: int) -> Tensor:
    """``[V * B, H, L, D]`` (the model's batch holds every rank's share) as ``[V, B, ...]``."""
    return t.view(ranks, t.size(0) // ranks, *t.shape[1:])


@torch.library.custom_op("conveyor::cp_attention", mutates_args=())
def cp_attention(
    q: Tensor, k: Tensor, v: Tensor, doc: Tensor | None, valid: Tensor | None, key: int,
    causal: bool, window: int, scale: float, dropout_p: float, seed: Tensor,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Attention of ``q`` (``[N, H, L, D]``, this process's queries) over the whole
    sequence: the output (``q``'s type) and its log-sum-exp (float32)."""
    plan = _plan(q, key, doc, valid, causal, window, scale, dropout_p, seed)
    ranks = len(plan.rotation.ranks)
    out, lse = attend(_stacked(q, ranks), _stacked(k, ranks), _stacked(v, ranks), plan)
    return out.to(q.dtype).view(q.shape), lse.view(q.shape[:-1])


@cp_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    lse_type = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=lse_type)


@torch.library.custom_op("conveyor::cp_attention_backward", mutates_args=())
def cp_attention_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
    doc: Tensor | None, valid: Tensor | None, key: int, causal: bool, window: int,
    scale: float, dropout_p: float, seed: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of :func:`cp_attention`'s ``q``, ``k`` and ``v``."""
    plan = _plan(q, key, doc, valid, causal, window, scale, dropout_p, seed)
    n = len(plan.rotation.ranks)
    dq, dk, dv = attend_backward(
        _stacked(q, n), _stacked(k, n), _stacked(v, n), _stacked(out, n),
        lse.view(n, lse.size(0) // n, *lse.shape[1:]), _stacked(dout, n), plan,
    )  # fmt: skip
    # dk and dv are views of one buffer (they travel round together): an operator's
    # outputs may not alias each other, so each gets its own memory.
    return (
        dq.to(q.dtype).reshape(q.shape),
        dk.to(k.dtype, copy=True).reshape(k.shape),
        dv.to(v.dtype, copy=True).reshape(v.shape),
    )


@cp_attention_backward.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, doc, valid, key, causal, window, scale, dropout_p, seed = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], doc, valid, seed)
    ctx.args = (key, causal, window, scale, dropout_p)


def _backward(ctx: Any, dout: Tensor, _dlse: Tensor) -> tuple[Any, ...]:
    q, k, v, out, lse, doc, valid, seed = ctx.saved_tensors
    key, causal, window, scale, dropout_p = ctx.args
    dq, dk, dv = cp_attention_backward(
        q, k, v, out, lse, dout.contiguous(), doc, valid, key, causal, window, scale,
        dropout_p, seed,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None, None, None


cp_attention.register_autograd(_backward, setup_context=_setup)


def context_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key: int,
    *,
    causal: bool,
    scale: float | None = None,
    window: int | None = None,
    dropout_p: float = 0.0,
    doc: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """``scaled_dot_product_attention(q, k, v)`` over the whole sequence whose share this
    process holds: ``q`` ``[N, H, L, D]``, ``k`` / ``v`` ``[N, Hkv, L, D]`` (grouped-query
    heads allowed); ``key`` from :func:`register`; ``doc`` / ``valid`` ``[B, S]``: each
    token's document and whether it may be attended, over the whole sequence."""
    seed = (
        torch.randint(2**62, (), dtype=torch.int64)
        if dropout_p > 0
        else torch.zeros((), dtype=torch.int64)
    )
    out, _ = cp_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), doc, valid, key, causal,
        window or 0, scale if scale is not None else q.size(-1) ** -0.5, dropout_p, seed,
    )  # fmt: skip
    result: Tensor = out
    return result
