"""Capture a model's forward as a graph to cut: ``torch.fx`` first, ``torch.export`` when
fx cannot.

``torch.fx`` needs no sample and keeps ``torch.nn`` modules whole, but stops at Python
control flow on traced values and at ``**kwargs`` signatures, which is most real model
code (every Hugging Face model). ``torch.export`` (:mod:`conveyor.partition.export`)
follows such code on a sample batch. Captures are cached per model and input structure,
so splitting the same model again (another pp, schedule or chunk count) costs nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from conveyor.errors import ConfigError
from conveyor.partition.captured import Captured
from conveyor.partition.export import capture_export
from conveyor.partition.failure import capture_failure
from conveyor.partition.kept import Kept

_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[Any, Captured]] = weakref.WeakKeyDictionary()


class NeedsSample(ConfigError):
    """fx cannot trace the model; export needs a sample batch to capture it."""


def not_split_yet(what: str, model: Any) -> ConfigError:
    """The error of a call that needs a split made on the first batch, before it."""
    return ConfigError(
        f"{what} needs the split, which is made on the first batch: "
        f"{type(model).__name__} is captured with torch.export on a sample; run "
        f"a train_step first, or pass sample=(inputs, targets) to Pipeline to split "
        f"it at construction"
    )


def capture(model: nn.Module, sample: Any = None, kept: Kept | None = None) -> Captured:
    """The model's graph: fx when it traces, else export on ``sample``.

    Args:
        model: The model to capture.
        sample: One micro-batch of stage-0 input (a tensor, tuple or dict of tensors);
            needed only when fx cannot trace the model.
        kept: Modules a torch.export capture keeps whole besides the expert collections
            (:mod:`conveyor.partition.kept`; fx keeps every ``torch.nn`` module whole).

    Returns:
        The capture, cached per model (its modules, parameters and mode) and sample
        structure.

    Raises:
        NeedsSample: fx failed and no sample was given.
        ConfigError: fx and export both failed; names the module and source line that
            stopped them.
    """
    key = _structure(model)
    cached = _CACHE.setdefault(model, {})
    hit = cached.get((key, None))
    if hit is not None:
        return hit
    try:
        captured = _fx(model)
    except Exception as fx_error:
        if sample is None:
            raise NeedsSample(capture_failure(model, fx_error)) from fx_error
        sample_key = (key, _sample_key(sample), tuple(sorted((kept or {}).items())))
        hit = cached.get(sample_key)
        if hit is not None:
            return hit
        captured = capture_export(model, sample, fx_error, kept)
        cached[sample_key] = captured
        return captured
    cached[(key, None)] = captured
    return captured


def _fx(model: nn.Module) -> Captured:
    """The model's graph as ``torch.fx`` traces it, with the literal tensors it found."""
    before = set(vars(model))
    tracer = _Tracer()
    # Buffers become graph reads too (so ``self.mask[:t]`` with a traced t works).
    tracer.proxy_buffer_attributes = True
    try:
        graph = tracer.trace(model)
    finally:
        # The tracer parks literal tensors on the model as _tensor_constant<i>; take them.
        constants = {name: vars(model)[name] for name in set(vars(model)) - before}
        for name in constants:
            delattr(model, name)
    return Captured(graph, model, constants, exported=False)


class _Tracer(fx.Tracer):
    """fx's tracer, keeping conveyor's stand-ins (``_conveyor_leaf``) whole as calls."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """torch.nn modules and conveyor's stand-ins are calls in the graph."""
        return getattr(m, "_conveyor_leaf", False) or super().is_leaf_module(
            m, module_qualified_name
        )


def _structure(model: nn.Module) -> tuple[Any, ...]:
    """A cache key that changes when the model's modules, parameters or mode change."""
    return (
        model.training,
        tuple((n, id(m)) for n, m in model.named_modules()),
        tuple(id(p) for p in model.parameters()),
    )


def _sample_key(sample: Any) -> tuple[Any, ...]:
    """A cache key for a sample's structure, ranks, dtypes and devices (not its sizes)."""
    leaves, spec = pytree.tree_flatten(sample)
    return (
        str(spec),
        tuple(
            (x.dim(), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else repr(x)
            for x in leaves
        ),
    )
