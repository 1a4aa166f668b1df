"""The user's model after a pipeline: pointed at the pipeline's parameters, and made whole
again for a new split.

A pipeline runs copies of the user's modules (:mod:`conveyor.partition.owned`): sharding
(FSDP, ``tp_plan``, experts over ``ep``, vocabulary rows) replaces parameters in the
copies, never changes the user's modules. :func:`adopt` then points the model's parameter
and buffer slots at the pipeline's (DTensors where sharded), so that the model holds the
very tensors the optimizer steps, and sets the model's :data:`HELD` attribute: the names
of the parameters this process's pipeline holds. That attribute of the model itself is
all :func:`conveyor.save` of the model reads to know what this process trained
(:func:`trained_here`); it is on every rank's model once a pipeline was built over it.

:func:`make_whole` turns each DTensor parameter (or buffer) of the model back into a
plain one holding the whole trained value, gathered one tensor at a time over the
DTensor's own mesh: a new :class:`~conveyor.Pipeline` (any layout) then splits the trained
model as it splits a fresh one, and shards again what its own layout shards.

What a rank holds of the trained model is what its pipeline rank held (the other stages'
parameters there keep the values they had before training): the new split starts from
the trained values where each process keeps the stages it trained. A split that gives a
process a parameter whose value there differs from its earlier holder's (trained or
loaded there) is refused on every rank (:func:`check_moves`, by fingerprints of the
values): such a move goes through :func:`conveyor.save` / :func:`conveyor.load`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.errors import ConfigError

HELD = "conveyor_held"
"""The attribute :func:`adopt` sets on the user's model: a frozenset of the names (every
name of a tied one) of the parameters this process's pipeline holds and trains."""

Fingerprint = tuple[float, float] | None
"""Two sums of a tensor's values (plain and position-weighted, in float64); None for a
tensor without values (on the meta device)."""


@dataclass(frozen=True)
class Before:
    """What an earlier pipeline over a model held on this process (canonical names, from
    the model's :data:`HELD`), and a fingerprint of each of the model's parameters here,
    taken whole before a new split writes to them."""

    names: frozenset[str]
    whole: bool
    prints: dict[str, Fingerprint]


def _layers(model: Any) -> nn.Module:
    """A model given as a list of layers, as a module with the same names."""
    return model if isinstance(model, nn.Module) else nn.ModuleList(model)


def adopt(
    model: Any,
    named: Iterable[tuple[str, torch.Tensor]],
    buffers: Iterable[tuple[str, torch.Tensor]],
) -> None:
    """Make ``model`` hold a new pipeline's parameters and buffers under their original
    names (every slot of a tied weight), and name them in its :data:`HELD`.

    Args:
        model: The user's model (a module or a list of layers).
        named: The pipeline's ``(name, parameter)`` pairs on this process.
        buffers: The pipeline's ``(name, buffer)`` pairs on this process.
    """
    model = _layers(model)
    named = list(named)
    aliases = _alias_groups(model)
    _point(model, named, aliases, parameters=True)
    _point(model, list(buffers), _alias_groups(model, buffers=True), parameters=False)
    # (in its __dict__, past any __setattr__ of the model's class)
    model.__dict__[HELD] = frozenset(n for name, _ in named for n in aliases.get(name, (name,)))


def _point(
    model: nn.Module,
    named: list[tuple[str, torch.Tensor]],
    aliases: dict[str, tuple[str, ...]],
    parameters: bool,
) -> None:
    """Each slot of ``model`` named by ``named`` (or an alias of it) holds its tensor."""
    for name, t in named:
        if parameters and not isinstance(t, nn.Parameter):
            continue
        for alias in aliases.get(name, ()):
            prefix, _, field = alias.rpartition(".")
            owner = model.get_submodule(prefix)
            store: dict[str, Any] = owner._parameters if parameters else owner._buffers
            if store.get(field) is not None and store[field] is not t:
                store[field] = t


def _alias_groups(model: nn.Module, buffers: bool = False) -> dict[str, tuple[str, ...]]:
    """Each parameter (or buffer) name of ``model`` -> all names of that tensor object."""
    named = model.named_buffers if buffers else model.named_parameters
    by_id: dict[int, list[str]] = {}
    for name, t in named(remove_duplicate=False):
        by_id.setdefault(id(t), []).append(name)
    return {name: tuple(names) for names in by_id.values() for name in names}


def _fingerprint(t: torch.Tensor) -> Fingerprint:
    if t.is_meta:
        return None
    with torch.no_grad():
        flat = t.detach().reshape(-1).to(torch.float64)
        ramp = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)
        return float(flat.sum()), float(flat @ ramp)


def _same(a: Fingerprint, b: Fingerprint) -> bool:
    """Equal up to float64 rounding of the sums (summation order may differ)."""
    if a is None or b is None:
        return a is b
    return all(abs(x - y) <= 1e-9 * max(abs(x), abs(y), 1e-30) for x, y in zip(a, b, strict=True))


