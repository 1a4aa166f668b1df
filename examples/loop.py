"""What every example shares: the pipeline options of its command line, the context they
ask for, and the loop that trains, logs and checkpoints.

:func:`trainer` gives an example a :class:`conveyor.Trainer` set up from the command line
(checkpoints, a progress line a tenth of the way): the loop written once, for data that
is a ``Dataset``. :func:`train` is the same loop by hand, for examples that draw each
step's batch from the step number (``gpt.py``, ``hf_llama.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import conveyor
from conveyor.checkpoint import exists
from conveyor.observe.progress import Progress
from conveyor.training import Callback, ProgressBar


def add_pipeline_options(ap: argparse.ArgumentParser) -> None:
    """``--pp``, ``--schedule``, ``--chunks``, ``--microbatches``, ``--checkpoint`` and
    ``--save-every``."""
    ap.add_argument(
        "--pp", type=int, default=None, help="pipeline ranks (default: processes, or 2)"
    )
    ap.add_argument("--schedule", default="1f1b", help="schedule name (default: %(default)s)")
    ap.add_argument(
        "--chunks", type=int, default=None, help="stages per rank (default: the schedule's)"
    )
    ap.add_argument(
        "--microbatches", type=int, default=4, help="micro-batches per step (default: %(default)s)"
    )
    ap.add_argument("--checkpoint", default=None, metavar="DIR", help="save to / resume from DIR")
    ap.add_argument(
        "--save-every",
        type=int,
        default=50,
        metavar="K",
        help="steps between saves (default: %(default)s)",
    )


def context(args: argparse.Namespace, dp: int = 1, tp: int = 1) -> conveyor.Context:
    """``--pp`` pipeline ranks; without it, as many as the launched processes allow, or two
    in one process when started with plain ``python``."""
    pp = args.pp or (None if dist.is_torchelastic_launched() else 2)
    return conveyor.init(pp=pp, dp=dp, tp=tp)


def printer(ctx: conveyor.Context) -> Callable[..., None]:
    """``print`` on rank 0, nothing elsewhere."""
    return print if ctx.rank == 0 else (lambda *a, **k: None)


def where(ctx: conveyor.Context, fsdp: bool = False) -> str:
    """Where the stages run, for the first line a run prints."""
    if not ctx.distributed:
        return f"in one process ({ctx.pp_size} pipeline ranks simulated)"
    place = f"on {ctx.pp_size} ranks"
    if ctx.dp_size > 1 or ctx.tp_size > 1:
        replicas = f"{ctx.dp_size} replicas{' (FSDP)' if fsdp else ''}"
        place += f" x {replicas} x {ctx.tp_size} tensor-parallel"
    return place


def trainer(
    pipe: conveyor.Pipeline,
    opt: torch.optim.Optimizer,
    args: argparse.Namespace,
    callbacks: tuple[Callback, ...] = (),
    **options: Any,
) -> conveyor.Trainer:
    """A :class:`conveyor.Trainer` that logs a tenth of the way and, with ``--checkpoint``,
    saves every ``--save-every`` steps (resume with ``fit(..., resume=True)``);
    ``options`` are the Trainer's other keywords (``lr_scheduler``, ``max_grad_norm``)."""
    return conveyor.Trainer(
        pipe,
        opt,
        callbacks=[ProgressBar(), *callbacks],
        checkpoint_dir=args.checkpoint,
        checkpoint_every=args.save_every if args.checkpoint else None,
        **options,
    )


def train(
    pipe: conveyor.Pipeline,
    opt: torch.optim.Optimizer,
    step_of: Callable[[int], torch.Tensor],
    steps: int,
    args: argparse.Namespace,
    say: Callable[..., Any],
) -> torch.Tensor:
    """Resume from ``--checkpoint`` if it holds one, run the steps that are left
    (``step_of(k)`` trains step k and returns its loss), log a tenth of the way each, save
    every ``--save-every`` steps and at the end; returns the last loss."""
    start = 0
    if args.checkpoint and exists(args.checkpoint):
        start = min(conveyor.load(pipe, args.checkpoint, opt) or 0, steps)
        say(f"resumed from {args.checkpoint} at step {start}")
    progress = Progress(pipe, steps - start, every=max(steps // 10, 1))
    progress.count = start
    loss = torch.tensor(0.0)
    for step in range(start, steps):
        loss = step_of(step)
        opt.step()
        opt.zero_grad()
        progress.step(loss, args.batch_size)
        done = step + 1
        if args.checkpoint and (done % args.save_every == 0 or done == steps):
            conveyor.save(pipe, args.checkpoint, opt, step=done)
    progress.close()
    return loss
