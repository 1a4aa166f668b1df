"""Checks of the Trainer's arguments, and the data order's seed."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from conveyor.errors import ConfigError


def positive(name: str, value: Any) -> None:
    """Raise a one-sentence ConfigError unless ``value`` is an int >= 1.

    Args:
        name: The argument's name.
        value: Its value.

    Raises:
        ConfigError: ``value`` is not an int >= 1.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be an int >= 1, got {name}={value!r}")


def check_length(epochs: int | None, max_steps: int | None) -> int:
    """``fit``'s length: exactly one of ``epochs`` and ``max_steps``.

    Args:
        epochs: ``fit(epochs=...)``.
        max_steps: ``fit(max_steps=...)``.

    Returns:
        The one given.

    Raises:
        ConfigError: Neither or both are given, or the one given is not an int >= 1.
    """
    if epochs is None and max_steps is None:
        raise ConfigError(
            "fit needs how long to train: pass epochs= (passes over the data) or max_steps= "
            "(optimizer steps)"
        )
    if epochs is not None and max_steps is not None:
        raise ConfigError(
            f"fit got both epochs={epochs!r} and max_steps={max_steps!r}; pass only one of them"
        )
    if epochs is not None:
        positive("epochs", epochs)
        return epochs
    assert max_steps is not None
    positive("max_steps", max_steps)
    return max_steps


def shared_seed(ctx: Any) -> int:
    """Rank 0's ``torch.initial_seed()``, on every rank (the data order's seed).

    Args:
        ctx: The pipeline's context.

    Returns:
        The seed.
    """
    seed = torch.initial_seed() % 2**62
    if ctx.distributed:
        buf = torch.tensor([seed], dtype=torch.int64, device=ctx.device)
        dist.broadcast(buf, 0)
        seed = int(buf.item())
    return seed
