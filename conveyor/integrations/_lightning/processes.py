"""The strategy's processes: which replica of the data each reads, the process group's
options, and what a spawn / fork launcher hands back to the main process."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from conveyor.context import Context, backend_timeout
from conveyor.errors import ConfigError


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


def rank_zero_results(strategy: Any, trainer: Any, collect: Callable[[], Any]) -> Any:
    """What a spawn / fork launcher's rank 0 hands back to the main process: Lightning's
    ``_WorkerOutput`` with the whole network's weights, gathered from every stage.

    Args:
        strategy: The pipeline strategy (its ``gathered_network`` is a collective, so every
            rank calls it, before Lightning's own collection).
        trainer: Lightning's trainer.
        collect: Lightning's own collection (None on ranks other than 0).
    """
    whole = strategy.gathered_network(trainer)
    output = collect()
    if output is None or output.weights_path is None:
        return output
    if whole is None:  # not fitting, or a network on meta: its weights are in checkpoints
        return output._replace(weights_path=None)
    prefix = f"{strategy.module_attr}."
    save = strategy.checkpoint_io.save_checkpoint
    save({prefix + k: v for k, v in whole.items()}, output.weights_path)
    return output
    if whole is None:
        return output._replace(weights_path=None)  # nothing for the main process
    save({prefix + k: v for k, v in whole.items()}, output.weights_path)
    return output
