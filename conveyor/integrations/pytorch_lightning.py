""":class:`~conveyor.integrations.lightning.PipelineStrategy` for the standalone
``pytorch_lightning`` package (``import pytorch_lightning as pl``), whose Trainer accepts
only its own strategy classes: the same body
(:class:`~conveyor.integrations._lightning.strategy.StrategyBody`) joined with
``pytorch_lightning``'s ``ParallelStrategy``, and ``lightning_fabric``'s pieces.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from lightning_fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning_fabric.utilities.seed import _collect_rng_states, _set_rng_states, reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only
from pytorch_lightning.plugins.precision import MixedPrecision, Precision
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.strategies.launchers import _SubprocessScriptLauncher
from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from pytorch_lightning.trainer.states import TrainerFn

from conveyor.integrations._lightning.checkpoints import TRAINER_STATE
from conveyor.integrations._lightning.package import Package
from conveyor.integrations._lightning.processes import (
    GATHER_LIMIT,
    rank_zero_results,
    returned_weights,
)
from conveyor.integrations._lightning.strategy import StrategyBody

__all__ = ["GATHER_LIMIT", "TRAINER_STATE", "PipelineStrategy"]

PACKAGE = Package(
    trainer_fn=TrainerFn,
    precision=Precision,
    mixed_precision=MixedPrecision,
    script_launcher=_SubprocessScriptLauncher,
    init_process_group=_init_dist_connection,
    default_backend=_get_default_process_group_backend_for_device,
    reduce=_sync_ddp_if_available,
    rng_states=_collect_rng_states,
    set_rng_states=_set_rng_states,
    reset_seed=reset_seed,
    rank_zero_only=rank_zero_only,
)
"""What the strategy's body uses of ``pytorch_lightning`` and ``lightning_fabric``."""


class Launcher(_MultiProcessingLauncher):
    """``pytorch_lightning``'s spawn / fork launcher, handing the main process the whole
    trained network, gathered or through a checkpoint (as
    :class:`conveyor.integrations.lightning.Launcher`)."""

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        own = super()._collect_rank_zero_results
        return rank_zero_results(trainer.strategy, trainer, lambda: own(trainer, results))

    def _recover_results_in_main_process(self, worker_output: Any, trainer: pl.Trainer) -> None:
        output = returned_weights(trainer.strategy, trainer, worker_output)
        super()._recover_results_in_main_process(output, trainer)


class PipelineStrategy(StrategyBody, ParallelStrategy):
    """:class:`conveyor.integrations.lightning.PipelineStrategy` (same arguments, same
    behaviour) as a ``pytorch_lightning.strategies.ParallelStrategy``."""

    strategy_name = "conveyor_pipeline"
    package = PACKAGE
    launcher_class = Launcher
