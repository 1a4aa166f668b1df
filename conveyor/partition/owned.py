"""Stage modules of their own: what a build changes on a stage's modules (FSDP's class,
state and hooks, tensor parallelism's hooks, the expert routing, compiled forwards) lands
on copies, never on the user's modules.

A split hands out the user's own module objects (a layer list's layers, the modules a
graph calls). :func:`own_modules` replaces each, below the stage roots the split made, by a
shallow copy: a module object of its own, with its own tables of parameters, buffers,
submodules and hooks, whose entries are the user's objects (the same parameters and
buffers, until sharding replaces them in the copy). The user's model is then changed only
where :func:`~conveyor.partition.resplit.adopt` points its parameter and buffer slots at
the pipeline's, and making it whole for a new split is gathering its DTensor parameters:
nothing else needs undoing.

A copy's ``training`` flag is its own: :meth:`Modes.follow` gives each copy its original's
before every step, so ``model.train()`` / ``model.eval()`` act on the stages as they did on
the user's modules.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

_TABLES = frozenset(k for k, v in vars(nn.Module()).items() if isinstance(v, (dict, set)))
"""The tables every module has of its own (parameters, buffers, submodules, hooks): the
attributes ``nn.Module.__init__`` makes as dicts and sets."""


@dataclass(frozen=True)
class Modes:
    """The user's modules and their copies in the stages (:func:`own_modules`)."""

    pairs: tuple[tuple[nn.Module, nn.Module], ...] = ()

    def follow(self) -> None:
        """Give each copy its original's ``training`` flag (a few attribute reads a step)."""
        for original, copy in self.pairs:
            if copy.training != original.training:
                copy.training = original.training


def own_modules(stages: Iterable[nn.Module], model: Any) -> Modes:
    """Replace, in place, every module below each of ``stages`` (roots the split made) by
    a shallow copy of its own (see the module doc); a module held twice (in one stage or
    two) becomes one copy.

    Args:
        stages: the stage modules this process runs.
        model: the user's model (a module or a list of layers), whose modules' modes the
            copies follow.

    Returns:
        The user's modules that were copied, with their copies.
    """
    made: dict[int, nn.Module] = {}
    for stage in stages:
        for name, child in list(stage._modules.items()):
            if child is not None:
                stage._modules[name] = _copied(child, made)
    roots = model if isinstance(model, (list, tuple)) else [model]
    originals = {id(m): m for root in roots for m in root.modules()}
    return Modes(tuple((originals[i], made[i]) for i in originals if i in made))


def own_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` of its own (see the module doc): its submodules copied too,
    its parameters and buffers the same objects."""
    return _copied(module, {})


def _copied(module: nn.Module, made: dict[int, nn.Module]) -> nn.Module:
    """``module``'s copy (made once), its submodules copied likewise."""
    done = made.get(id(module))
    if done is not None:
        return done
    copy = object.__new__(type(module))  # not copy.copy: a GraphModule's would rebuild it
    state = {}
    for key, value in vars(module).items():
        if key in _TABLES:
            value = type(value)(value)
            if isinstance(value, dict):
                for k, v in value.items():
                    value[k] = _rebound(v, module, copy)
        state[key] = _rebound(value, module, copy)
    copy.__dict__.update(state)
    made[id(module)] = copy
    for name, child in list(copy._modules.items()):
        if child is not None:
            copy._modules[name] = _copied(child, made)
    return copy


def _rebound(value: Any, original: nn.Module, copy: nn.Module) -> Any:
    """A method bound to ``original`` (a forward set on the instance, a hook that is one
    of its methods) bound to ``copy`` instead; anything else as it is."""
    if isinstance(value, types.MethodType) and value.__self__ is original:
        return types.MethodType(value.__func__, copy)
    return value
