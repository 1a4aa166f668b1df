"""A small training run for ``tests/checkpoint/test_restart.py`` (run under ``conveyor launch``).

2 pipeline ranks train ``tests.support.models.mlp`` with AdamW on batches that are a function of
the step, saving a checkpoint every ``--save-every`` steps and resuming from it when one
exists. On the first attempt (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0) rank 1 kills
itself with SIGKILL before step ``--kill-at``; torchrun then restarts both ranks. The last
step's state goes to the checkpoint ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Iterable

import torch
from torch import nn

import conveyor
from conveyor.checkpoint import exists
from tests.support.models import mlp


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``, the same in every attempt."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--kill-at", type=int, default=6)
    args = ap.parse_args()

    ctx = conveyor.init()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    pipe = conveyor.Pipeline(mlp(), loss_fn=nn.functional.mse_loss, microbatches=2)
    opt = optimizer(pipe.parameters())
    start = conveyor.load(pipe, args.checkpoint, opt) or 0 if exists(args.checkpoint) else 0
    print(f"rank {ctx.rank} attempt {attempt} starts at step {start}", flush=True)
    for step in range(start, args.steps):
        if step == args.kill_at and ctx.rank == 1 and attempt == 0:
            print(f"rank 1 kills itself before step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        pipe.train_step(*batch(step))
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.save_every == 0:
            conveyor.save(pipe, args.checkpoint, opt, step=step + 1)
    conveyor.save(pipe, args.out, opt, step=args.steps)
    print(f"rank {ctx.rank} attempt {attempt} done", flush=True)


if __name__ == "__main__":
    main()
