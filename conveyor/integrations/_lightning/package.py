"""What the strategy's body uses of one Lightning package: ``lightning`` or the standalone
``pytorch_lightning`` with its ``lightning_fabric``. Each package's module fills one in with
its own classes and functions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Package:
    """What the body uses of one Lightning package (``lightning`` or ``pytorch_lightning``
    with its ``lightning_fabric``).

    Attributes:
        trainer_fn: ``TrainerFn``, the Trainer's entry points.
        precision: The 32-bit ``Precision`` plugin class.
        mixed_precision: The ``MixedPrecision`` plugin class.
        script_launcher: ``_SubprocessScriptLauncher`` (``start_method="popen"``).
        init_process_group: ``_init_dist_connection``.
        default_backend: ``_get_default_process_group_backend_for_device``.
        reduce: ``_sync_ddp_if_available``.
        rng_states: ``_collect_rng_states``.
        set_rng_states: ``_set_rng_states``.
        reset_seed: ``reset_seed``.
        rank_zero_only: ``rank_zero_only`` (its ``rank`` is set per process).
    """

    trainer_fn: Any
    precision: type
    mixed_precision: type
    script_launcher: Callable[..., Any]
    init_process_group: Callable[..., Any]
    default_backend: Callable[[torch.device], str]
    reduce: Callable[..., Any]
    rng_states: Callable[[], dict[str, Any]]
    set_rng_states: Callable[[dict[str, Any]], None]
    reset_seed: Callable[[], None]
    rank_zero_only: Any
