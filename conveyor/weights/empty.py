"""``empty_weights``: build a model whose parameters take no memory (the meta device)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Parameters created inside are on the meta device: shapes without memory.

    Buffers stay real: they are small and often computed once in ``__init__`` (a
    rotary embedding's ``inv_freq``), which the meta device would lose. Hand the model
    to :class:`conveyor.Pipeline` (each rank then allocates only its own stages) or to
    :func:`conveyor.materialize` (the whole model, on one device).

    Example::

        with conveyor.empty_weights():
            model = AutoModelForCausalLM.from_config(config)
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            # The value is dropped right away: a layer's memory is held for an instant.
            meta = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            module._parameters[name] = meta

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def has_meta(modules: list[nn.Module]) -> bool:
    """Whether any parameter or buffer of ``modules`` is on the meta device."""
    return any(
        t.is_meta
        for m in modules
        for t in (*m.parameters(), *m.buffers())
        if isinstance(t, torch.Tensor)
    )
