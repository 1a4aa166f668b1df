"""Frozen parameters (``requires_grad=False``) under the layouts that replace parameters
with sharded ones, on 2 processes: FSDP (dp 2) and tensor parallelism (tp 2; ``tp_plan``
on the blocks); and replicas that sum their gradients (dp 2, no FSDP, on zb-h1, whose W
computes weight gradients apart). A frozen parameter, sharded or not, stays frozen: no
``.grad``, and an AdamW step (with weight decay) leaves it as it was; every trainable
parameter's gradient is the unsplit model's on the whole batch (frozen alike). Expert
parallelism's frozen experts: tests/parallel/test_expert_shard.py and test_resplit.py;
vocabulary rows: tests/vocab/test_vocab_frozen.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.verify import Block
from tests.support import distributed
from tests.support.helpers import assert_close

FROZEN = ("0.weight", "0.bias", "1.fc1.weight", "1.fc1.bias", "2.fc2.weight")
"""A plain layer, a column-wise and a row-wise tensor-parallel layer (some of each)."""
ROWS = 8


def model() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 4))
    for name, p in net.named_parameters():
        p.requires_grad_(name not in FROZEN)
    return net


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g)


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach().clone()


def _world(rank: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    x, y = batch()
    plan = {"*.fc1": ColwiseParallel(), "*.fc2": RowwiseParallel()}
    layouts: dict[str, Any] = {
        "dp": (conveyor.init(pp=1, dp=2), {"schedule": "zb-h1"}),  # W apart from B
        "fsdp": (conveyor.init(pp=1, dp=2), {"fsdp": True}),
        "tp": (conveyor.init(pp=1, tp=2), {"tp_plan": plan}),
    }
    out: dict[str, Any] = {}
    for layout, (ctx, options) in layouts.items():
        pipe = conveyor.Pipeline(model(), loss_fn=nn.functional.mse_loss, microbatches=2,
                                 context=ctx, **options)  # fmt: skip
        named = dict(pipe.named_parameters())
        before = {n: _whole(p) for n, p in named.items()}
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
        mine = slice(ctx.dp_rank, None, ctx.dp_size)  # a replica's rows
        pipe.train_step(x[mine], y[mine])
        grads = {n: _whole(p.grad) for n, p in named.items() if p.grad is not None}
        opt.step()
        out[layout] = {
            "frozen": {n for n, p in named.items() if not p.requires_grad},
            "sharded": {n for n, p in named.items() if hasattr(p, "full_tensor")},
            "grads": grads,
            "moved": {n for n, p in named.items() if not torch.equal(_whole(p), before[n])},
        }
    return out


@pytest.mark.multiprocess
def test_frozen_parameters_stay_frozen_under_fsdp_and_tensor_parallelism() -> None:
    net = model()
    x, y = batch()
    nn.functional.mse_loss(net(x), y).backward()
    want = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    assert set(want) == {n for n, _ in net.named_parameters()} - set(FROZEN)
    sharded = {"dp": set(), "fsdp": set(FROZEN), "tp": {n for n in FROZEN if ".fc" in n}}
    for rank, result in enumerate(distributed.run(_world, 2, fork=True)):
        for layout, got in result.items():
            what = f"{layout} rank {rank}"
            assert sharded[layout] <= got["sharded"], f"{what}: {got['sharded']}"
            assert got["frozen"] == set(FROZEN), f"{what}: frozen {sorted(got['frozen'])}"
            assert_close(got["grads"], want, what)  # no .grad for a frozen one
            assert got["moved"] == set(want), f"{what}: moved {sorted(got['moved'])}"
