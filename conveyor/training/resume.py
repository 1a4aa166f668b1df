"""What a checkpoint needs beyond the model and optimizer for an exact resume.

:func:`conveyor.save` stores the model, the optimizer and the step. A fit also needs its
data order's seed, the learning-rate scheduler, the callbacks' state and each rank's random
number generators (dropout). Each rank writes them to
``<checkpoint_dir>/trainer/step-<step>/rank-<rank>.pt`` *before* ``conveyor.save`` commits
the checkpoint of that step, so every committed checkpoint has them; rank 0 removes the
files of other steps after the commit.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from conveyor.pipeline import Pipeline

FOLDER = "trainer"


@dataclass(frozen=True)
class Restorable:
    """What a fit's checkpoint saves and its resume loads back into.

    Attributes:
        pipe: The pipeline (model state, through :func:`conveyor.save`).
        optimizer: Its optimizer.
        lr_scheduler: The learning-rate scheduler, or ``None``.
        callbacks: The callbacks; those with ``state_dict`` / ``load_state_dict`` keep state.
    """

    pipe: Pipeline
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    callbacks: Sequence[Any]


def _step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / FOLDER / f"step-{step:08d}"


def random_states(device: torch.device) -> dict[str, Any]:
    """This process's random number generator states (CPU, and the device's on CUDA)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_random_states(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`random_states` returned."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def write(root: str | os.PathLike[str], step: int, rank: int, payload: dict[str, Any]) -> None:
    """Write this rank's fit state for the checkpoint of ``step`` (atomically).

    Args:
        root: The checkpoint directory.
        step: The step the checkpoint is saved at.
        rank: This process's global rank.
        payload: The state (picklable).
    """
    folder = _step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"rank-{rank}.pt.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, folder / f"rank-{rank}.pt")


def read(root: str | os.PathLike[str], step: int, rank: int) -> dict[str, Any] | None:
    """This rank's fit state of the checkpoint of ``step``.

    A run resumed on another number of processes reads rank 0's file without its random
    number generator states (they belong to another process).

    Args:
        root: The checkpoint directory.
        step: The step the checkpoint was saved at.
        rank: This process's global rank.

    Returns:
        The state, or ``None`` when the checkpoint was not saved by a trainer.
    """
    folder = _step_dir(root, step)
    own = folder / f"rank-{rank}.pt"
    if own.is_file():
        return dict(torch.load(own, weights_only=False))
    first = folder / "rank-0.pt"
    if not first.is_file():
        return None
    payload = dict(torch.load(first, weights_only=False))
    payload.pop("rng", None)
    return payload


def prune(root: str | os.PathLike[str], keep: int) -> None:
    """Remove the fit state of every step but ``keep`` (rank 0, after a commit).

    Args:
        root: The checkpoint directory.
        keep: The step of the checkpoint just committed.
    """
    folder = Path(root) / FOLDER
    if not folder.is_dir():
        return
    for old in folder.iterdir():
        if old.is_dir() and old.name.startswith("step-") and old.name != f"step-{keep:08d}":
            shutil.rmtree(old, ignore_errors=True)


def _state_of(cb: Any) -> dict[str, Any]:
    method = getattr(cb, "state_dict", None)
    return dict(method()) if callable(method) else {}


def save(parts: Restorable, root: str | os.PathLike[str], step: int, seed: int) -> None:
    """Save a fit's checkpoint of ``step`` (every rank calls it).

    Args:
        parts: The fit's pipeline, optimizer, scheduler and callbacks.
        root: The checkpoint directory.
        step: The optimizer steps done.
        seed: The data order's seed.
    """
    import conveyor.checkpoint as checkpoint

    ctx = parts.pipe.context
    sched = parts.lr_scheduler
    payload = {
        "step": step,
        "seed": seed,
        "rng": random_states(ctx.device),
        "lr_scheduler": sched.state_dict() if sched is not None else None,
        "callbacks": [_state_of(cb) for cb in parts.callbacks],
    }
    write(root, step, ctx.rank, payload)
    checkpoint.save(parts.pipe, root, parts.optimizer, step=step)
    if ctx.rank == 0:
        prune(root, step)


def restore(
    parts: Restorable, root: str | os.PathLike[str], max_steps: int
) -> tuple[int, int | None] | None:
    """Load the latest checkpoint in ``root`` into a fit's parts (every rank calls it).

    The model and optimizer come from :func:`conveyor.load`; the scheduler, callbacks and
    random number generators from this module's files. A checkpoint a hand-written loop
    saved has none: the scheduler is then stepped up to the checkpoint's step.

    Args:
        parts: The fit's pipeline, optimizer, scheduler and callbacks.
        root: The checkpoint directory.
        max_steps: The fit's last step (a later checkpoint counts as done).

    Returns:
        ``(step, data seed or None)``, or ``None`` when ``root`` holds no checkpoint.
    """
    import conveyor.checkpoint as checkpoint

    if not checkpoint.exists(root):
        return None
    step = checkpoint.load(parts.pipe, root, parts.optimizer) or 0
    ctx = parts.pipe.context
    payload = read(root, step, ctx.rank)
    sched = parts.lr_scheduler
    if payload is None:
        for _ in range(step if sched is not None else 0):
            sched.step()
        return min(step, max_steps), None
    if sched is not None and payload.get("lr_scheduler") is not None:
        sched.load_state_dict(payload["lr_scheduler"])
    for cb, cb_state in zip(parts.callbacks, payload.get("callbacks", []), strict=False):
        if cb_state and callable(getattr(cb, "load_state_dict", None)):
            cb.load_state_dict(cb_state)
    if "rng" in payload:
        set_random_states(payload["rng"], ctx.device)
    return min(step, max_steps), int(payload["seed"])
