"""Optimizers built before the split step the parameters the pipeline trains.

A pipeline keeps the user's parameter objects where it can (a layer list, a captured
graph, meta parameters given their values in place), but a layout that shards a
parameter (FSDP, ``tp_plan``, experts over ``ep``, vocabulary rows) replaces it by a
DTensor, and a new split of a trained model replaces an earlier pipeline's DTensors:
an object cannot become a tensor of another kind in place. An optimizer built before the
split (over ``pipe.parameters()`` of a pipeline that splits on its first batch, or over
the model's parameters before the ``Pipeline``, as nanoGPT's and transformers' scripts
build it) would then hold objects nothing trains, and step nothing.

:func:`record` notes, after a split, each parameter object of the model that the split
replaced, and by what (weakly: an entry goes when either object does). A hook every
optimizer runs before its step (:func:`torch.optim.optimizer.register_optimizer_step_pre_hook`,
registered once) then puts the replacement in its place, once per optimizer, where the
optimizer holds no state for it yet; an optimizer that does (it stepped the old object,
or loaded a state for it) is refused in one sentence before it changes anything. When
nothing was replaced the hook returns at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.errors import ConfigError


@dataclass(frozen=True)
class _Entry:
    """One replaced parameter: the old object, its replacement, and its name."""

    old: weakref.ref[torch.Tensor]
    new: weakref.ref[torch.Tensor]
    name: str


_REPLACED: dict[int, _Entry] = {}
"""id(old object) -> its entry, while both objects live."""
_generation = 0  # counts the records that replaced something
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = (
    weakref.WeakKeyDictionary()
)
"""Per optimizer: the generation and parameter count it was last checked at."""
_hooked = False


def snapshot(model: Any) -> dict[str, torch.Tensor]:
    """The model's parameter objects by name (every name of a tied one), before a split."""
    module = model if isinstance(model, nn.Module) else nn.ModuleList(model)
    return dict(module.named_parameters(remove_duplicate=False))


def record(before: Mapping[str, torch.Tensor], model: Any) -> int:
    """Note each parameter of ``model`` (after a split, pointed at the pipeline's) whose
    object differs from the one ``before`` (:func:`snapshot`) has under its name.

    Returns:
        How many objects were replaced.
    """
    global _generation, _hooked
    now = snapshot(model)
    pairs: dict[int, tuple[torch.Tensor, torch.Tensor, str]] = {}
    for name, old in before.items():
        now_held = now.get(name)
        if now_held is not None and now_held is not old:
            pairs[id(old)] = (old, now_held, name)
    if not pairs:
        return 0
    # An object an earlier split put in, replaced now: its own old object maps to the new
    # one too (chains stay one step long, and live while their two ends do).
    for entry in list(_REPLACED.values()):
        first, mid = entry.old(), entry.new()
        again = pairs.get(id(mid)) if mid is not None else None
        if first is not None and again is not None and again[0] is mid:
            _put(first, again[1], entry.name)
    for old, new, name in pairs.values():
        _put(old, new, name)
    _generation += 1
    if not _hooked:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_before_step)
        _hooked = True
    return len(pairs)


def _put(old: torch.Tensor, new: torch.Tensor, name: str) -> None:
    key = id(old)

    def drop(_: Any) -> None:  # either object gone: so is the entry (not a newer one)
        if _REPLACED.get(key) is entry:
            del _REPLACED[key]

    entry = _Entry(weakref.ref(old, drop), weakref.ref(new, drop), name)
    _REPLACED[key] = entry


def _latest(p: torch.Tensor) -> torch.Tensor | None:
    """What a split replaced ``p`` by; None where none did, or the replacement is gone."""
    entry = _REPLACED.get(id(p))
    if entry is None or entry.old() is not p:
        return None
    return entry.new()


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The optimizer step pre-hook (module doc): at most one check per optimizer and
    record."""
    if not _REPLACED:
        return None
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
        _REPLACED[id(p)].name
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
