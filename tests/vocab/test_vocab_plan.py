"""The planner weighs vocabulary parallelism against every layer split: it shows both and
picks the vocabulary split where the output layer dwarfs the blocks, the plain one where
it does not; ``Pipeline(schedule="auto")`` then builds what it picked."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import conveyor
from conveyor.losses import TokenCrossEntropy
from conveyor.runtime.local_part import local_shard
from tests.support import distributed
from tests.support.helpers import assert_close_to_largest
from tests.vocab.models import TinyGPT

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import gpt

SCHEDULES = ["1f1b", "zb-h1"]


def _model_and_batch(vocab: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = gpt.GPT(vocab, 32, 64, 4, 4)
    ids = torch.randint(0, vocab, (8, 33))
    return model, ids[:, :-1], ids[:, 1:].clone()


@pytest.mark.slow
def test_the_plan_picks_vocabulary_parallelism_where_it_wins() -> None:
    picked = {}
    for vocab in (256, 65536):
        model, x, y = _model_and_batch(vocab)
        plan = conveyor.plan(model, x, y, TokenCrossEntropy(), ranks=2, microbatch_counts=[4],
                             schedules=SCHEDULES, calibrate=False)  # fmt: skip
        kinds = {(c.schedule, c.vocab) for c in plan.alternatives}
        assert kinds == {(s, v) for s in SCHEDULES for v in (False, True)}
        assert "1f1b + vocab parallel" in plan.table()
        picked[vocab] = plan.vocab_parallel
        vocab_rows = [c for c in plan.alternatives if c.vocab]
        plain_rows = [c for c in plan.alternatives if not c.vocab]
        # The split rows spread the vocabulary weight: every rank holds about half of it.
        if vocab == 65536:
            weight = vocab * 64 * 4
            assert max(max(c.peak_memory) for c in vocab_rows) < min(
                max(c.peak_memory) for c in plain_rows
            )
            assert min(min(c.peak_memory) for c in vocab_rows) > weight  # rows + gradients
    assert picked == {256: False, 65536: True}


@pytest.mark.slow
def test_schedule_auto_builds_the_vocabulary_split_it_picked() -> None:
    model, x, y = _model_and_batch(65536)
    reference, _, _ = _model_and_batch(65536)
    total, count = TokenCrossEntropy()(reference(x), y)
    (total / count).backward()
    total, count = total.detach(), count
    pipe = conveyor.Pipeline(model, loss_fn=TokenCrossEntropy(), microbatches=4, schedule="auto",
                             sample=(x, y), context=conveyor.init(pp=2))  # fmt: skip
    assert pipe.plan is not None and pipe.plan.vocab_parallel
    assert pipe.schedule.vocab  # the passes are in the schedule
    loss = pipe.train_step(x, y)
    assert abs(float(loss) - float(total / count)) < 1e-5 * float(total / count)
    # (attention's key bias has a zero gradient up to rounding: measured against the largest)
    assert_close_to_largest(
        {n: p.grad for n, p in pipe.named_parameters()},
        {n: p.grad for n, p in reference.named_parameters()},
        "schedule='auto' with vocabulary parallelism",
    )


def _measured(rank: int) -> tuple[Any, ...]:
    """The planner's peak for the vocabulary split on this rank, and what the rank holds:
    its parameters and gradients, the activations autograd kept at the step's peak
    (track_memory), and one micro-batch's logits of its rows."""
    ctx = conveyor.init(pp=2)
    vocab, loss = 4096, TokenCrossEntropy(shift=True)
    torch.manual_seed(0)
    ids = torch.randint(1, vocab, (8, 16))
    plan = conveyor.plan(TinyGPT(vocab=vocab), ids, ids, loss, ranks=2, microbatch_counts=[4],
                         schedules=["1f1b"], calibrate=False, vocab=True)  # fmt: skip
    cand = next(c for c in plan.alternatives if c.vocab)
    pipe = conveyor.Pipeline(TinyGPT(vocab=vocab), loss_fn=loss, microbatches=4,
                             balance=list(cand.balance), vocab_parallel=True,
                             track_memory=True)  # fmt: skip
    pipe.train_step(ids, ids)
    held = sum(4 * local_shard(p).numel() for p in pipe.parameters())
    logits = 2 * 16 * (vocab // 2) * 4  # 2 rows of 16 tokens, this rank's 2048 columns
    return cand.peak_memory[ctx.pp_rank], 2 * held, pipe.last_step_memory().peak, logits


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_memory_model_per_rank_is_what_each_rank_holds() -> None:
    for predicted, params, activations, logits in distributed.run(_measured, 2, fork=True):
        # the planner's count adds AdamW's two states (in fp32 as many bytes as the
        # parameters and gradients, plus a step count per tensor) and the pipeline's send
        # and receive buffers (none on the last rank): a micro-batch's hidden states
        # (2 rows x 16 tokens x 32 x 4 bytes), two of them where the time balance cuts
        # inside a residual block (measured times pick the cut between equal-cost units)
        held = params + activations + logits + params
        hidden = 2 * 16 * 32 * 4
        assert held <= predicted <= held + 2 * 2 * hidden + 256, (predicted, held)
