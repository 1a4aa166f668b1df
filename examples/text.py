"""What the language-model examples share: training text every machine has (the Python
standard library's own source, as characters) and the batches drawn from it."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def corpus(limit: int) -> str:
    """Up to ``limit`` characters of the standard library's Python source, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    return "".join(parts)[:limit]


def encode(text: str) -> tuple[list[str], torch.Tensor]:
    """The characters of ``text`` (the vocabulary, sorted) and ``text`` as their indices."""
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    return vocab, torch.tensor([lookup[c] for c in text], dtype=torch.long)


def windows(data: torch.Tensor, step: int, rows: int, length: int) -> torch.Tensor:
    """``rows`` windows of ``length + 1`` tokens; the batch of a step depends on the step
    alone, so a run resumed from a checkpoint repeats nothing."""
    gen = torch.Generator().manual_seed(step)
    at = torch.randint(len(data) - length - 1, (rows,), generator=gen)
    return torch.stack([data[i : i + length + 1] for i in at.tolist()])

