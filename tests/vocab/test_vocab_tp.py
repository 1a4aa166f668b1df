"""Vocabulary parallelism with tensor parallelism: pp=2 x tp=2 (4 processes), a GPT whose
blocks' MLPs are split by ``tp_plan`` (ColwiseParallel then RowwiseParallel; torch.fx traces
it). Each tensor-parallel slice has its own vocabulary group over its pipeline ranks.

Two accumulated steps of padded rows over uneven micro-batches, tied and untied, on 1f1b
and zb-h1: every rank's loss and every gradient (tensor-parallel shards and vocabulary rows
gathered whole) equal the unsplit model's; what every rank posts (transfers, the tensor-
parallel and the vocabulary collectives) replays deadlock-free under NCCL's rules.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from tests.support import distributed
from tests.support.helpers import assert_close
from tests.support.nccl_model import Record, check
from tests.vocab.models import HIDDEN, VOCAB, padded_batch, unsplit_steps
from tests.vocab.test_vocab_pipeline import LOSS, TOL

CASES = [("1f1b", False), ("zb-h1", True)]


class MlpGPT(nn.Module):
    """Embedding, residual MLP blocks (fc1, tanh, fc2), norm, bias-free output layer."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.Tanh(), nn.Linear(2 * HIDDEN, HIDDEN))
            for _ in range(4)
        )
        self.ln = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.ln(x))  # type: ignore[no-any-return]


def steps() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [padded_batch(7, 9, seed=0), padded_batch(5, 6, seed=1)]


def reference(tied: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    return unsplit_steps(MlpGPT(tied), steps(), LOSS)


def _world(rank: int) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from tests.support.nccl_record import recording

    ctx = conveyor.init(pp=2, tp=2)
    plan = {"blocks.*.0": ColwiseParallel(), "blocks.*.2": RowwiseParallel()}
    out: dict[str, Any] = {}
    for schedule, tied in CASES:
        with recording() as trace:
            pipe = conveyor.Pipeline(MlpGPT(tied), loss_fn=LOSS, microbatches=4,
                                     schedule=schedule, tp_plan=plan, vocab_parallel=True,
                                     context=ctx)  # fmt: skip
            losses = [float(pipe.train_step(ids, t)) for ids, t in steps()]
        split = sorted({n for n, p in pipe.named_parameters() if hasattr(p, "to_local")})
        grads = {
            n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
            for n, p in pipe.named_parameters()
        }
        out[f"{schedule} {tied}"] = (losses, grads, split, [r.to_dict() for r in trace])
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp2_tp2_with_the_rows_split_is_exact() -> None:
    results = distributed.run(_world, 4, fork=True, timeout=400)
    for schedule, tied in CASES:
        key = f"{schedule} {tied}"
        want_losses, want = reference(tied)
        seen: set[str] = set()
        for rank, r in enumerate(results):
            losses, grads, split, _ = r[key]
            assert any(n.startswith("blocks.") for n in split), (key, split)  # tp shards
            assert "wte.weight" in split, (key, split)  # the rows
            for a, b in zip(losses, want_losses, strict=True):
                assert abs(a - b) <= TOL * abs(b), f"{key}: rank {rank} loss {a} != {b}"
            assert_close(grads, {n: want[n] for n in grads}, f"{key}: rank {rank}")
            seen.update(grads)
        assert seen == set(want), key
        check({rank: [Record.from_dict(x) for x in r[key][3]] for rank, r in enumerate(results)})
