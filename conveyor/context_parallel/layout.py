"""Which tokens of a sequence each context-parallel rank holds.

The sequence is cut into ``2 * cp`` equal chunks and cp rank ``i`` holds chunks ``i`` and
``2cp - 1 - i`` (Megatron-LM's and torchtitan's causal load balance): under a causal mask
the early chunk attends to few keys and the late one to many, so every rank does the same
attention work. Positions stay global: a rank's tokens keep their index in the sequence.
"""

from __future__ import annotations

import torch

from conveyor.errors import ConfigError


def chunk_length(length: int, cp: int) -> int:
    """The length of each of the ``2 * cp`` chunks of a sequence of ``length`` tokens.

    Raises:
        ConfigError: ``length`` is not a multiple of ``2 * cp``.
    """
    if length % (2 * cp):
        raise ConfigError(
            f"with cp={cp} each sequence is cut into {2 * cp} equal chunks, but this one has "
            f"{length} tokens; pad the sequences to a multiple of {2 * cp}"
        )
    return length // (2 * cp)


def held_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks cp rank ``rank`` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def held_index(length: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global indices of the tokens cp rank ``rank`` holds, in its order (int64)."""
    c = chunk_length(length, cp)
    first, second = held_chunks(rank, cp)
    return torch.cat(
        [
            torch.arange(first * c, (first + 1) * c, device=device),
            torch.arange(second * c, (second + 1) * c, device=device),
        ]
    )


def cut(tensor: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """``tensor``'s share for cp rank ``rank`` along the sequence dimension ``dim``."""
    length = tensor.size(dim)
    c = chunk_length(length, cp)
    first, second = held_chunks(rank, cp)
    return torch.cat([tensor.narrow(dim, first * c, c), tensor.narrow(dim, second * c, c)], dim=dim)


def join(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every cp rank's share (``parts`` by cp rank): :func:`cut`
    inverted."""
    cp = len(parts)
    c = parts[0].size(dim) // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = held_chunks(rank, cp)
        chunks[first] = part.narrow(dim, 0, c)
        chunks[second] = part.narrow(dim, c, c)
    return torch.cat([c for c in chunks if c is not None], dim=dim)
