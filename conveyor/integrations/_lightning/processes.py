"""The strategy's processes: which replica of the data each reads, the process group's
options, and what a spawn / fork launcher hands back to the main process: the trained
network's weights, gathered into rank 0 for a network of at most :data:`GATHER_LIMIT`
bytes, else through a conveyor checkpoint each rank writes its part of, which the main
process reads one tensor at a time (no process ever holds two copies of the network)."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.context import Context, backend_timeout
from conveyor.errors import CheckpointError, ConfigError
from conveyor.integrations._lightning_parts import PipelineNetwork

GATHER_LIMIT = 2**30
"""The largest network (bytes of its parameters and buffers, 1 GiB) whose trained weights
a spawn / fork launcher gathers into rank 0 to hand to the main process; a larger one is
handed over through a temporary conveyor checkpoint that every rank writes its part of
(``PipelineStrategy(gather_limit=...)`` sets another bound)."""


def sampler_arguments(ctx: Context | None) -> tuple[int, int]:
    """``(num_replicas, rank)`` of the ``DistributedSampler`` a process reads with: its
    data-parallel replica among ``dp_size``, so every pipeline (and tensor-parallel) rank
    of one replica reads that replica's shard.

    Args:
        ctx: The process's context (None before it is made: one replica).
    """
    if ctx is None:
        return 1, 0
    return ctx.dp_size, ctx.dp_rank


def process_group_options(
    device: torch.device, backend: str, timeout: float | None
) -> dict[str, Any]:
    """Keywords for Lightning's process group start, beside the backend.

    Args:
        device: This process's device: a GPU is bound at once, as ``conveyor.init`` does.
        backend: The process group's backend.
        timeout: Seconds any wait on another rank may take (None: Lightning's own; conveyor's
            own waits keep theirs).
    """
    options: dict[str, Any] = {}
    if device.type != "cpu":
        options["device_id"] = device
    if timeout is not None:
        options["timeout"] = timedelta(seconds=backend_timeout(backend, float(timeout)))
    return options


def check_one_process(device: torch.device) -> None:
    """Refuse one process on a GPU: conveyor's one-process world runs on the CPU.

    Raises:
        ConfigError: ``device`` is not the CPU, in one sentence.
    """
    if device.type != "cpu":
        raise ConfigError(
            f"one process runs every pipeline stage on the CPU, not on {device}; give the "
            f"Trainer devices=pp*dp to run a stage per {device.type} device, or "
            f"accelerator='cpu'"
        )


def network_bytes(network: nn.Module) -> int:
    """Bytes of ``network``'s parameters and buffers, each tensor once, from their shapes
    (the same on every rank, meta tensors included)."""
    tensors = (*network.parameters(), *network.buffers())  # each without repeats
    return sum(t.numel() * t.element_size() for t in tensors)


def rank_zero_results(strategy: Any, trainer: Any, collect: Callable[[], Any]) -> Any:
    """What a spawn / fork launcher's rank 0 hands back to the main process: Lightning's
    ``_WorkerOutput``, whose ``weights_path`` names the whole trained network's weights:
    a file of them gathered into rank 0, or the directory of a conveyor checkpoint
    (:meth:`trained_weights`).

    Args:
        strategy: The pipeline strategy (its ``trained_weights`` is a collective, so every
            rank calls it, before Lightning's own collection).
        trainer: Lightning's trainer.
        collect: Lightning's own collection (None on ranks other than 0).
    """
    weights = strategy.trained_weights(trainer)
    output = collect()
    if output is None or output.weights_path is None:
        return output
    if isinstance(weights, dict):
        prefix = f"{strategy.module_attr}."
        save = strategy.checkpoint_io.save_checkpoint
        save({prefix + k: v for k, v in weights.items()}, output.weights_path)
        return output
    # Lightning's own file holds rank 0's stages alone: of no use to the main process.
    discard(Path(output.weights_path))
    if weights is None:  # not fitting, or a network on meta: its weights are in checkpoints
        return output._replace(weights_path=None)
    return output._replace(weights_path=str(weights))


def discard(file: Path) -> None:
    """Remove a temporary file and its directory (left if other files are in it)."""
    with contextlib.suppress(OSError):
        file.unlink()
        file.parent.rmdir()


def returned_weights(strategy: Any, trainer: Any, output: Any) -> Any:
    """The main process's side of :func:`rank_zero_results`: the network is filled from a
    returned checkpoint directory, one tensor at a time, and the directory removed.

    Returns:
        ``output`` for Lightning's own recovery: without ``weights_path`` where it was
        such a directory (a gathered file is Lightning's to load).
    """
    path = output.weights_path
    if path is None or not Path(path).is_dir():
        return output
    try:
        network = getattr(trainer.lightning_module, strategy.module_attr)
        if isinstance(network, PipelineNetwork):
            network = network.original
        fill_from(network, Path(path))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return output._replace(weights_path=None)


def fill_from(network: nn.Module, path: Path) -> None:
    """Copy every tensor of ``network``'s state that the checkpoint at ``path`` holds into
    it, reading one tensor at a time (the network's other tensors are left as they are).

    Raises:
        CheckpointError: a tensor of another shape, in one sentence.
    """
    from conveyor.weights.sources import open_source

    source = open_source(path)
    stored = set(source.names())
    done: set[int] = set()
    with torch.no_grad():
        for name, tensor in network.state_dict(keep_vars=True).items():
            key = source.alias(name)
            if not isinstance(tensor, torch.Tensor) or id(tensor) in done or key not in stored:
                continue
            if source.shape(key) != tuple(tensor.shape):
                raise CheckpointError(
                    f"the trained {name} has shape {source.shape(key)} but the main "
                    f"process's network has {tuple(tensor.shape)}; build the same network "
                    f"in every process"
                )
            tensor.copy_(source.read([key])[key])
            done.add(id(tensor))
