"""Vocabulary parallelism where a pipeline rank holds no rows: 9 rows on 4 ranks
(torch's chunks 3, 3, 3, 0) and 3 rows on 4 (1, 1, 1, 0).

The shards' cross-entropy (conveyor/vocab/cross_entropy.py) on 4 shards in one process
against ``F.cross_entropy`` of the whole logits (loss and gradient, with label smoothing
and ignored tokens); then pp=4 on 4 processes, two accumulated steps of padded rows over
uneven micro-batches and an eval step, exact against the unsplit model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import conveyor
from conveyor.vocab.cross_entropy import combine, local_targets, shard_grad, shard_stats
from conveyor.vocab.shards import chunk_rows
from tests.support import distributed
from tests.support.helpers import assert_close
from tests.vocab.models import TinyGPT
from tests.vocab.test_vocab_pipeline import LOSS, compare, grads_of

PP = 4


@pytest.mark.parametrize("rows", [9, 3])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_the_shards_cross_entropy_with_a_shard_of_no_rows(rows: int, smoothing: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(11, rows, dtype=torch.float64)
    targets = torch.randint(0, rows, (11,))
    targets[[2, 7]] = -100
    spans = [chunk_rows(rows, PP, r) for r in range(PP)]
    assert spans[-1][0] == spans[-1][1]  # the last rank holds nothing
    parts = [logits[:, lo:hi] for lo, hi in spans]
    local = [local_targets(targets, -100, False, lo, hi) for lo, hi in spans]
    stats = torch.stack([shard_stats(p, t, smoothing) for p, t in zip(parts, local, strict=True)])
    assert float(stats[-1, 0].max()) == float("-inf")  # no columns: log-sum-exp is -inf
    combined = combine(stats, rows, smoothing)
    valid = local[0].valid
    whole = logits.clone().requires_grad_()
    want = F.cross_entropy(whole, targets, reduction="sum", label_smoothing=smoothing)
    want.backward()
    got = (combined.loss * valid).sum()
    assert abs(float(got) - want.item()) < 1e-6 * abs(want.item())
    weight = valid.to(torch.float32)
    grads = [
        shard_grad(p.float(), combined.lse, t, weight, rows, smoothing)
        for p, t in zip(parts, local, strict=True)
    ]
    assert grads[-1].shape == (11, 0)
    assert_close({"logits": torch.cat(grads, dim=1).double()}, {"logits": whole.grad},
                 "shards", reduction=rows, dtype=torch.float32)  # fmt: skip


def batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two steps of padded rows (ids 0 and -100 targets where padded), 7 and 6 rows."""
    out = []
    for seed, (n, length) in enumerate(((7, 9), (6, 5))):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, vocab, (n, length), generator=g)
        targets = ids.clone()
        for r in range(n):
            if r % 4:
                ids[r, length - r % 4 :] = 0
                targets[r, length - r % 4 :] = -100
        out.append((ids, targets))
    return out


def model(vocab: int, tied: bool) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(tied, vocab=vocab)


def reference(vocab: int, tied: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    whole = model(vocab, tied)
    losses = []
    for ids, targets in batches(vocab):
        total, count = LOSS(whole(ids), targets)
        (total / count).backward()
        losses.append((total / count).item())
    return losses, {n: p.grad.clone() for n, p in whole.named_parameters()}


def _world(rank: int, cases: list[tuple[int, bool, str]]) -> dict[str, Any]:
    ctx = conveyor.init(pp=PP)
    out: dict[str, Any] = {}
    for vocab, tied, schedule in cases:
        pipe = conveyor.Pipeline(model(vocab, tied), loss_fn=LOSS, microbatches=4,
                                 schedule=schedule, context=ctx, vocab_parallel=True)  # fmt: skip
        steps = batches(vocab)
        losses = [float(pipe.train_step(ids, t)) for ids, t in steps]
        evals = float(pipe.eval_step(*steps[0]))
        out[f"{vocab} {tied} {schedule}"] = (losses, grads_of(pipe, PP, ctx.pp_rank), evals)
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp4_with_a_rank_of_no_rows_trains_and_evaluates_exactly() -> None:
    cases = [(9, False, "1f1b"), (9, True, "zb-h1"), (3, True, "1f1b")]
    results = distributed.run(_world, PP, cases, fork=True, timeout=400)
    for vocab, tied, schedule in cases:
        key = f"{vocab} {tied} {schedule}"
        want = reference(vocab, tied)
        compare([(r[key][0], r[key][1]) for r in results], want, key)
        whole = model(vocab, tied)
        total, count = LOSS(whole(batches(vocab)[0][0]), batches(vocab)[0][1])
        for r in results:
            assert abs(r[key][2] - float(total / count)) < 1e-5 * float(total / count), key
