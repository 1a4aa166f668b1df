"""A model an earlier pipeline sharded, made whole again for a new split.

A pipeline shards parts of the user's model in place, on the modules the user holds:
expert collections over ``ep`` (class swapped, each parameter a DTensor), the vocabulary
layers' rows over the pipeline ranks, ``tp_plan`` modules (DTensor parameters and torch's
input / output hooks) and FSDP units (DTensor parameters, class, hooks and state). So a
DTensor parameter of a model means "an earlier pipeline sharded this".

:func:`make_whole` turns each such parameter back into a plain one holding the whole
trained value, gathered one tensor at a time over the DTensor's own mesh, and undoes the
swapped classes, hooks and state. A new :class:`~conveyor.Pipeline` (any layout: with or
without ``ep``, ``tp_plan``, ``fsdp``, ``vocab_parallel``) then splits the trained model
as it splits a fresh one, and shards again what its own layout shards.

What a rank holds of the trained model is what its pipeline rank held (the other
stages' parameters there keep the values they had before training): the new split starts
from the trained values where each process keeps the stages it trained. A split that
gives a process a parameter whose value there differs from its earlier holder's (trained
or loaded there) is refused on every rank (:func:`check_moves`, by fingerprints of the
values): such a move goes through :func:`conveyor.save` / :func:`conveyor.load`.
"""

from __future__ import annotations

import dataclasses
import importlib
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.errors import ConfigError

ORIGINAL_CLASS = "_conveyor_original_class"
"""In the class dict of a class conveyor swapped a user's module to (the expert
routing): the module's own class, which :func:`make_whole` gives it back."""
INSTANCE_STATE = "_conveyor_instance_state"
"""In the same class dict: the names of the per-module attributes the swap added."""

_HOOK_LIBRARIES = ("torch.distributed.", "conveyor.")
"""Where the forward hooks an earlier pipeline left on the user's modules come from:
torch's tensor parallel styles and FSDP, and conveyor's FSDP units' own-storage hook."""


def adopt(model: Any, named: Iterable[tuple[str, torch.Tensor]], ctx: Any) -> None:
    """Make ``model`` hold a new pipeline's parameters under their original names, after
    refusing a split that moves trained values between processes (:func:`check_moves`).

    A split whose stages hold their own copies of the parameter slots (a graph
    ``torch.export`` captured, which FSDP then shards) would otherwise leave the user's
    model with the values from before training; now the model holds the very parameters
    the optimizer steps (DTensors where sharded), so that a later split, ``state_dict()``
    or save of the model sees the trained values. Every slot of a tied weight follows.

    Args:
        model: The user's model (a module or a list of layers).
        named: Its ``(name, parameter)`` pairs on this process, names as in ``model``.
        ctx: Its :class:`~conveyor.context.Context`.

    Raises:
        ConfigError: see :func:`check_moves`.
    """
    if not isinstance(model, nn.Module):
        model = nn.ModuleList(model)  # a list of layers: the same names, not remembered
    named = list(named)
    check_moves(model, named, ctx)
    # A tied weight's slots as they were before the build (sharding replaces the slot of
    # the module a stage holds, not its alias in a module another rank's stage holds).
    aliases = _ALIASES.get(model) or _alias_groups(model)
    for name, p in named:
        if not isinstance(p, nn.Parameter):
            continue
        for alias in aliases.get(name, (name,)):
            prefix, _, field = alias.rpartition(".")
            try:
                owner = model.get_submodule(prefix)
            except AttributeError:
                continue
            if owner._parameters.get(field) is not None:
                owner._parameters[field] = p


Fingerprint = tuple[float, float] | None
"""Two sums of a tensor's values (plain and position-weighted, in float64); None for a
tensor without values (on the meta device)."""


@dataclass(frozen=True)
class _Held:
    """What a pipeline over a model held on this process: its parameters (canonical
    names), whether that was all of them, and (once :func:`make_whole` read them before
    a new split) a fingerprint of each of the model's parameters here."""

    names: frozenset[str]
    whole: bool
    prints: dict[str, Fingerprint] | None = None


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


_HELD: weakref.WeakKeyDictionary[nn.Module, _Held] = weakref.WeakKeyDictionary()
_ALIASES: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[str, ...]]] = (
    weakref.WeakKeyDictionary()
)
"""Per model, when a Pipeline was built over it: each parameter name -> every name of
that parameter (its ties), taken before the build shards anything."""


def _alias_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each parameter name of ``model`` -> all names of that parameter object."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {name: tuple(names) for names in by_id.values() for name in names}


