"""What the language-model examples share: training text every machine has (the Python
standard library's own source, as characters), the batches drawn from it, and the loop
that trains, logs and checkpoints."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import conveyor
from conveyor.checkpoint import exists
from conveyor.progress import Progress


def corpus(limit: int) -> str:
    """Up to ``limit`` characters of the standard library's Python source, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    return "".join(parts)[:limit]


def windows(data: torch.Tensor, step: int, rows: int, length: int) -> torch.Tensor:
    """``rows`` windows of ``length + 1`` tokens; the batch of a step depends on the step
    alone, so a run resumed from a checkpoint repeats nothing."""
    gen = torch.Generator().manual_seed(step)
    at = torch.randint(len(data) - length - 1, (rows,), generator=gen)
    return torch.stack([data[i : i + length + 1] for i in at.tolist()])


def train(
    pipe: conveyor.Pipeline,
    opt: torch.optim.Optimizer,
    step_of: Callable[[int], torch.Tensor],
    steps: int,
    batch_size: int,
    checkpoint: str | None,
    save_every: int,
    say: Callable[..., Any],
) -> torch.Tensor:
    """Resume from ``checkpoint`` if it holds one, run the steps that are left
    (``step_of(k)`` trains step k and returns its loss), log a tenth of the way each, save
    every ``save_every`` steps and at the end; returns the last loss."""
    start = 0
    if checkpoint and exists(checkpoint):
        start = min(conveyor.load(pipe, checkpoint, opt) or 0, steps)
        say(f"resumed from {checkpoint} at step {start}")
    progress = Progress(pipe, steps - start, every=max(steps // 10, 1))
    progress.count = start
    loss = torch.tensor(0.0)
    for step in range(start, steps):
        loss = step_of(step)
        opt.step()
        opt.zero_grad()
        progress.step(loss, batch_size)
        done = step + 1
        if checkpoint and (done % save_every == 0 or done == steps):
            conveyor.save(pipe, checkpoint, opt, step=done)
    progress.close()
    return loss
