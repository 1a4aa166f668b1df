"""A fit for ``tests/training/test_trainer.py`` under ``conveyor launch --max-restarts 1``.

    python -m conveyor.launch --nproc-per-node 2 --max-restarts 1 \
        tests/support/trainer_restart.py CK OUT

2 pipeline ranks fit 12 steps with checkpoints every 3; on the first attempt rank 1 kills
itself (SIGKILL) after step 7, torchrun restarts both ranks, they resume from step 6 and
rank 0 saves the resumed attempt's losses to OUT.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import conveyor
from conveyor.training import Callback, FitState, Trainer
from tests.training.test_trainer import model, samples


class Kill(Callback):
    """Rank 1 kills itself after step ``at`` on the first attempt; says where fits start."""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def on_fit_start(self, trainer: Trainer, state: FitState) -> None:
        if state.resumed:
            rank = state.pipe.context.rank
            print(f"rank {rank} attempt {self.attempt} resumed at step {state.step}", flush=True)

    def on_step_end(self, trainer: Trainer, state: FitState) -> None:
        ctx = state.pipe.context
        if state.step == self.at and ctx.rank == 1 and self.attempt == 0:
            print(f"rank 1 kills itself after step {state.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def fit(checkpoint: str | None, kill: int | None) -> list[float]:
    """The fit's losses (those of this attempt); one process without torchrun."""
    ctx = conveyor.init(pp=2)
    torch.manual_seed(3)
    pipe = conveyor.Pipeline(
        model(dropout=0.1), loss_fn=nn.functional.cross_entropy, microbatches=2,
        balance=[3, 3], context=ctx,
    )  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))
    trainer = Trainer(
        pipe, opt, lr_scheduler=sched, callbacks=[Kill(kill)], max_grad_norm=1.0,
        checkpoint_dir=checkpoint, checkpoint_every=3 if checkpoint else None,
    )  # fmt: skip
    history = trainer.fit(
        TensorDataset(*samples(64)), batch_size=16, max_steps=12, resume=checkpoint is not None
    )
    return history.losses


if __name__ == "__main__":
    losses = fit(sys.argv[1], kill=7)
    if conveyor.init().rank == 0:
        torch.save(losses, sys.argv[2])
