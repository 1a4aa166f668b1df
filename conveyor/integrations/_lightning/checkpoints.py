"""Checkpoint directories: conveyor's checkpoint of the network and the optimizer (each
rank writes its part, under the network's own names) beside Lightning's own state."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from conveyor.checkpoint import load as load_checkpoint
from conveyor.checkpoint import save as save_checkpoint
from conveyor.pipeline import Pipeline

TRAINER_STATE = "lightning.pt"
"""The file in a checkpoint directory with Lightning's own state (loops, callbacks, LR
schedulers, epoch, hyperparameters); the model and optimizer are conveyor's checkpoint
beside it."""


def save(
    pipe: Pipeline,
    path: Path,
    checkpoint: Mapping[str, Any],
    optimizer: Any,
    is_zero: bool,
    barrier: Callable[[], None],
) -> None:
    """Write a checkpoint directory (a collective: every rank, the same ``path``).

    Args:
        pipe: The pipeline (each rank saves its part).
        path: The directory; a file of that name (Lightning's own format) is replaced.
        checkpoint: Lightning's checkpoint dict; its ``state_dict`` and
            ``optimizer_states`` are left to conveyor's checkpoint.
        optimizer: The optimizer (None: not saved).
        is_zero: Whether this is global rank 0, which writes Lightning's state.
        barrier: Waits for every process.
    """
    if is_zero and path.is_file():
        path.unlink()
    barrier()
    state = dict(checkpoint)
    state.pop("state_dict", None)
    if state.pop("optimizer_states", None) is None:
        optimizer = None
    step = state.get("global_step")
    save_checkpoint(pipe, path, optimizer, step=int(step) if step is not None else None)
    if is_zero:
        tmp = path / f"{TRAINER_STATE}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path / TRAINER_STATE)
    barrier()


def load(pipe: Pipeline, path: Path, optimizer: Any) -> dict[str, Any]:
    """Load a checkpoint directory :func:`save` wrote (any split, schedule or process
    count) into the pipeline and ``optimizer`` (None: not loaded).

    Returns:
        Lightning's state (loops, callbacks, LR schedulers, ...), with an empty
        ``state_dict``.
    """
    load_checkpoint(pipe, path, optimizer)
    state: dict[str, Any] = torch.load(path / TRAINER_STATE, weights_only=False)
    state["state_dict"] = {}
    return state


def remove(path: Path) -> None:
    """Remove a checkpoint directory (or a file of that name)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
