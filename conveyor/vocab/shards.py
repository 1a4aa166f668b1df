"""The split model without its vocabulary layers, and this rank's rows of them.

:func:`stripped` gives the model the stages are cut from: a copy along the paths to the
two layers (every other module, parameter and buffer is the model's own object) in which
the input embedding is a :class:`VocabInput` and the output layer an ``nn.Identity``, so
the last stage returns the hidden states and the first takes the embedding as an input
of its own (:func:`first_stage`). :class:`VocabShards` keeps this rank's rows of
both layers: the original modules, each weight a DTensor ``Shard(0)`` over the pipeline
ranks (torch's chunk rule for uneven sizes), under the original names.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch
from torch import fx, nn

from conveyor.errors import ConfigError, PipelineError
from conveyor.partition.cuts import rows_per_rank
from conveyor.partition.owned import own_copy
from conveyor.runtime.local_part import local_shard
from conveyor.vocab.layers import VocabLayers

Takes = Literal["inputs_embeds", "replace", "prepend"]
"""How the first stage takes its input embedding, an input of its own: a transformers
model as ``inputs_embeds`` (instead of ``input_ids``); a layer list whose first layer is
the embedding's stand-in instead of the token ids; a captured graph as one more input,
before the model's own (:func:`first_stage`)."""

EMBEDDING = "conveyor_input_embedding"
"""The first stage's added input (``prepend``): its placeholder's name."""


