"""The pieces :class:`~conveyor.integrations.lightning.PipelineStrategy` puts into a
LightningModule: the network's stand-in, its deferred output and the loss that runs the
pipeline step.

Inside ``training_step`` the user's ``self.loss_fn(self.model(inputs), targets)`` keeps its
meaning: ``self.model(...)`` records the inputs and returns a :class:`PipelineOutput`;
``self.loss_fn(output, targets)`` (or ``output.loss`` for a network that computes its own)
runs the whole batch through the pipeline and returns its loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from conveyor.errors import ConfigError
from conveyor.losses import output_field


class Runner(Protocol):
    """What the stand-ins call back into (the strategy's step interceptor)."""

    def network_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def loss_call(self, output: PipelineOutput, targets: Any) -> torch.Tensor: ...


USE = (
    "under PipelineStrategy the network's output exists only on the last stage's rank: "
    "use it only as self.loss_fn(output, targets) (or output.loss for a network that "
    "computes its own loss) in training_step / validation_step / test_step, and compute "
    "other metrics in predict_step"
)


class PipelineOutput:
    """The network's output inside a step: its inputs, waiting for the loss.

    Args:
        runner: The step interceptor that runs the step.
        inputs: The network's inputs as the pipeline takes them (tensor, tuple or dict).
    """

    __slots__ = ("inputs", "runner", "used")

    def __init__(self, runner: Runner, inputs: Any) -> None:
        self.runner = runner
        self.inputs = inputs
        self.used = False

    def __getattr__(self, name: str) -> Any:
        if name == "loss":
            return self.runner.loss_call(self, None)
        raise ConfigError(f"output.{name}: {USE}")

    def __getitem__(self, key: Any) -> Any:
        if key == "loss":
            return self.runner.loss_call(self, None)
        raise ConfigError(f"output[{key!r}]: {USE}")

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:  # fmt: skip
        raise ConfigError(f"{getattr(func, '__name__', func)}(output, ...): {USE}")


class PipelineNetwork(nn.Module):
    """The LightningModule's network under the strategy: this rank's stages.

    Its parameters are this rank's (``configure_optimizers`` over ``self.parameters()``
    gets them); calling it inside a step records the inputs for the pipeline.

    Args:
        runner: The strategy's step interceptor.
        network: The network it stands for (kept for its modes: a graph captured with
            torch.export reads dropout and batch norm modes from it).
    """

    def __init__(self, runner: Runner, network: nn.Module) -> None:
        super().__init__()
        # Kept out of the module tree: not submodules of the LightningModule.
        self.__dict__["runner"] = runner
        self.__dict__["original"] = network
        self.stages = nn.ModuleList()

    @property
    def runner(self) -> Runner:
        """What its calls go to."""
        runner: Runner = self.__dict__["runner"]
        return runner

    @property
    def original(self) -> nn.Module:
        """The network it stands for."""
        network: nn.Module = self.__dict__["original"]
        return network

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Record the inputs of a step (a :class:`PipelineOutput`), or predict."""
        return self.runner.network_call(args, kwargs)

    def train(self, mode: bool = True) -> PipelineNetwork:
        """Set the mode of the stages and of the original network."""
        super().train(mode)
        self.original.train(mode)
        return self


class PipelineLoss(nn.Module):
    """The LightningModule's ``loss_fn`` under the strategy: given a
    :class:`PipelineOutput` it runs the step; given anything else, the loss itself.

    Args:
        runner: The strategy's step interceptor.
        loss_fn: The user's loss.
    """

    def __init__(self, runner: Runner, loss_fn: Callable[..., Any]) -> None:
        super().__init__()
        self.__dict__["runner"] = runner
        self.__dict__["loss_fn"] = loss_fn

    @property
    def runner(self) -> Runner:
        """What its calls go to."""
        runner: Runner = self.__dict__["runner"]
        return runner

    @property
    def loss_fn(self) -> Callable[..., Any]:
        """The user's loss."""
        loss_fn: Callable[..., Any] = self.__dict__["loss_fn"]
        return loss_fn

    def forward(self, output: Any, targets: Any = None, *args: Any, **kwargs: Any) -> Any:
        """The pipeline's loss for a step's output; else ``loss_fn(output, targets)``."""
        if isinstance(output, PipelineOutput):
            if args or kwargs:
                raise ConfigError(
                    "under PipelineStrategy self.loss_fn takes (output, targets) only; put "
                    "other arguments into the loss (e.g. functools.partial)"
                )
            return self.runner.loss_call(output, targets)
        return self.loss_fn(output, targets, *args, **kwargs)


class Scaled:
    """A loss divided by Lightning's gradient accumulation: a scalar by ``factor``, a pair
    ``(total, count)`` as ``(total, count * factor)``, so the summed gradients over the
    accumulated batches are those of the mean of their losses, as Lightning's.

    Args:
        loss_fn: ``(output, targets) -> scalar or (total, count)``.
    """

    def __init__(self, loss_fn: Callable[[Any, Any], Any]) -> None:
        self.loss_fn = loss_fn
        self.factor = 1

    def __call__(self, output: Any, targets: Any) -> Any:
        """The loss of a micro-batch, scaled."""
        loss = self.loss_fn(output, targets)
        if self.factor == 1:
            return loss
        if isinstance(loss, tuple):
            total, count = loss
            return total, count * self.factor
        return loss / self.factor

    def around(self, other: Callable[[Any, Any], Any]) -> Scaled:
        """Itself, scaling ``other`` from now on (context parallelism's form of the same
        loss: a next-token loss on targets shifted before the cut); in place, since the
        strategy sets the factor on this object."""
        self.loss_fn = other
        return self


class OutputLoss:
    """The loss a network computes itself: its output's ``loss`` (the targets are unused)."""

    def __call__(self, output: Any, targets: Any) -> torch.Tensor:
        """The output's ``loss``."""
        loss = output_field(output, "loss")
        if loss is None:
            raise ConfigError(
                f"the network returned {type(output).__name__} without a loss; give it its "
                f"labels, or set the LightningModule's loss_fn"
            )
        return loss


def step_inputs(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """A network call's arguments as the pipeline's inputs: one positional value, a tuple
    of positional values, or a dict of keyword values."""
    if args and kwargs:
        raise ConfigError(
            "under PipelineStrategy the network takes positional or keyword inputs, not "
            "both; pass them all by keyword or all by position"
        )
    if kwargs:
        return dict(kwargs)
    if not args:
        raise ConfigError("the network was called without inputs; pass it the batch's inputs")
    return args[0] if len(args) == 1 else tuple(args)


def rows(inputs: Any) -> int:
    """The rows (dim 0) of the first tensor in ``inputs``."""
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    if isinstance(values, torch.Tensor):
        return int(values.shape[0])
    for value in values:
        if isinstance(value, torch.Tensor):
            return int(value.shape[0])
    raise ConfigError("the network's inputs hold no tensor; pass it tensors")
