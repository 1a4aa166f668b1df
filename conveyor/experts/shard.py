"""Shard expert collections over the expert-parallel group.

Each rank of an ep group of ``E`` ranks keeps experts ``[r * n, (r + 1) * n)``
(``n = num_experts / E``) of every chosen collection: each expert parameter becomes a
DTensor ``Shard(0)`` over the ``ep`` mesh, under its original name, so that
``state_dict()`` and checkpoints see whole experts. The module's class is swapped for a
subclass (as FSDP2 does) whose forward routes tokens by all-to-all
(:func:`~conveyor.experts.dispatch.routed_forward`) and runs the class's own forward on the
local experts. The swap happens on the stage's own copy of the module
(:mod:`conveyor.partition.owned`): the user's module keeps its class.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from conveyor.errors import ConfigError
from conveyor.experts.collections import find_experts, num_experts
from conveyor.experts.dispatch import ExpertShard, routed_forward

SHARD_ATTR = "_conveyor_expert_shard"
"""The attribute of a sharded collection holding its :class:`ExpertShard`."""


class ExpertParallel(nn.Module):
    """Mixin of the swapped class: the forward that routes tokens to their experts."""

    _conveyor_base_forward: Any  # the original class's forward

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``experts(hidden_states, top_k_index, top_k_weights)`` with the experts spread
        over the ep group (see :mod:`conveyor.experts.dispatch`)."""
        shard: ExpertShard = getattr(self, SHARD_ATTR)
        return routed_forward(
            self, type(self)._conveyor_base_forward, shard, hidden_states, top_k_index,
            top_k_weights,
        )  # fmt: skip


_classes: dict[type[nn.Module], type[nn.Module]] = {}


def _routed_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with the routed forward, made once per class."""
    if issubclass(cls, ExpertParallel):
        return cls
    if cls not in _classes:
        _classes[cls] = type(
            f"ExpertParallel{cls.__name__}",
            (ExpertParallel, cls),
            {
                "_conveyor_base_forward": cls.forward,
                "__module__": __name__,
            },
        )
    return _classes[cls]


def check_divisible(name: str, module: nn.Module, ep: int) -> int:
    """The experts of ``module`` (named ``name``), which ``ep`` must divide.

    Raises:
        ConfigError: ``ep`` does not divide its number of experts.
    """
    count = num_experts(module)
    if count is None:
        raise ConfigError(f"model.{name} ({type(module).__name__}) is not an expert collection")
    if count % ep:
        raise ConfigError(
            f"model.{name} has {count} experts, which ep={ep} does not divide; pick an ep "
            f"that divides {count} (and dp), or leave the module out of ep_plan"
        )
    return count


def shard_experts(
    collections: Iterable[tuple[str, nn.Module]], mesh: Any, timeout: float
) -> list[str]:
    """Give this rank its share of each collection and route their forwards.

    Args:
        collections: ``(name, module)`` pairs from
            :func:`~conveyor.experts.collections.find_experts`.
        mesh: the 1-D ``ep`` DeviceMesh (``ctx.mesh["ep"]``).
        timeout: seconds an all-to-all may wait on a peer.

    Returns:
        The names of the collections sharded.

    Raises:
        ConfigError: a collection whose experts ``mesh.size()`` does not divide.
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    size, rank = mesh.size(), mesh.get_local_rank()
    done: list[str] = []
    for name, module in collections:
        if hasattr(module, SHARD_ATTR):
            continue
        count = check_divisible(name, module, size)
        for pname, param in list(module.named_parameters(recurse=False)):
            value = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(pname, nn.Parameter(value, param.requires_grad))
        shard = ExpertShard(size, rank, count, count // size, timeout)
        setattr(module, SHARD_ATTR, shard)
        module.__class__ = _routed_class(type(module))
        done.append(name)
    return done


def apply_ep(
    stages: Mapping[int, nn.Module] | nn.Module,
    ep_plan: Sequence[str] | None,
    ctx: Any,
    every: Iterable[nn.Module] = (),
) -> list[str]:
    """Shard the expert collections of this rank's ``stages`` over ``ctx``'s ep group.

    The plan is first checked on ``every`` module of the split (every rank's stages), so
    that each rank raises the same error, not only those holding the collection.

    Args:
        stages: this rank's stage modules (or one module), their module names the original
            model's.
        ep_plan: module-name patterns, or None for every expert collection.
        ctx: the :class:`~conveyor.context.Context` (``ep_size``, ``mesh``, ``timeout``).
        every: all stages of the split, for the checks.

    Returns:
        The names of the collections sharded on this rank (none when ``ep_size == 1``).

    Raises:
        ConfigError: a bad ``ep_plan`` pattern, or experts that ``ep`` does not divide.
    """
    mods = [stages] if isinstance(stages, nn.Module) else list(stages.values())
    checked = list(every) or mods
    named = [pair for m in checked for pair in m.named_modules()]
    if ep_plan is not None:
        find_experts(named, ep_plan)  # each pattern must match an expert collection somewhere
    for name, module in chosen(checked, ep_plan):
        check_divisible(name, module, ctx.ep_size)
    if ctx.ep_size == 1:
        return []
    return shard_experts(chosen(mods, ep_plan), ctx.mesh["ep"], ctx.timeout)


def check_tp_plan(tp_plan: Iterable[str], collections: Iterable[str], names: Iterable[str]) -> None:
    """Tensor parallelism stays outside the expert collections sharded over ep.

    Args:
        tp_plan: the ``tp_plan``'s module-name patterns.
        collections: the names of the expert collections ep shards.
        names: every module name of the model.

    Raises:
        ConfigError: a pattern matching a collection or a module inside one.
    """
    inside = [
        (pattern, name)
        for pattern in tp_plan
        for name in names
        if fnmatch.fnmatchcase(name, pattern)
        and any(name == c or name.startswith(c + ".") for c in collections)
    ]
    if inside:
        pattern, name = inside[0]
        raise ConfigError(
            f"tp_plan pattern {pattern!r} matches model.{name}, an expert collection that "
            f"ep shards by experts; tensor parallelism inside experts is not supported yet: "
            f"keep tp_plan to attention and dense layers, or shard experts with ep alone"
        )


def chosen(
    modules: Iterable[nn.Module], ep_plan: Sequence[str] | None
) -> list[tuple[str, nn.Module]]:
    """The collections of ``modules`` that ``ep_plan`` chooses (patterns that match none of
    them are fine here: they may match another rank's stage), by their names in the model."""
    out: list[tuple[str, nn.Module]] = []
    for module in modules:
        named = list(module.named_modules())
        if ep_plan is not None:
            named = [(n, m) for n, m in named if any(fnmatch.fnmatchcase(n, p) for p in ep_plan)]
        out.extend(find_experts(named, None))
    return out
