"""A run whose second step fails on one rank (tests/parallel/test_exit.py).

    torchrun --nproc-per-node 2 tests/support/exit_fail.py propagate|catch|catch-no-board

Rank 1 (the last stage) passes ``targets=None`` to its second ``train_step``: a
``ConfigError`` at once. With ``propagate`` its script ends with that error; with ``catch``
it catches it and returns normally; ``catch-no-board`` too, without the failure board
(as in a job whose store conveyor cannot reach: only rank 1's exit can tell rank 0). Rank
0 lets its own error propagate. Each rank prints
when (wall clock) its failing step began, its error, and ``returns normally`` if it does.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

import conveyor


def say(line: str) -> None:
    """``line`` in one write: the two ranks share the pipe (print's text and newline,
    written apart, can interleave with the other rank's line)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def main(how: str) -> None:
    ctx = conveyor.init(pp=2, timeout=60)
    if how == "catch-no-board":
        import conveyor._failure as failure

        failure.board().store = None
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    pipe = conveyor.Pipeline(model, loss_fn=nn.functional.mse_loss, microbatches=4, context=ctx)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    pipe.train_step(x, y)
    say(f"rank {ctx.rank}: failing step at {time.time():.3f}")
    try:
        pipe.train_step(x, None if ctx.rank == 1 else y)
    except conveyor.ConveyorError as error:
        say(f"rank {ctx.rank}: {type(error).__name__}: {error}")
        if how == "propagate" or ctx.rank == 0:
            raise
    say(f"rank {ctx.rank}: returns normally")


if __name__ == "__main__":
    main(sys.argv[1])
