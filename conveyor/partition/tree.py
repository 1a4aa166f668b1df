"""Putting values at dotted paths of a module tree (stage modules keep original names)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def install(root: nn.Module, target: str, value: Any) -> None:
    """Put ``value`` at ``target`` under ``root``, creating empty containers on the way.

    Modules are registered as submodules, parameters as parameters, other tensors as
    buffers, anything else as a plain attribute.

    Args:
        root: The module tree.
        target: The dotted path.
        value: What to put there.
    """
    *prefix, field = target.split(".")
    holder = root
    for part in prefix:
        child = holder._modules.get(part)
        if child is None:
            child = nn.Module()
            holder.add_module(part, child)
        holder = child
    if getattr(holder, field, None) is value:
        return
    if isinstance(value, nn.Module):
        # Replaces a container made earlier for a deeper target: the real module holds it.
        holder._modules[field] = value
    elif isinstance(value, nn.Parameter):
        holder.register_parameter(field, value)
    elif isinstance(value, torch.Tensor):
        holder.register_buffer(field, value)
    else:
        setattr(holder, field, value)
