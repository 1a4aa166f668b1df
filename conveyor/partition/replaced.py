"""Optimizers built before the split step the parameters the pipeline trains.

A pipeline keeps the user's parameter objects where it can (a layer list, a captured
graph, meta parameters given their values in place), but a layout that shards a
parameter (FSDP, ``tp_plan``, experts over ``ep``, vocabulary rows) replaces it by a
DTensor, and a new split of a trained model replaces an earlier pipeline's DTensors:
an object cannot become a tensor of another kind in place. An optimizer built before the
split (over ``pipe.parameters()`` of a pipeline that splits on its first batch, or over
the model's parameters before the ``Pipeline``, as nanoGPT's and transformers' scripts
build it) would then hold objects nothing trains, and step nothing.

:func:`record` marks, after a split, each parameter object of the model that the split
replaced with its replacement (:data:`REPLACED_BY`, an attribute of the old tensor: no
table, and no weak reference, which would stop torch from swapping a tensor in place).
A hook every optimizer runs before its step
(:func:`torch.optim.optimizer.register_optimizer_step_pre_hook`, registered once) then
puts the replacement in its place, once per optimizer and split, where the optimizer
holds no state for it yet; an optimizer that does (it stepped the old object, or loaded
a state for it) is refused in one sentence before it changes anything. Until something
is replaced the hook returns at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from conveyor.errors import ConfigError

REPLACED_BY = "conveyor_replaced_by"
"""The attribute :func:`record` sets on a parameter a split replaced: ``(name, the
replacement)``."""

_generation = 0  # counts the records that replaced something
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = (
    weakref.WeakKeyDictionary()
)
"""Per optimizer: the generation and parameter count it was last checked at."""


def snapshot(model: Any) -> dict[str, torch.Tensor]:
    """The model's parameter objects by name (every name of a tied one), before a split."""
    module = model if isinstance(model, nn.Module) else nn.ModuleList(model)
    return dict(module.named_parameters(remove_duplicate=False))


def record(before: Mapping[str, torch.Tensor], model: Any) -> int:
    """Mark each parameter object ``before`` (:func:`snapshot`) has under a name where
    ``model`` (after a split, pointed at the pipeline's) now has another.

    Returns:
        How many objects were replaced.
    """
    global _generation
    now = snapshot(model)
    replaced: dict[int, torch.Tensor] = {}
    for name, old in before.items():
        new = now.get(name)
        if new is not None and new is not old and id(old) not in replaced:
            setattr(old, REPLACED_BY, (name, new))
            replaced[id(old)] = old
    if replaced:
        if _generation == 0:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            register_optimizer_step_pre_hook(_before_step)
        _generation += 1
    return len(replaced)


def _latest(p: torch.Tensor) -> torch.Tensor | None:
    """What splits last replaced ``p`` by (a replacement replaced again followed); None
    where none did."""
    found = None
    for _ in range(64):  # one step per split of the same model: never a cycle
        mark = getattr(p, REPLACED_BY, None)
        if mark is None:
            break
        found = p = mark[1]
    return found


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The optimizer step pre-hook (module doc): one check per optimizer and split."""
    key = (_generation, sum(len(g["params"]) for g in optimizer.param_groups))
    if _checked.get(optimizer) == key:
        return None
    point_at_replacements(optimizer)
    _checked[optimizer] = (_generation, sum(len(g["params"]) for g in optimizer.param_groups))
    return None


def point_at_replacements(optimizer: torch.optim.Optimizer) -> int:
    """Put in ``optimizer``'s parameter groups, in place, the replacement of each
    parameter a split replaced (one held twice then comes once).

    Returns:
        How many were put in.

    Raises:
        ConfigError: the optimizer holds state for a replaced parameter (nothing changed).
    """
    stale = [
        getattr(p, REPLACED_BY)[0]
        for group in optimizer.param_groups
        for p in group["params"]
        if optimizer.state.get(p) and _latest(p) is not None
    ]
    if stale:
        raise ConfigError(
            f"this optimizer has state for {len(stale)} parameters that a pipeline has "
            f"since replaced (e.g. model.{stale[0]}, sharded or split again), so stepping "
            f"it would train nothing; build a new optimizer over pipe.parameters() of the "
            f"newest Pipeline (and load its state with conveyor.load(pipe, path, optimizer))"
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    count = 0
    for group in optimizer.param_groups:
        params = group["params"]
        kept: list[torch.Tensor] = []
        for p in params:
            new = _latest(p)
            if new is None:
                kept.append(p)
                continue
            count += 1
            if id(new) not in held:
                held.add(id(new))
                kept.append(new)
        params[:] = kept  # in place: an optimizer may keep the list itself (LBFGS)
    return count
