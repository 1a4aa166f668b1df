"""Cut a layer list (``nn.Sequential``, ``nn.ModuleList`` or a list) into stages."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from torch import nn

from conveyor.errors import ConfigError
from conveyor.partition.cuts import balance as min_max_balance


class SequentialStage(nn.Sequential):
    """A run of layers; the first takes all the stage's arguments (tuple/dict inputs)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the layers.

        Args:
            *args: The first layer's positional arguments.
            **kwargs: The first layer's keyword arguments.

        Returns:
            The last layer's output; each later layer takes the previous one's output.
        """
        layers = iter(self)
        value = next(layers)(*args, **kwargs)
        for layer in layers:
            value = layer(value)
        return value

    def called_modules(self) -> list[nn.Module]:
        """The layers, in the order the forward calls them."""
        return list(self.children())


def layers_of(model: nn.Module | Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The named layers of a layer-list model.

    Args:
        model: An ``nn.Sequential``, ``nn.ModuleList`` or list of modules.

    Returns:
        (name as in the original model, layer) per layer.

    Raises:
        ConfigError: ``model`` is not a layer list.
    """
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return list(model.named_children())
    if isinstance(model, Sequence) and all(isinstance(m, nn.Module) for m in model):
        return [(str(i), m) for i, m in enumerate(model)]
    raise ConfigError(
        f"conveyor cannot split a {type(model).__name__} yet; pass an nn.Sequential or a "
        f"list of modules whose outputs feed the next one"
    )


def parameter_costs(layers: Sequence[tuple[str, nn.Module]]) -> list[float]:
    """The cost of each layer as its parameter count (the default balance).

    Args:
        layers: Named layers (:func:`layers_of`).

    Returns:
        The parameter count of each layer.
    """
    return [float(sum(p.numel() for p in m.parameters())) for _, m in layers]


def split_sequential(
    model: nn.Module | Sequence[nn.Module],
    stages: int,
    balance: Sequence[int] | None = None,
    placement: Sequence[int] | None = None,
) -> list[nn.Sequential]:
    """Contiguous stages of a layer list; each keeps the original child names.

    Keeping names means ``stage.named_parameters()`` and ``stage.state_dict()`` use the
    original model's keys, so checkpoints and optimizers need no renaming.

    Args:
        model: An ``nn.Sequential``, ``nn.ModuleList`` or list of modules.
        stages: How many stages to make.
        balance: Layers per stage; None to balance parameter counts.
        placement: The rank of each stage, for a cut by parameter counts.

    Returns:
        One ``nn.Sequential`` per stage.

    Raises:
        ConfigError: ``model`` is not a layer list, has fewer layers than stages, or
            ``balance`` does not fit it.
    """
    layers = layers_of(model)
    if len(layers) < stages:
        raise ConfigError(
            f"the model has {len(layers)} layers but the pipeline needs {stages} stages; "
            f"use fewer ranks or chunks, or split the model into more layers"
        )
    if balance is None:
        sizes = min_max_balance(parameter_costs(layers), stages, placement)
    else:
        sizes = [int(b) for b in balance]
        if len(sizes) != stages:
            raise ConfigError(
                f"balance {list(balance)} has {len(sizes)} entries but the pipeline has "
                f"{stages} stages; give one layer count per stage"
            )
        if any(b < 1 for b in sizes):
            raise ConfigError(
                f"balance {list(balance)} leaves a stage empty; give every stage >= 1 layer"
            )
        if sum(sizes) != len(layers):
            raise ConfigError(
                f"balance {list(balance)} adds up to {sum(sizes)} layers but the model has "
                f"{len(layers)}; make the numbers add up to {len(layers)}"
            )
    out: list[nn.Sequential] = []
    start = 0
    for size in sizes:
        out.append(SequentialStage(OrderedDict(layers[start : start + size])))
        start += size
    return out
