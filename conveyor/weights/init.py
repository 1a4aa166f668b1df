"""How a module's own parameters get their first values: its own rule, under a seed made
from its name, so that every layout draws the same numbers."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from torch import nn


def seed_of(init_seed: int, name: str) -> int:
    """The RNG seed of the module called ``name`` in the model (stable across processes
    and runs, unlike ``hash``)."""
    digest = hashlib.sha256(f"{init_seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def rule_of(model: nn.Module, name: str, module: nn.Module) -> Callable[[], object] | None:
    """The module's own initialization, or None where it has none.

    In order: the ``_init_weights`` of the nearest transformers model holding it (what
    that model's ``post_init`` runs), then ``reset_parameters()`` (torch's layers), then
    ``_reset_parameters()`` (``nn.MultiheadAttention``).
    """
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        holder = model.get_submodule(".".join(parts[:depth]))
        init_weights = getattr(holder, "_init_weights", None)
        if callable(init_weights) and hasattr(holder, "config"):
            return lambda: init_weights(module)
    for attr in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, attr, None)
        if callable(reset):
            return reset  # type: ignore[no-any-return]
    return None
