"""A transformers MoE model's router auxiliary loss under vocabulary parallelism, in one
process (the 4-process run with experts sharded too: test_vocab_moe.py): the step's loss
is the whole batch's token loss plus ``coef`` times the mean of the micro-batches'
auxiliary losses, exactly as without vocabulary parallelism, and so are the gradients;
an eval step gives that loss too."""

from __future__ import annotations

import pytest
import torch

import conveyor
from tests.parallel.test_moe_pipeline import MICRO, batches, count, model_of
from tests.support.helpers import assert_close, grads_of

pytest.importorskip("transformers")


@pytest.mark.slow  # torch.export captures the model: about 20 s
def test_router_aux_loss_with_the_vocabulary_split_is_the_unsplit_models() -> None:
    rows = batches()[0][:MICRO]
    model = model_of("mixtral", True)
    n = torch.tensor(count(rows))
    want_loss = 0.0
    for ids, labels in rows:  # each forward: its tokens over n, plus coef * aux / MICRO
        output = model(input_ids=ids, labels=labels, num_items_in_batch=n)
        loss = output.loss + model.router_aux_loss_coef * output.aux_loss * (1 / MICRO - 1)
        loss.backward()
        want_loss += float(loss.detach())
    want = grads_of(model.named_parameters())
    ids, labels = (torch.cat([row[i] for row in rows]) for i in (0, 1))
    batch = {"input_ids": ids, "labels": labels}
    pipe = conveyor.Pipeline(model_of("mixtral", True), loss_fn=None, microbatches=MICRO,
                             context=conveyor.init(pp=2), vocab_parallel=True)  # fmt: skip
    assert float(pipe.train_step(batch, None)) == pytest.approx(want_loss, rel=1e-6)
    assert_close(grads_of(pipe.named_parameters()), want, "router aux, vocabulary split")
    assert float(pipe.eval_step(batch, None)) == pytest.approx(want_loss, rel=1e-6)
