"""Modules a ``torch.export`` capture keeps whole: one ``call_module`` node each.

Export records the ATen operations a module runs and reads its weights by name, so
whatever works by hooking a module's call (sharding experts over ep ranks, torch's tensor
parallel styles) has nothing to hook. The modules that need it are kept whole: while
export records the model, each one's call is a single opaque ``conveyor::kept_call`` op
whose fake implementation gives the output's shape (:class:`Output`), and afterwards
:func:`as_module_calls` turns those nodes into ``call_module`` nodes, so that the stage
holding one keeps the module and runs it as a module.

Two kinds of module are kept: every expert collection
(:func:`conveyor.partition.experts.is_experts_collection`: the output is shaped as its
``hidden_states``), and the ``nn.Linear`` / ``nn.Embedding`` modules a ``tp_plan``
shards (:mod:`conveyor.runtime.tp_export`). For the latter, :class:`Output` gives the
shape *one tensor-parallel rank's* module returns (a column-parallel projection: a slice
of the features), so that the rest of the graph (attention's head reshapes, ``repeat_kv``)
is recorded on the local shapes the stages will see.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import fx, nn

from conveyor.errors import ConfigError
from conveyor.partition.experts import is_experts_collection


@dataclass(frozen=True)
class Output:
    """The output of a kept module, from its first input, as export sees it.

    Attributes:
        features: the output's last size; None: the first input's shape (experts).
        append: the features are a new last dimension (an embedding's ids -> vectors)
            rather than replacing the input's last one (a linear layer).
        dtype: the output's dtype; None: the first input's.
        gathered: a dimension of the first input that holds one of ``parts`` slices on
            this rank and that the module gathers whole first, or None.
        split: a dimension of which this rank's output holds one of ``parts`` slices
            (a tensor-parallel rank's share), or None.
        parts: how many slices ``split`` has.
    """

    features: int | None = None
    append: bool = False
    dtype: torch.dtype | None = None
    gathered: int | None = None
    split: int | None = None
    parts: int = 1

    def empty(self, first: torch.Tensor) -> torch.Tensor:
        """An empty tensor shaped as the module's output on ``first``."""
        shape = list(first.shape)
        if self.gathered is not None:
            shape[self.gathered] = shape[self.gathered] * self.parts
        if self.features is not None:
            shape = [*shape, self.features] if self.append else [*shape[:-1], self.features]
        if self.split is not None:
            shape[self.split] = shape[self.split] // self.parts
        return first.new_empty(shape, dtype=self.dtype or first.dtype)


Kept = Mapping[str, Output]
"""Module name -> its output, for the modules a capture keeps whole besides the experts."""

_RECORDING: dict[int, Output] = {}  # the kept calls' outputs while export records


@torch.library.custom_op("conveyor::kept_call", mutates_args=())
def _kept_call(inputs: list[torch.Tensor], which: int) -> torch.Tensor:
    raise RuntimeError(  # only ever traced: as_module_calls turns it into a module call
        "conveyor::kept_call stands for a kept module's call while torch.export records the "
        "model; it is never run"
    )


@_kept_call.register_fake
def _kept_call_fake(inputs: list[torch.Tensor], which: int) -> torch.Tensor:
    return _RECORDING[which].empty(inputs[0])


def kept_modules(model: nn.Module, kept: Kept) -> dict[str, Output]:
    """Every module of ``model`` to keep whole: its expert collections (outermost only)
    and those ``kept`` names, in the model's module order."""
    found = [n for n, m in model.named_modules() if n and is_experts_collection(m)]
    experts = {n: Output() for n in found if not any(n.startswith(o + ".") for o in found)}
    out: dict[str, Output] = {}
    for name, _ in model.named_modules():
        inside = any(name.startswith(e + ".") for e in experts)
        if name in experts or (name in kept and not inside):
            out[name] = experts.get(name) or kept[name]
    return out


@contextlib.contextmanager
def recorded_as_calls(model: nn.Module, kept: Kept) -> Iterator[list[str]]:
    """While ``torch.export`` records ``model``, each module of :func:`kept_modules` is
    called as one opaque ``conveyor::kept_call`` op (its ``which`` indexes the yielded
    names); :func:`as_module_calls` turns those into ``call_module`` nodes afterwards."""
    modules = kept_modules(model, kept)
    names = list(modules)
    patched = []
    for which, name in enumerate(names):
        module = model.get_submodule(name)
        _RECORDING[which] = modules[name]
        module.forward = _stand_in(name, which, inspect.signature(module.forward))
        patched.append(module)
    try:
        yield names
    finally:
        _RECORDING.clear()
        for module in patched:
            del module.forward


def _stand_in(name: str, which: int, signature: inspect.Signature) -> Callable[..., torch.Tensor]:
    """The forward of kept module ``name`` while export records: its tensor arguments, in
    the order of its signature, through one ``conveyor::kept_call``."""

    def forward(*args: object, **kwargs: object) -> torch.Tensor:
        inputs = list(signature.bind(*args, **kwargs).args)
        if not all(isinstance(x, torch.Tensor) for x in inputs):
            raise ConfigError(
                f"model.{name} is kept whole in the torch.export capture (for tp_plan or ep) "
                f"but is called with non-tensor arguments; leave it out of tp_plan"
            )
        out: torch.Tensor = torch.ops.conveyor.kept_call(inputs, which)
        return out

    return forward


def as_module_calls(graph: fx.Graph, names: list[str]) -> None:
    """Each ``conveyor::kept_call`` node of ``graph`` becomes a ``call_module`` of the
    module it stands for, keeping the node's metadata (its module path: its stage)."""
    op = torch.ops.conveyor.kept_call.default
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not op:
            continue
        inputs, which = node.args
        with graph.inserting_before(node):
            call = graph.call_module(names[int(which)], tuple(inputs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
