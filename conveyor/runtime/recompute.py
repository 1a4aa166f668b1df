"""Activation recompute and mixed precision: option checks and the pieces the engine uses.

Recompute, done by the engine itself rather than with ``torch.utils.checkpoint``: F runs
the stage with every tensor autograd would save dropped on the spot (the graph is still
built, so the outputs know exactly which of them need a gradient), keeps the stage input
and the RNG state, and hands the outputs on. B re-runs the forward from that input with
the same RNG state (dropout draws the same masks) and then does its backward, whole or
split. ``torch.utils.checkpoint(use_reentrant=False)`` recomputes once per backward call
(per autograd graph task), and a split backward makes two calls, B and W: it ran the
forward three times and, with the deferred linear weight gradients, lost some of them.

Mixed precision: each stage's forward (and its recompute, and the loss on the last stage)
runs under ``torch.autocast``; parameters and gradients stay in their own dtype.

What recompute saves is measured by :class:`~conveyor.runtime.memory.TensorMemory`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from conveyor.errors import ConfigError

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)

RngState = tuple[torch.Tensor, torch.Tensor | None]


def recompute_stages(option: bool | Iterable[int], stages: int) -> frozenset[int]:
    """The global stage indices ``Pipeline(recompute=...)`` names: True is every stage."""
    if isinstance(option, bool):
        return frozenset(range(stages)) if option else frozenset()
    try:
        chosen = list(option)
    except TypeError:
        raise ConfigError(
            f"recompute must be True/False or a collection of stage indices, got {option!r}"
        ) from None
    for s in chosen:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < stages:
            raise ConfigError(
                f"recompute names stage {s!r}, but this pipeline's stages are 0..{stages - 1} "
                f"(global indices, pp x chunks = {stages} stages); pass indices in that range"
            )
    return frozenset(chosen)


def autocast_dtype(option: object) -> torch.dtype | None:
    """Check ``Pipeline(autocast=...)``: None, ``torch.bfloat16`` or ``torch.float16``."""
    if option is None or option in AUTOCAST_DTYPES:
        return option
    raise ConfigError(
        f"autocast must be torch.bfloat16 or torch.float16 (or None for full precision), "
        f"got {option!r}"
    )


def rng_state(device: torch.device) -> RngState:
    """The CPU generator's state and, on CUDA, the device generator's."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextmanager
def replay_rng(state: RngState, device: torch.device) -> Iterator[None]:
    """Run the block from ``state``; the generators continue afterwards as if it had not
    run."""
    cpu, cuda = state
    before = rng_state(device)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
    try:
        yield
    finally:
        torch.set_rng_state(before[0])
        if before[1] is not None:
            torch.cuda.set_rng_state(before[1], device)


def _drop(_: torch.Tensor) -> None:
    return None


def _never(_: None) -> torch.Tensor:
    raise RuntimeError(
        "a backward reached the forward graph of a recomputed stage; recompute stages are "
        "differentiated through their re-run forward only"
    )


def discard_saved() -> torch.autograd.graph.saved_tensors_hooks:
    """Build the graph but keep none of the tensors autograd would save for backward."""
    return torch.autograd.graph.saved_tensors_hooks(_drop, _never)


def shape_only(t: torch.Tensor) -> torch.Tensor:
    """A storage-free stand-in with ``t``'s shape and dtype (for posting receives)."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")