def check_moves(model: nn.Module, named: list[tuple[str, torch.Tensor]], ctx: Any) -> None:
    """Refuse, on every rank, a split that gives a process a parameter of ``model`` whose
    value there differs from the one the process that held it before has (trained there,
    or loaded), and remember what the new pipeline holds here. A collective when an
    earlier pipeline was built over ``model`` (which every rank then did).

    Args:
        model: The user's model.
        named: The new pipeline's ``(name, parameter)`` pairs on this process.
        ctx: Its :class:`~conveyor.context.Context`.

    Raises:
        ConfigError: such a parameter, on some rank.
    """
    # ties as before the build (sharding may have replaced one slot of a tied weight)
    aliases = _ALIASES.get(model) or _alias_groups(model)
    canon = {name: group[0] for name, group in aliases.items()}
    held = frozenset(canon.get(n, n) for n, _ in named)
    before = _HELD.get(model)
    _HELD[model] = _Held(held, held >= set(canon.values()))
    if before is None or before.prints is None:
        return
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
    as trained (its last pipeline's parameters, and the buffers of their modules or of
    modules without parameters; DTensors where sharded). None for any other model or a
    world of one process: it is saved as one process saves a module.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    held = _HELD.get(model)
    if held is None and not has_sharded(model):
        return None
    names = set(model.state_dict(keep_vars=True))
    if held is None or held.whole:
        return names
    aliases = _ALIASES.get(model) or _alias_groups(model)
    canon = {name: group[0] for name, group in aliases.items()}
    keep = {n for n in names if n in canon and canon[n] in held.names}
    for name in names - set(canon):  # a buffer: kept with its module's parameters
        prefix = name.rpartition(".")[0]
        own = model.get_submodule(prefix)._parameters if prefix else model._parameters
        mine = [f"{prefix}.{f}" if prefix else f for f, p in own.items() if p is not None]
        if not mine or any(canon.get(n, n) in held.names for n in mine):
            keep.add(name)
    return keep


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (sharded or replicated over a device mesh)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def has_sharded(model: nn.Module) -> bool:
    """Whether an earlier pipeline left DTensor parameters in ``model``."""
    return any(is_sharded(p) for p in model.parameters())


def make_whole(model: Any) -> bool:
    """Undo, in place, what earlier pipelines sharded of ``model`` (see the module doc).

    A collective where the model has DTensor parameters: each is gathered over its
    mesh's ranks, so every rank of the world calls it (a :class:`~conveyor.Pipeline`
    does, on every rank). The gathers go mesh by mesh, in the same order on every rank
    (by mesh dimension names, then the model's order), and the ranks of one mesh hold the
    same modules, so they post the same gathers.

    Returns:
        Whether anything was sharded.
    """
    if not isinstance(model, nn.Module):
        model = nn.ModuleList(model)  # a list of layers
    sharded = _sharded_slots(model)
    whole: dict[int, nn.Parameter] = {}
    for module, name, param in sharded:
        if id(param) not in whole:
            with torch.no_grad():
                value = param.full_tensor().detach()  # type: ignore[attr-defined]
            whole[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
        module._parameters[name] = whole[id(param)]
    changed = bool(sharded)
    for module in model.modules():
        changed |= _unwrap(module)
    _ALIASES[model] = _alias_groups(model)
    held = _HELD.get(model)
    if held is not None:  # the values here, whole, before a new build writes to them
        prints = {n: _fingerprint(p) for n, p in model.named_parameters()}
        _HELD[model] = dataclasses.replace(held, prints=prints)
    return changed


def _sharded_slots(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``(module, name, parameter)`` for each DTensor parameter slot of ``model`` (a tied
    one in each module holding it), ordered by mesh, then as the model lists them."""
    slots = [
        (module, name, p)
        for module in model.modules()
        for name, p in module._parameters.items()
        if p is not None and is_sharded(p)
    ]

    def mesh_key(slot: tuple[nn.Module, str, torch.Tensor]) -> tuple[str, ...]:
        mesh = slot[2].device_mesh  # type: ignore[attr-defined]
        return tuple(mesh.mesh_dim_names or ())

    return sorted(slots, key=mesh_key)  # stable: the model's order within a mesh


def _unwrap(module: nn.Module) -> bool:
    """Take off ``module`` what an earlier pipeline put on it besides its parameters:
    FSDP's class, state and hooks, the expert routing, tensor parallelism's hooks."""
    changed = _unwrap_fsdp(module)
    changed |= _unswap(module)
    for hooks in (
        module._forward_pre_hooks,
        module._forward_hooks,
    ):
        for key, hook in list(hooks.items()):
            if _origin(hook).startswith(_HOOK_LIBRARIES):
                del hooks[key]
                module._forward_pre_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
                changed = True
    return changed


def _unswap(module: nn.Module) -> bool:
    """``module``'s own class again, where conveyor swapped it (:data:`ORIGINAL_CLASS`)."""
    cls = type(module)
    original = cls.__dict__.get(ORIGINAL_CLASS)
    if original is None:
        return False
    for name in cls.__dict__.get(INSTANCE_STATE, ()):
        module.__dict__.pop(name, None)
    module.__class__ = original
    return True


def _origin(hook: Any) -> str:
    """The module a hook function (or bound method, or lambda) was defined in."""
    func = getattr(hook, "__func__", hook)
    return str(getattr(func, "__module__", "") or "")


def _unwrap_fsdp(module: nn.Module) -> bool:
    """``module``'s class and state as before ``fully_shard``; its hooks go with the
    others (:func:`_unwrap`). These are torch internals: FSDP2 has no public undo."""
    # the module, not the function torch.distributed._composable exports by that name
    contract = importlib.import_module("torch.distributed._composable.contract")
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp import FSDPModule

    flags = [
        f for f in ("_is_fsdp_managed_module", "_fsdp_use_orig_params") if f in module.__dict__
    ]
    for flag in flags:  # on every module a unit manages
        del module.__dict__[flag]
    cls = type(module)
    if not (issubclass(cls, FSDPModule) and cls.__bases__[0] is FSDPModule):
        return bool(flags)
    module.__class__ = cls.__bases__[1]  # fully_shard's class is (FSDPModule, original)
    module.__dict__.pop(contract.STATE_KEY, None)
    module.__dict__.pop(contract.REGISTRY_KEY, None)
    _module_state_mapping.pop(module, None)
    return True
