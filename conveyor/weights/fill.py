"""Giving a model's tensors their values, one module at a time: from a checkpoint, or from
each module's own initialization under a seed made from its name.

An initialized value is always made whole and then cut to what the rank keeps (an FSDP or
tensor-parallel shard), so the numbers do not depend on the layout: every rank, split and
process count draws exactly what :func:`conveyor.materialize` draws for the unsplit
model. A value from a checkpoint is read only as far as the rank keeps it (the box of
:func:`~conveyor.weights.parts.part_of`), or whole where the source cannot read less.
Meta tensors become real in place (``torch.utils.swap_tensors``), so tied weights stay
one object.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor, nn

from conveyor.errors import CheckpointError, ConfigError
from conveyor.weights.init import rule_of, seed_of
from conveyor.weights.parts import part_of, size
from conveyor.weights.plan import Holders, Slot, Wanted, holders_of, owner
from conveyor.weights.safetensors_file import Part, runs
from conveyor.weights.sources import Source

READ_BYTES = 256 * 2**20
"""At most this much is read from a checkpoint at once (values waiting to be placed)."""


def check(model: nn.Module, whole: Wanted, source: Source | None) -> dict[str, str]:
    """Raise before anything is allocated, the same on every rank: a tensor of the model
    (``whole``: :func:`wanted` over all of it) that the checkpoint lacks or holds in
    another shape, or that nothing can initialize.

    Returns:
        The checkpoint's name of each tensor it holds (by canonical name).

    Raises:
        CheckpointError: ``source`` lacks a tensor or holds another shape (names them).
        ConfigError: a meta tensor whose module has no initialization, without ``source``.
    """
    stored = set(source.names()) if source is not None else set()
    found: dict[str, str] = {}
    missing, shapes, no_rule = [], [], []
    for c, slots in whole.slots.items():
        name = whole.names.stored(c, source, stored) if source is not None else None
        if name is not None and source is not None:
            found[c] = name
            shape = tuple(slots[0].get().shape)
            if source.shape(name) != shape:
                shapes.append(f"{c} {source.shape(name)} (the model's: {shape})")
        elif source is not None and c in whole.persistent:
            missing.append(c)
        elif rule_of(model, owner(c), model.get_submodule(owner(c))) is None:
            no_rule.append(c)
    if source is not None and (missing or shapes):
        what = f"lacks {missing[:3]}" if missing else f"holds other shapes: {shapes[:3]}"
        count = len(missing) if missing else len(shapes)
        raise CheckpointError(
            f"weights {source.where} {what} ({count} in all) of the model's tensors; load "
            f"a checkpoint of this model (same names and sizes)"
        )
    if no_rule:
        raise ConfigError(_no_rule(model, no_rule[0]))
    return found


def fill(
    model: nn.Module,
    plan: Wanted,
    device: torch.device,
    init_seed: int,
    source: Source | None,
    found: dict[str, str],
) -> None:
    """Give every slot of ``plan`` its value on ``device``: the checkpoint's where
    ``source`` holds it (under the name ``found`` gives), else its module's own
    initialization under ``seed_of(init_seed, module name)``.

    Raises:
        ConfigError: an initialization left a tensor unset (it still holds the NaN or
            minimum it was created with); named.
    """
    rest = dict(plan.slots)
    holders = holders_of([model, *plan.modules])
    if source is not None:
        loaded = [c for c in plan.slots if c in found]
        parts = {c: part_of(plan.slots[c]) for c in loaded}
        sizes = ((c, _bytes(plan.slots[c][0].get(), parts[c])) for c in loaded)
        for batch in runs(sizes, READ_BYTES):
            whole = [c for c in batch if parts[c] is None]
            values = source.read(found[c] for c in whole)
            placed: set[int] = set()
            for c in batch:
                part = parts[c]
                value = values[found[c]] if part is None else source.read_part(found[c], part)
                if id(value) in placed:  # one stored tensor for two untied ones: each its own
                    value = value.clone()
                placed.add(id(value))
                _place(rest.pop(c), value, device, holders, part is not None)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    by_module: dict[str, dict[str, list[Slot]]] = {}
    for c, slots in rest.items():
        by_module.setdefault(owner(c), {})[c.rsplit(".", 1)[-1]] = slots
    for path in sorted(by_module, key=lambda p: -order.get(p, -1)):  # children first
        _initialize(model, path, by_module[path], device, init_seed, holders)


def _initialize(
    model: nn.Module,
    path: str,
    fields: dict[str, list[Slot]],
    device: torch.device,
    seed: int,
    holders: Holders,
) -> None:
    """Run the module's own initialization on whole, fresh copies of its tensors, then
    place the copies of the wanted ones."""
    module = model.get_submodule(path)
    rule = rule_of(model, path, module)
    if rule is None:
        raise ConfigError(_no_rule(model, _join(path, next(iter(fields)))))
    saved_params, saved_buffers = dict(module._parameters), dict(module._buffers)
    fresh: dict[str, Tensor] = {}
    for key, value in itertools.chain(saved_params.items(), saved_buffers.items()):
        if value is not None:
            fresh[key] = _sentinel(value, device)
    try:
        for key in saved_params:
            if key in fresh:
                module._parameters[key] = nn.Parameter(
                    fresh[key],
                    requires_grad=saved_params[key].requires_grad,  # type: ignore[union-attr]
                )
        for key in saved_buffers:
            if key in fresh:
                module._buffers[key] = fresh[key]
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed_of(seed, path))
            rule()
        values = {
            k: (module._parameters if k in saved_params else module._buffers)[k] for k in fields
        }
    finally:
        module._parameters.update(saved_params)
        module._buffers.update(saved_buffers)
    for key, slots in fields.items():
        value = values[key]
        assert value is not None
        if _unset(value):
            raise ConfigError(
                f"{type(module).__name__}'s initialization left {_join(path, key)} unset (the meta "
                f"device holds no values); initialize every parameter and buffer in it, or "
                f"pass weights= a checkpoint holding them"
            )
        _place(slots, value.detach(), device, holders)


def _place(
    slots: list[Slot], whole: Tensor, device: torch.device, holders: Holders, cut: bool = False
) -> None:
    """Put ``whole`` (the tensor's full value; with ``cut``, already the part every slot, a
    DTensor, holds) into each slot: a meta tensor becomes real in place (its object kept,
    so ties hold); a DTensor keeps its shard; a real tensor is overwritten. Where a meta
    tensor cannot change in place, the real one replaces it in every module of
    ``holders``."""
    done: set[int] = set()
    for slot in slots:
        target = slot.get()
        if id(target) in done:
            continue
        done.add(id(target))
        value = whole.to(device=device, dtype=target.dtype)
        mesh = getattr(target, "device_mesh", None)
        if mesh is not None:
            from torch.distributed.tensor import DTensor, distribute_tensor

            placements = target.placements  # type: ignore[attr-defined]
            local = (
                value if cut else
                distribute_tensor(value, mesh, placements, src_data_rank=None).to_local()
            )  # fmt: skip
            if not target.is_meta:
                with torch.no_grad():
                    target.to_local().copy_(local)  # type: ignore[attr-defined]
                continue
            if local.untyped_storage().nbytes() != local.nbytes:  # a view of the whole value
                local = local.clone()  # the part only, so that the whole can be freed
            value = DTensor.from_local(
                local, mesh, placements, run_check=False, shape=target.shape,
                stride=target.stride(),
            )  # fmt: skip
        elif not target.is_meta:
            with torch.no_grad():
                target.copy_(value)
            continue
        if len(done) > 1:  # another object holding the same value (not a tie): its own copy
            value = value.clone()
        kind: Any = type(target) if issubclass(type(target), nn.Parameter) else nn.Parameter
        real = kind(value, requires_grad=target.requires_grad) if slot.param else value
        try:
            torch.utils.swap_tensors(target, real)  # type: ignore[no-untyped-call]
        except RuntimeError:
            # Something holds a weak reference to it (a capture's are given to stand-ins:
            # conveyor/partition/export.py): a new object then, which the model is pointed
            # at and an optimizer built over the old one gets at its first step
            # (conveyor/partition/replaced.py).
            for holder, key, param in holders.get(id(target), []):
                store: Any = holder._parameters if param else holder._buffers
                store[key] = real


def _sentinel(like: Tensor, device: torch.device) -> Tensor:
    """A whole tensor shaped like ``like`` that says "unset": NaN, or the dtype's minimum."""
    if like.dtype.is_floating_point or like.dtype.is_complex:
        fill = float("nan")
    elif like.dtype == torch.bool:
        fill = False
    else:
        fill = torch.iinfo(like.dtype).min
    return torch.full(tuple(like.shape), fill, dtype=like.dtype, device=device)


def _unset(value: Tensor) -> bool:
    """Whether an initialization left any element of ``value`` as :func:`_sentinel` made it."""
    if value.dtype.is_floating_point or value.dtype.is_complex:
        return bool(torch.isnan(value).any())
    if value.dtype == torch.bool:
        return False
    return bool((value == torch.iinfo(value.dtype).min).any())


def _no_rule(model: nn.Module, name: str) -> str:
    """The error for a meta tensor whose module has no initialization."""
    module = type(model.get_submodule(owner(name))).__name__
    if name in dict(model.named_buffers(remove_duplicate=False)):
        return (
            f"buffer {name} is on the meta device, and {module} has no reset_parameters() to "
            f"compute it again (it was computed in __init__, on no data); build the model "
            f"under conveyor.empty_weights() (buffers stay real), or pass weights= a "
            f"checkpoint holding it"
        )
    return (
        f"{name} is on the meta device and its module ({module}) has no reset_parameters() "
        f"to initialize it; add reset_parameters to {module}, or pass weights= a checkpoint "
        f"holding it"
    )


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _bytes(t: Tensor, part: Part | None = None) -> int:
    """The bytes of ``t``, or of its box ``part``."""
    return (t.numel() if part is None else size(part)) * t.element_size()
