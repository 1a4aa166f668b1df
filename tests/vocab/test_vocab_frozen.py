"""Frozen vocabulary layers (``requires_grad=False``) under vocabulary parallelism, on 2
processes: splitting the rows keeps the embedding, the output layer or the tied weight
frozen, so it gets no ``.grad`` and an AdamW step (with weight decay) leaves its rows as
they were, while every trainable parameter's gradient stays the unsplit model's (frozen
alike)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import conveyor
from conveyor.vocab.shards import chunk_rows
from tests.support import distributed
from tests.support.helpers import assert_close
from tests.vocab.models import TinyGPT, padded_batch
from tests.vocab.test_vocab_pipeline import LOSS

CASES = {"embedding": (False, ("wte",)), "output": (False, ("head",)), "tied": (True, ("wte",))}
"""Each case: whether the layers are tied, and the modules whose weight is frozen."""


def frozen_model(case: str) -> TinyGPT:
    tied, frozen = CASES[case]
    torch.manual_seed(0)
    model = TinyGPT(tied)
    for name in frozen:
        model.get_submodule(name).weight.requires_grad_(False)
    return model


def frozen_names(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def reference(case: str) -> tuple[set[str], dict[str, torch.Tensor]]:
    """The unsplit model's frozen names and trainable gradients of one whole batch."""
    model = frozen_model(case)
    total, count = LOSS(model(*padded_batch()[:1]), padded_batch()[1])
    (total / count).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return frozen_names(model), grads


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "to_local", None)
    return (local() if callable(local) else t).detach().clone()


def _world(rank: int) -> dict[str, Any]:
    ctx = conveyor.init(pp=2)
    out: dict[str, Any] = {}
    for case in CASES:
        pipe = conveyor.Pipeline(frozen_model(case), loss_fn=LOSS, microbatches=2,
                                 context=ctx, vocab_parallel=True)  # fmt: skip
        named = dict(pipe.named_parameters())
        before = {n: _local(p) for n, p in named.items()}
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
        pipe.train_step(*padded_batch())
        grads = {}
        for name, p in named.items():
            if p.grad is None:
                continue
            split = hasattr(p.grad, "to_local")
            lo, hi = chunk_rows(p.shape[0], 2, ctx.pp_rank) if split else (None, None)
            grads[name] = (_local(p.grad), lo, hi)
        opt.step()
        out[case] = {
            "frozen": {n for n, p in named.items() if not p.requires_grad},
            "grads": grads,
            "unchanged": {n for n, p in named.items() if torch.equal(_local(p), before[n])},
        }
    return out


@pytest.mark.multiprocess
def test_frozen_vocabulary_layers_stay_frozen_when_their_rows_are_split() -> None:
    results = distributed.run(_world, 2, fork=True)
    for case, (_, modules) in CASES.items():
        frozen, want = reference(case)
        assert frozen == {f"{m}.weight" for m in modules}
        got: dict[str, torch.Tensor] = {}
        expected: dict[str, torch.Tensor] = {}
        for rank, result in enumerate(results):
            mine = result[case]
            assert mine["frozen"] == frozen, f"{case}: rank {rank} froze {mine['frozen']}"
            assert not frozen & set(mine["grads"]), f"{case}: rank {rank} gave {frozen} a .grad"
            assert frozen <= mine["unchanged"], f"{case}: rank {rank}: a frozen weight moved"
            for name, (g, lo, hi) in mine["grads"].items():
                key = f"{name} (rank {rank})"
                got[key] = g
                expected[key] = want[name] if lo is None else want[name][lo:hi]
        # Every trainable parameter has its gradient on some rank: its rows' unsplit one.
        assert {key.split(" (")[0] for key in got} == set(want), case
        assert_close(got, expected, case)