def check_moves(
    model: Any, named: Sequence[tuple[str, torch.Tensor]], ctx: Any, before: Before | None
) -> None:
    """Refuse, on every rank, a split that gives a process a parameter of ``model`` whose
    value there differs from the one the process that held it before has (trained there,
    or loaded). A collective when an earlier pipeline trained ``model`` (``before`` is
    given on every rank then: every rank built that pipeline over its model). Made
    once the split is known, before any value is written (a refused split leaves the
    model as it was).

    Args:
        model: The user's model.
        named: The new pipeline's ``(name, parameter)`` pairs on this process.
        ctx: Its :class:`~conveyor.context.Context`.
        before: What :func:`make_whole` found of the earlier pipeline, or None.

    Raises:
        ConfigError: such a parameter, on some rank.
    """
    if before is None:
        return
    canon = {name: group[0] for name, group in _alias_groups(_layers(model)).items()}
    held = frozenset(canon.get(n, n) for n, _ in named)
    # Each process: the fingerprints of what it held (the values it may have changed),
    # and of what it now holds that it did not hold before (the values it starts from).
    prints = before.prints
    moved = [] if before.whole else sorted(held - before.names)
    mine = ({n: prints.get(n) for n in before.names}, {n: prints.get(n) for n in moved})
    everyone: list[Any] = [mine]
    if ctx.distributed:
        import torch.distributed as dist

        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
    holders: dict[str, Fingerprint] = {}
    for had, _ in everyone:
        holders.update(had)
    differ = [
        (rank, name)
        for rank, (_, new) in enumerate(everyone)
        for name, value in new.items()
        if name in holders and not _same(value, holders[name])
    ]
    if differ:
        rank, name = differ[0]
        more = sum(1 for r, _ in differ if r == rank) - 1
        raise ConfigError(
            f"this split gives rank {rank} model.{name} (and {more} more), whose value there "
            f"differs from the one the rank that held it has (trained or loaded there); keep "
            f"the earlier pipeline's pp and cut, or move the values with "
            f"conveyor.save(old_pipe, path) and conveyor.load(new_pipe, path)"
        )


def trained_here(model: nn.Module) -> set[str] | None:
    """For :func:`conveyor.save` of the user's model in a distributed world after
    pipelines trained it: the names of its state dict whose values this process holds
    as trained (the parameters its :data:`HELD` names, and the buffers of their modules
    or of modules without parameters; DTensors where sharded). None for a model no
    pipeline was built over, or a world of one process: it is saved as one process saves
    a module.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    held: frozenset[str] | None = model.__dict__.get(HELD)
    if held is None:
        return None
    names = set(model.state_dict(keep_vars=True))
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    keep = names & held
    for name in names - params:  # a buffer: kept with its module's parameters
        prefix = name.rpartition(".")[0]
        own = model.get_submodule(prefix) if prefix else model
        mine = [f"{prefix}.{f}" if prefix else f for f, _ in own.named_parameters(recurse=False)]
        if not mine or any(n in held for n in mine):
            keep.add(name)
    return keep


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (sharded or replicated over a device mesh)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def make_whole(model: Any) -> Before | None:
    """Gather, in place, the DTensor parameters and buffers earlier pipelines left in
    ``model`` into plain ones holding their whole values (see the module doc).

    A collective where the model has DTensors: each is gathered over its mesh's ranks, so
    every rank of the world calls it (a :class:`~conveyor.Pipeline` does, on every rank).
    The gathers go mesh by mesh, in the same order on every rank (by mesh dimension
    names, then the model's order), and the ranks of one mesh hold the same modules, so
    they post the same gathers.

    Returns:
        What an earlier pipeline held here, with fingerprints of every parameter's value
        (for :func:`check_moves`); None for a model no pipeline was built over.
    """
    model = _layers(model)
    whole: dict[int, torch.Tensor] = {}
    for module, name, t, param in _sharded_slots(model):
        if id(t) not in whole:
            with torch.no_grad():
                value = t.full_tensor().detach()  # type: ignore[attr-defined]
            if param:
                value = nn.Parameter(value, requires_grad=t.requires_grad)
            whole[id(t)] = value
        store: dict[str, Any] = module._parameters if param else module._buffers
        store[name] = whole[id(t)]
    held: frozenset[str] | None = model.__dict__.get(HELD)
    if held is None:
        return None
    prints = {n: _fingerprint(p) for n, p in model.named_parameters()}  # canonical names
    names = frozenset(n for n in prints if n in held)
    return Before(names, names == set(prints), prints)


def _sharded_slots(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor, bool]]:
    """``(module, name, tensor, is a parameter)`` for each DTensor slot of ``model`` (a
    tied one in each module holding it), ordered by mesh, then as the model lists them."""
    slots = [
        (module, name, t, param)
        for module in model.modules()
        for param, store in ((True, module._parameters), (False, module._buffers))
        for name, t in store.items()
        if t is not None and is_sharded(t)
    ]

    def mesh_key(slot: tuple[nn.Module, str, torch.Tensor, bool]) -> tuple[str, ...]:
        mesh = slot[2].device_mesh  # type: ignore[attr-defined]
        return tuple(mesh.mesh_dim_names or ())

    return sorted(slots, key=mesh_key)  # stable: the model's order within a mesh
