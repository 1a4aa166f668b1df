"""``ModuleState``: the module-like half of :class:`~conveyor.pipeline.Pipeline` (modes,
parameters, state dicts), over the user's model before the split and this rank's parts
after it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from torch import nn

if TYPE_CHECKING:
    from conveyor._build import RankParts

_S = TypeVar("_S", bound="ModuleState")


class ModuleState:
    """Training mode, parameters and state dicts, as :class:`torch.nn.Module` has them."""

    _model: nn.Module
    _parts: RankParts | None

    @property
    def stages(self) -> list[nn.Module]:
        """This rank's stage modules, in stage order."""
        raise NotImplementedError

    @property
    def training(self) -> bool:
        """Whether dropout and batch norm run in training mode (see :meth:`train`)."""
        return self._model.training

    def train(self: _S, mode: bool = True) -> _S:
        """Set training (or evaluation) mode on the model and this rank's stages.

        Args:
            mode: True: training (dropout on, batch norm updating its statistics); False: eval.

        Returns:
            The pipeline, like :meth:`torch.nn.Module.train` returns the module."""
        self._model.train(mode)
        for stage in self.stages if self._parts is not None else []:
            stage.train(mode)
        return self

    def eval(self: _S) -> _S:
        """Evaluation mode (dropout off, batch norm's running statistics): ``train(False)``."""
        return self.train(False)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, with their names in the original model; a weight tied
        across this rank's stages comes once (before a split made on the first batch: the
        whole model's)."""
        if self._parts is None:
            return self._model.named_parameters()
        return self._parts.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (pass them to the optimizer)."""
        return (p for _, p in self.named_parameters())

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of the model's state dict, keyed by the original names (the
        whole model's before a split made on the first batch)."""
        if self._parts is None:
            return dict(self._model.state_dict())
        return self._parts.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Load this rank's entries from a full or partial model state dict.

        Args:
            state: name -> tensor, names as in the original model; keys of stages on other
                ranks are ignored.
            strict: raise when a key of a local stage is missing.

        Raises:
            ConfigError: ``strict`` and keys this rank needs are missing.
        """
        if self._parts is None:
            self._model.load_state_dict(state, strict=strict)
        else:
            self._parts.load_state_dict(state, strict)
