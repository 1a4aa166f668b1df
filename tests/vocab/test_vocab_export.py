"""Vocabulary parallelism on a model only torch.export captures (its forward branches in
Python on the token ids' length, which torch.fx cannot trace): the split model takes
its input embedding as its first argument, so the captured first stage reads it as an
input, each micro-batch its own.

pp=4 in one process and pp=2 on 2 processes, tied and untied, two accumulated steps of
padded rows over uneven micro-batches (and an eval step): the loss and every gradient are
the unsplit model's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from tests.support import distributed
from tests.support.real_models import ViTBlock
from tests.vocab.models import HIDDEN, VOCAB, padded_batch, unsplit_steps
from tests.vocab.test_vocab_pipeline import LOSS, compare, grads_of


class ExportOnlyLM(nn.Module):
    """Embedding, timm-style attention blocks, norm, output layer; a Python branch on the
    ids' length (fx cannot trace it)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(VOCAB, HIDDEN, padding_idx=0)
        self.blocks = nn.ModuleList(ViTBlock(HIDDEN, 2) for _ in range(4))
        self.ln = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        depth = len(self.blocks) if idx.size(1) > 2 else 1  # export guards on the length
        for block in self.blocks[:depth]:
            x = block(x)
        return self.head(self.ln(x))  # type: ignore[no-any-return]


def steps() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [padded_batch(7, 9, seed=0), padded_batch(5, 9, seed=1)]


def reference(tied: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    return unsplit_steps(ExportOnlyLM(tied), steps(), LOSS)


def run(pp: int, tied: bool, schedule: str, ctx: Any) -> tuple[list[float], dict[str, Any], float]:
    ids, targets = steps()[0]
    pipe = conveyor.Pipeline(ExportOnlyLM(tied), loss_fn=LOSS, microbatches=4, schedule=schedule,
                             context=ctx, vocab_parallel=True, sample=(ids, targets))  # fmt: skip
    assert pipe.describe().method == "export"
    losses = [float(pipe.train_step(i, t)) for i, t in steps()]
    grads = grads_of(pipe, pp, ctx.pp_rank if ctx.distributed else 0)
    return losses, grads, float(pipe.eval_step(ids, targets))


def eval_reference(tied: bool) -> float:
    total, count = LOSS(ExportOnlyLM(tied)(steps()[0][0]), steps()[0][1])
    return (total / count).item()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_one_process_pp4(tied: bool) -> None:
    losses, grads, evaluated = run(1, tied, "zb-h1", conveyor.init(pp=4))
    compare([(losses, grads)], reference(tied), f"pp4 tied={tied}")
    assert abs(evaluated - eval_reference(tied)) < 1e-5 * eval_reference(tied)


def _world(rank: int) -> dict[str, Any]:
    ctx = conveyor.init(pp=2)
    return {f"{s} {tied}": run(2, tied, s, ctx) for s, tied in (("1f1b", True), ("v-half", False))}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes() -> None:
    results = distributed.run(_world, 2, fork=True, timeout=400)
    for key in results[0]:
        tied = key.endswith("True")
        compare([(r[key][0], r[key][1]) for r in results], reference(tied), key)
        for r in results:
            assert abs(r[key][2] - eval_reference(tied)) < 1e-5 * eval_reference(tied), key