class VocabInput(nn.Module):
    """Stands in for the input embedding in the split model: the first stage is given the
    embedding the E pass computed for its micro-batch as an input of its own
    (:func:`first_stage`), and this returns it."""

    _conveyor_leaf = True  # torch.fx keeps it whole (a call, not traced through)

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._traced: torch.Tensor | None = None  # see exportable()

    def forward(self, embedded: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The micro-batch's embedding, given as the first stage's input."""
        if self._traced is not None:
            return self._traced
        if not isinstance(embedded, torch.Tensor) or not embedded.is_floating_point():
            raise PipelineError(
                f"model.{self.name} is split over the pipeline ranks (vocab_parallel) and "
                f"runs only inside a pipeline step; call the pipeline, not the stage"
            )
        return embedded


def first_stage(stage: nn.Module, stand_in: VocabInput, transformers: bool) -> Takes:
    """Make the first stage take its embedding as an input of its own; returns how.

    A graph's call of the stand-in is given a new first input (``prepend``); a layer list
    starting with it takes the embedding instead of the ids (``replace``).

    Raises:
        ConfigError: the stand-in is elsewhere (not where the first stage reads it).
    """
    if transformers:
        return "inputs_embeds"
    if next(iter(stage.children()), None) is stand_in and not isinstance(stage, fx.GraphModule):
        return "replace"
    if isinstance(stage, fx.GraphModule):
        calls = [n for n in stage.graph.nodes if n.op == "call_module"
                 and stage.get_submodule(str(n.target)) is stand_in]  # fmt: skip
        inputs = [n for n in stage.graph.nodes if n.op == "placeholder"]
        if calls and inputs:
            with stage.graph.inserting_before(inputs[0]):
                embedding = stage.graph.placeholder(EMBEDDING)
            for call in calls:
                call.args, call.kwargs = (embedding,), {}
            stage.recompile()
            return "prepend"
    raise ConfigError(
        f"vocab_parallel: the first stage does not start from model.{stand_in.name}; the "
        f"input embedding must be what the first stage computes first from the token ids"
    )


def exportable(model: nn.Module, stand_in: VocabInput) -> None:
    """Make ``model`` (the split model, a copy) take its input embedding as its first
    argument, before its own, so that torch.export captures it as an input of the graph.

    While export traces the model's forward, the stand-in returns that argument: the
    captured graph then reads the embedding from its input, and the stand-in is not in it
    (export inlines modules). Nothing is read from the stand-in when the stages run.
    """
    base = type(model)

    def forward(self: nn.Module, conveyor_input_embedding: torch.Tensor, *args: Any,
                **kwargs: Any) -> Any:  # fmt: skip
        stand_in._traced = conveyor_input_embedding
        try:
            return base.forward(self, *args, **kwargs)
        finally:
            stand_in._traced = None

    namespace = {"forward": forward, "__module__": base.__module__}
    model.__class__ = type(base.__name__, (base,), namespace)


def with_embedding(value: Any, embedded: torch.Tensor, takes: Takes) -> Any:
    """The first stage's input for micro-batch ``value`` given its ``embedded`` ids."""
    if takes == "replace":
        return embedded
    if takes == "inputs_embeds":
        if not isinstance(value, dict):
            return value
        out = {k: v for k, v in value.items() if k not in ("input_ids", "labels")}
        out["inputs_embeds"] = embedded
        return out
    if isinstance(value, dict):
        return {EMBEDDING: embedded, **value}
    return (embedded, *(value if isinstance(value, tuple) else (value,)))


def stripped(model: nn.Module, layers: VocabLayers) -> tuple[nn.Module, VocabInput]:
    """``model`` with the vocabulary layers replaced (see the module doc); ``model``
    itself is unchanged. Returns the copy and its input stand-in."""
    root = _copy(model)
    stand_in = VocabInput(layers.input)
    _replace(root, layers.input, stand_in)
    _replace(root, layers.output, nn.Identity())
    return root, stand_in


def _copy(module: nn.Module) -> nn.Module:
    out = copy.copy(module)
    out._modules = dict(module._modules)
    return out


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    """Set ``root``'s submodule ``name`` to ``new``, copying the modules on the way (the
    originals, shared with the user's model, keep their children)."""
    *path, leaf = name.split(".")
    node = root
    for part in path:
        child = node._modules[part]
        assert child is not None
        if not getattr(child, "_conveyor_copied", False):
            child = _copy(child)
            child._conveyor_copied = True  # type: ignore[assignment]
            node._modules[part] = child
        node = child
    node._modules[leaf] = new


def chunk_rows(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows ``[lo, hi)`` of ``rows`` split over ``ranks`` as
    ``torch.chunk`` splits them (DTensor's ``Shard(0)``): ``ceil(rows / ranks)`` each,
    the last ones fewer or none."""
    size = rows_per_rank(rows, ranks)
    lo = min(rows, rank * size)
    return lo, min(rows, lo + size)


class VocabShards:
    """This rank's rows of the vocabulary layers (module doc).

    Args:
        model: The user's model (holds the layers under ``layers``' names).
        layers: Which layers.
        mesh: The 1-D pipeline mesh the rows are spread over; None: one process holds
            every row (the weights stay plain tensors).

    Attributes:
        embedding: The input embedding module (its weight this rank's rows).
        output: The output layer module (the same weight when tied).
        lo, hi: This rank's rows ``[lo, hi)``.
        holder: A module holding both under their names in the model (for parameters,
            state dicts and giving meta weights their values).
    """

    def __init__(self, model: nn.Module, layers: VocabLayers, mesh: Any | None) -> None:
        self.layers = layers
        # copies of their own: the rows (and FSDP) replace their weights, not the model's
        embedding, output = (
            own_copy(model.get_submodule(n)) for n in (layers.input, layers.output)
        )
        self.embedding: nn.Embedding = embedding  # type: ignore[assignment]
        self.output: nn.Linear = output  # type: ignore[assignment]
        ranks, rank = (mesh.size(), mesh.get_local_rank()) if mesh is not None else (1, 0)
        self.lo, self.hi = chunk_rows(layers.rows, ranks, rank)
        self.mesh = mesh
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Shard, distribute_tensor

            done: dict[int, nn.Parameter] = {}
            for module in (self.embedding, self.output):
                weight = module.weight
                if isinstance(weight, DTensor):
                    continue  # sharded by an earlier pipeline over this model
                if id(weight) not in done:
                    value = distribute_tensor(weight.detach(), mesh, [Shard(0)], src_data_rank=None)
                    done[id(weight)] = nn.Parameter(value, weight.requires_grad)
                module.register_parameter("weight", done[id(weight)])
        self.holder = nn.Module()
        _put(self.holder, layers.input, self.embedding)
        _put(self.holder, layers.output, self.output)

    def local(self, module: nn.Module) -> torch.Tensor:
        """``module``'s weight rows held here, as a plain tensor."""
        return local_shard(_weight(module))

    def add_grad(self, module: nn.Module, grad: torch.Tensor) -> None:
        """Add ``grad`` (this rank's rows) to ``module.weight.grad`` (a DTensor like the
        weight where it is one)."""
        weight = _weight(module)
        if not weight.requires_grad:
            return
        if weight.grad is None:
            self._set_grad(weight, grad.to(weight.dtype).clone())
            return
        local = local_shard(weight.grad)
        local.add_(grad.to(local.dtype))

    def _set_grad(self, weight: torch.Tensor, local: torch.Tensor) -> None:
        """``weight.grad`` becomes ``local`` (this rank's rows), a DTensor like the weight
        where it is one."""
        if self.mesh is None:
            weight.grad = local
            return
        from torch.distributed.tensor import DTensor

        weight.grad = DTensor.from_local(
            local, self.mesh, weight.placements,  # type: ignore[attr-defined]
            run_check=False, shape=weight.shape, stride=weight.stride(),
        )  # fmt: skip

    def add_rows(self, module: nn.Module, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Add ``rows[i]`` to row ``index[i]`` of ``module.weight.grad`` (this rank's rows),
        in place: no whole-size temporary per micro-batch."""
        weight = _weight(module)
        if not weight.requires_grad:
            return
        local = torch.zeros_like(local_shard(weight)) if weight.grad is None else None
        if local is not None:  # the first gradient: these rows become it (no copy)
            local.index_add_(0, index, rows.to(weight.dtype))
            self._set_grad(weight, local)
            return
        assert weight.grad is not None
        local_shard(weight.grad).index_add_(0, index, rows.to(weight.dtype))

    def parameters(self) -> list[nn.Parameter]:
        """The layers' weights (a tied one once)."""
        return list(self.holder.parameters())


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _put(root: nn.Module, name: str, module: nn.Module) -> None:
    *path, leaf = name.split(".")
    node = root
    for part in path:
        if part not in node._modules:
            node.add_module(part, nn.Module())
        node = node._modules[part]  # type: ignore[assignment]
    node.add_module(leaf, module)
