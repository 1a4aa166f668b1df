"""The strategy's checkpoints and the weights it hands back: the Lightning methods that
write and read conveyor's checkpoint directories, and what a spawn / fork launcher gives
the main process after fitting. A base of
:class:`~conveyor.integrations._lightning.strategy.StrategyBody`, which provides what is
declared below for type checking."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from conveyor.checkpoint import save as save_checkpoint
from conveyor.errors import ConfigError
from conveyor.integrations._hf_model import gather_state_dict
from conveyor.integrations._lightning import checkpoints
from conveyor.integrations._lightning.package import Package
from conveyor.integrations._lightning.processes import network_bytes
from conveyor.integrations._lightning_parts import PipelineNetwork
from conveyor.pipeline import Pipeline
from conveyor.weights import has_meta


class CheckpointMethods:
    """Checkpoints into conveyor's format (any split, schedule or process count loads
    them) and the trained weights a launcher hands back."""

    package: ClassVar[Package]

    if TYPE_CHECKING:  # the strategy's members these methods use
        pipe: Pipeline | None
        module_attr: str
        gather_limit: int
        optimizers: Any

        @property
        def lightning_module(self) -> Any: ...
        @property
        def is_global_zero(self) -> bool: ...
        def barrier(self, name: str | None = None) -> None: ...
        def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the pipeline, which ``setup`` makes."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The optimizer's state comes from conveyor's checkpoint."""
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing: the network's state goes into conveyor's checkpoint."""
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Nothing: the optimizer's state goes into conveyor's checkpoint."""
        return {}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the network."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the optimizer."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Write a checkpoint directory: conveyor's checkpoint of the network (and the
        optimizer), each rank its part, and Lightning's state in ``TRAINER_STATE``.

        Args:
            checkpoint: Lightning's checkpoint dict.
            filepath: The directory (every rank takes rank 0's).
            storage_options: Not taken.
        """
        if storage_options is not None:
            raise ConfigError(
                "PipelineStrategy writes conveyor checkpoints without a CheckpointIO; drop "
                "storage_options"
            )
        assert self.pipe is not None
        path = Path(self.broadcast(str(filepath)))
        optimizer = self.optimizers[0] if self.optimizers else None
        checkpoints.save(self.pipe, path, checkpoint, optimizer, self.is_global_zero,
                         self.barrier)  # fmt: skip

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Load a checkpoint directory :meth:`save_checkpoint` wrote (any split, schedule
        or process count) into the pipeline (and the optimizer, when fitting).

        Returns:
            Lightning's state (loops, callbacks, LR schedulers, ...).
        """
        assert self.pipe is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        optimizer = self.optimizers[0] if self.optimizers else None
        return checkpoints.load(self.pipe, path, optimizer)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a checkpoint directory (rank 0)."""
        if self.is_global_zero:
            checkpoints.remove(Path(filepath))

    def network_on_meta(self) -> bool:
        """Whether any tensor of the network this rank was given is still on the meta
        device (built under ``conveyor.empty_weights``, other ranks' stages unset)."""
        return has_meta([self._original()])

    def whole_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole network's state dict, gathered from every stage. A collective: call
        it on every rank.

        Returns:
            The state dict under the network's own names on rank 0, ``{}`` elsewhere.
        """
        assert self.pipe is not None
        return gather_state_dict(self.pipe, self._original())

    def trained_weights(self, trainer: Any) -> dict[str, torch.Tensor] | Path | None:
        """What a spawn / fork launcher hands the main process after fitting, a collective
        (the same kind of answer on every rank):

        - a network of at most ``gather_limit`` bytes: :meth:`whole_state_dict`, gathered
          into rank 0;
        - a larger one: the directory of a :func:`conveyor.save` checkpoint (made in the
          temporary directory of rank 0's machine), every rank writing its own part of it,
          so no process holds the network whole; the main process reads it one tensor at
          a time and removes it;
        - None when not fitting, or for a network on the meta device (no process may hold
          it whole: each keeps the others' stages on meta; its weights are in the
          checkpoints).
        """
        if trainer.state.fn != self.package.trainer_fn.FITTING or self.network_on_meta():
            return None
        if network_bytes(self._original()) <= self.gather_limit:
            return self.whole_state_dict()
        assert self.pipe is not None
        made = tempfile.mkdtemp(prefix="conveyor-weights-") if self.is_global_zero else None
        path = Path(self.broadcast(made))
        save_checkpoint(self.pipe, path)
        return path

    def _original(self) -> torch.nn.Module:
        stand_in = getattr(self.lightning_module, self.module_attr)
        assert isinstance(stand_in, PipelineNetwork)
        return stand_in.original
