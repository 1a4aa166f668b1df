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


def rank_zero_results(
    output: Any,
    whole: dict[str, torch.Tensor] | None,
    prefix: str,
    save: Callable[[dict[str, Any], Any], None],
) -> Any:
    """What a spawn / fork launcher's rank 0 hands back to the main process: Lightning's
    ``_WorkerOutput`` with the whole network's weights, gathered from every stage.

    Args:
        output: Lightning's own output (None on other ranks).
        whole: The whole network's state dict, or None when it is not gathered (not
            fitting, or a network on the meta device, which no process may hold whole:
            its weights are in the checkpoints).
        prefix: The network's attribute in the LightningModule, with a dot.
        save: Lightning's ``checkpoint_io.save_checkpoint``.
    """
    if output is None or output.weights_path is None:
        return output
    if whole is None:
        return output._replace(weights_path=None)  # nothing for the main process
    save({prefix + k: v for k, v in whole.items()}, output.weights_path)
    return output
