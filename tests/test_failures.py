"""A dead or stalled rank makes the others fail fast with a message naming it."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

import conveyor
from tests import distributed
from tests.models import batch


class Fault(nn.Module):
    """Identity, except on ``rank`` at its ``after``-th call it dies or hangs."""

    def __init__(self, rank: int, after: int, how: str) -> None:
        super().__init__()
        self.rank, self.after, self.how, self.calls = rank, after, how, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if int(os.environ["RANK"]) == self.rank and self.calls == self.after:
            if self.how == "die":
                os._exit(3)
            time.sleep(3600)
        return x


def _faulty_run(rank: int, how: str, timeout: float) -> str:
    ctx = conveyor.init(timeout=timeout)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), Fault(1, 3, how), nn.Linear(8, 4))
    pipe = conveyor.Pipeline(
        model, loss_fn=nn.functional.mse_loss, microbatches=4, balance=[2, 2], context=ctx
    )
    x, y = batch(8)
    start = time.monotonic()
    try:
        pipe.train_step(x, y)
    except conveyor.PipelineError as exc:
        return f"{time.monotonic() - start:.1f}s {exc}"
    return "no error"


def test_dead_rank_fails_the_others_with_its_name() -> None:
    (msg,) = distributed.run(_faulty_run, 2, "die", 60.0, expect=[0], timeout=120)
    seconds, text = msg.split("s ", 1)
    assert float(seconds) < 30, msg
    assert "rank 1" in text and "rank 0:" in text, msg
    # Rank 1 dies in the forward of micro-batch 2, so rank 0 waits on that gradient.
    assert "B(stage 0, micro-batch 2) waiting for gradients of B(stage 1, micro-batch 2)" in text, (
        msg
    )


def test_stalled_rank_times_out_within_the_set_limit() -> None:
    (msg,) = distributed.run(_faulty_run, 2, "hang", 3.0, expect=[0], timeout=120)
    seconds, text = msg.split("s ", 1)
    assert 2.5 <= float(seconds) < 20, msg
    assert "rank 1" in text and "3 s" in text, msg
    assert "waiting for gradients of B(stage 1, micro-batch 2)" in text, msg
