"""What a step divides by, against the unsplit model (one process, pp=2):

- the router auxiliary loss under gradient accumulation: ``train_step(count=)`` with the
  tokens of every accumulated batch (as ``PipelineTrainer`` passes transformers'
  ``num_items_in_batch``) weighs the load-balancing term as each forward of the unsplit
  model does, not ``count / tokens of the step`` times weaker;
- ``eval_step`` with ``loss_fn=None`` averages over the labelled tokens of the whole batch
  (padded rows labelled -100), and a micro-batch without a labelled token adds nothing
  (no NaN).
"""

from __future__ import annotations

import pytest
import torch

import conveyor
from tests.parallel.test_moe_pipeline import batches, count, model_of
from tests.support.helpers import assert_close, grads_of

pytest.importorskip("transformers")

MICRO = 2  # micro-batches per step, one row each
ACCUMULATED = 2  # steps per optimizer step


def test_router_aux_loss_under_gradient_accumulation_keeps_its_strength() -> None:
    rows = batches()[0][: MICRO * ACCUMULATED]
    n = count(rows)  # the tokens of every accumulated step
    model = model_of("mixtral", True)
    coef = model.router_aux_loss_coef
    want_loss = 0.0
    for ids, labels in rows:  # each forward: its tokens over n, plus coef * aux / MICRO
        output = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(n))
        loss = output.loss + coef * output.aux_loss * (1 / MICRO - 1)
        loss.backward()
        want_loss += float(loss.detach())
    want = grads_of(model.named_parameters())
    pipe = conveyor.Pipeline(model_of("mixtral", True), loss_fn=None, microbatches=MICRO,
                             context=conveyor.init(pp=2))  # fmt: skip
    got_loss = 0.0
    for step in range(ACCUMULATED):
        mine = rows[step * MICRO : (step + 1) * MICRO]
        batch = {"input_ids": torch.cat([i for i, _ in mine]),
                 "labels": torch.cat([t for _, t in mine])}  # fmt: skip
        got_loss += float(pipe.train_step(batch, None, count=n))
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    grads = grads_of(pipe.named_parameters())
    assert_close(grads, want, "accumulated router aux", reduction=n + 64)


def test_eval_without_a_loss_fn_averages_over_the_labelled_tokens() -> None:
    """Rows of different labelled lengths (3 micro-batches of 2 rows); in the second batch
    the second micro-batch has no labelled token."""
    model = model_of("mixtral", False)
    pipe = conveyor.Pipeline(model_of("mixtral", False), loss_fn=None, microbatches=3,
                             context=conveyor.init(pp=2))  # fmt: skip
    g = torch.Generator().manual_seed(2)
    for lengths in ((7, 3, 6, 1, 5, 2), (7, 3, 0, 0, 5, 2)):
        ids = torch.randint(0, 37, (6, 7), generator=g)
        labels = ids.clone()
        for r, length in enumerate(lengths):
            labels[r, length:] = -100
        batch = {"input_ids": ids, "labels": labels}
        with torch.no_grad():
            want = float(model(**batch).loss)
        got = float(pipe.eval_step(batch))
        assert got == pytest.approx(want, rel=1e-6), (lengths, got, want)
    assert float(pipe.train_step(batch)) == pytest.approx(want, rel=1e-6)  # the same loss
