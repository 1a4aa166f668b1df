"""What to give values to: every tensor to fill, by its canonical name (a tied weight's
first name in the model), with every place that holds it, and the model's names for each
tensor (to find it in a checkpoint)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from torch import Tensor, nn

from conveyor.weights.sources import Source


@dataclass(frozen=True)
class Slot:
    """Where a tensor lives: ``holder``'s parameter or buffer ``field``."""

    holder: nn.Module
    field: str
    param: bool

    def get(self) -> Tensor:
        """The tensor there now."""
        store = self.holder._parameters if self.param else self.holder._buffers
        value = store[self.field]
        assert value is not None
        return value


@dataclass
class Wanted:
    """The tensors to fill, by canonical name (a tied weight's first name in the model),
    each with every slot that holds it in the modules being filled."""

    names: Names
    slots: dict[str, list[Slot]] = field(default_factory=dict)
    persistent: set[str] = field(default_factory=set)  # names a checkpoint holds
    modules: list[nn.Module] = field(default_factory=list)  # the modules being filled

    def __bool__(self) -> bool:
        return bool(self.slots)


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Each parameter or buffer name of ``model`` -> the first name of the same tensor."""
    first: dict[int, str] = {}
    return {name: first.setdefault(id(t), name) for name, t in _named_tensors(model)}


def wanted(model: nn.Module, modules: Iterable[nn.Module], everything: bool) -> Wanted:
    """What to fill in ``modules`` (stages of ``model``, named as in it): every meta tensor,
    and with ``everything`` every entry of their state dicts too (loading weights).

    Call it before anything replaces the tensors (tensor parallelism, FSDP): ties are
    known by identity, and slots name places, not objects.
    """
    names = Names(model)
    canon = names.canonical
    out = Wanted(names, modules=list(modules))
    for module in out.modules:
        persistent = set(module.state_dict(keep_vars=True))
        for name, holder, key, param in _slots(module):
            value = (holder._parameters if param else holder._buffers)[key]
            assert value is not None
            if not (value.is_meta or (everything and name in persistent)):
                continue
            c = canon.get(name, name)
            out.slots.setdefault(c, []).append(Slot(holder, key, param))
            if name in persistent:
                out.persistent.add(c)
    return out


Holders = dict[int, list[tuple[nn.Module, str, bool]]]
"""id of a tensor -> every (module, field, is a parameter) holding it."""


def holders_of(modules: Iterable[nn.Module]) -> Holders:
    """Where each tensor of ``modules`` is held (a module reached twice counts once)."""
    out: Holders = {}
    seen: set[tuple[int, str, bool]] = set()
    for module in modules:
        for _, holder, key, param in _slots(module):
            value = (holder._parameters if param else holder._buffers)[key]
            if (id(holder), key, param) not in seen:
                seen.add((id(holder), key, param))
                out.setdefault(id(value), []).append((holder, key, param))
    return out


class Names:
    """A model's names for its tensors: the first name of each (a tied weight has several)
    and all of them."""

    def __init__(self, model: nn.Module) -> None:
        self.canonical = canonical_names(model)
        self.aliases: dict[str, list[str]] = {}
        for name, c in self.canonical.items():
            self.aliases.setdefault(c, []).append(name)
        self.prefix = str(getattr(model, "base_model_prefix", "") or "")

    def stored(self, name: str, source: Source, stored: set[str]) -> str | None:
        """The checkpoint's name for the tensor ``name``: one of its names, with or
        without a transformers model's base prefix (``model.``)."""
        dotted = f"{self.prefix}."
        for n in self.aliases.get(name, [name]):
            candidates = [n]
            if self.prefix:
                candidates.append(n[len(dotted) :] if n.startswith(dotted) else dotted + n)
            for candidate in candidates:
                if source.alias(candidate) in stored:
                    return source.alias(candidate)
        return None


def owner(name: str) -> str:
    """The module path of a tensor's name ("" for the model's own)."""
    return name.rsplit(".", 1)[0] if "." in name else ""


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _slots(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, bool]]:
    """(name, holder, field, is a parameter) of every tensor under ``module``, ties and
    shared modules included."""
    for prefix, holder in module.named_modules(remove_duplicate=False):
        dotted = f"{prefix}." if prefix else ""
        for key, p in holder._parameters.items():
            if p is not None:
                yield dotted + key, holder, key, True
        for key, b in holder._buffers.items():
            if b is not None:
                yield dotted + key, holder, key, False
