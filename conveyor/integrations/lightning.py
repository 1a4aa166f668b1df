"""Lightning users train through a conveyor pipeline by choosing a strategy.

``L.Trainer(strategy=PipelineStrategy(pp=2), devices=2)`` splits the LightningModule's
network (``self.model``) into pipeline stages, one process each, and runs every batch of
``training_step`` / ``validation_step`` / ``test_step`` as one pipeline step: the
LightningModule's ``self.loss_fn(self.model(inputs), targets)`` (or ``self.model(**batch)
.loss`` for a network computing its own loss) is the whole batch's loss, with the unsplit
network's gradients. Lightning's loop, optimizers, schedulers, gradient accumulation and
clipping, logging, callbacks and checkpoints work as they do on one device; checkpoints
are conveyor's (each rank writes its part, under the network's own names). The guide:
docs/guide/lightning.md.

This module is the strategy on ``lightning.pytorch``; the same strategy on the standalone
``pytorch_lightning`` package is :mod:`conveyor.integrations.pytorch_lightning`. Both are
:class:`~conveyor.integrations._lightning.strategy.StrategyBody` (package-free) joined
with their package's ``ParallelStrategy``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states, reset_seed
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.rank_zero import rank_zero_only

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
"""What the strategy's body uses of ``lightning``."""


class Launcher(_MultiProcessingLauncher):
    """Lightning's spawn / fork launcher; the main process gets the whole trained network,
    not rank 0's stages alone: gathered into rank 0 for a network of at most
    ``gather_limit`` bytes (:data:`GATHER_LIMIT`, 1 GiB, by default), else through a
    temporary conveyor checkpoint every rank writes its part of, which the main process
    reads one tensor at a time and removes. A network built on the meta device is not
    handed back (no process may hold it whole): its weights are in the checkpoints."""

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        own = super()._collect_rank_zero_results
        return rank_zero_results(trainer.strategy, trainer, lambda: own(trainer, results))

    def _recover_results_in_main_process(self, worker_output: Any, trainer: pl.Trainer) -> None:
        output = returned_weights(trainer.strategy, trainer, worker_output)
        super()._recover_results_in_main_process(output, trainer)


class PipelineStrategy(StrategyBody, ParallelStrategy):
    """A Lightning strategy that trains the LightningModule's network as a conveyor pipeline.

    The LightningModule keeps its network in ``self.model`` and its loss in
    ``self.loss_fn`` (``(output, targets) -> scalar``, a pair ``(total, count)``, or
    None / absent when the network computes its own loss from its inputs, like a
    transformers model given ``labels``); its steps compute the loss as
    ``self.loss_fn(self.model(inputs), targets)`` (or ``self.model(**batch).loss``). That
    value is the whole (global) batch's loss, the same on every rank.

    Args:
        pp: Pipeline ranks per replica (default: the processes // (dp * tp)).
        dp: Data-parallel replicas; each reads its own shard of the data.
        module_attr: The LightningModule's attribute holding the network.
        loss_attr: The LightningModule's attribute holding the loss.
        start_method: How Lightning starts ``devices`` processes when no launcher (torchrun)
            did: ``"popen"`` (runs the script again per process, as Lightning's DDP),
            ``"spawn"`` or ``"fork"``.
        process_group_backend: ``"gloo"`` or ``"nccl"`` (default: the device's).
        gather_limit: With ``"spawn"`` / ``"fork"``, the largest network (bytes of its
            parameters and buffers; default :data:`GATHER_LIMIT`, 1 GiB) whose trained
            weights are gathered into rank 0 to hand to the main process; a larger one
            goes through a temporary :func:`conveyor.save` checkpoint, each rank writing
            its own part, which the main process reads one tensor at a time and removes
            (0: always so).
        **pipeline_options: :func:`conveyor.init`'s keywords (``tp``, ``timeout``: seconds
            any wait on another rank may take, the process group's too, ...) and
            :class:`conveyor.Pipeline`'s (``microbatches`` (default: ``pp``),
            ``schedule``, ``chunks``, ``balance``, ``fsdp``, ``tp_plan``, ``compile``,
            ``recompute``, ``sample``, ...).

    Publishing: :func:`conveyor.save_pretrained` writes the trained network as a
    transformers directory (``from_pretrained`` reads it), each rank its own tensors; it is
    a collective, so call it on every rank, from a callback (``trainer.strategy.pipe`` is
    the pipeline)::

        class Publish(L.Callback):
            def on_train_end(self, trainer, pl_module):
                conveyor.save_pretrained(trainer.strategy.pipe, "published")

    or after ``fit`` in a script every rank runs (``start_method="popen"``, torchrun).

    Raises:
        ConfigError: an option the strategy does not take, or a ``gather_limit`` that is
            not an int >= 0, in one sentence.
    """

    strategy_name = "conveyor_pipeline"
    package = PACKAGE
    launcher_class = Launcher
