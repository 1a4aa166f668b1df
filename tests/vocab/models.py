"""Small language models for the vocabulary-parallel tests: a GPT-like module (torch.fx
traces it), a layer list, and a transformers causal LM from a config; padded batches."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB, HIDDEN = 37, 16  # 37 rows: uneven over 2 (19, 18) and 4 ranks (10, 10, 10, 7)


class TinyGPT(nn.Module):
    """Embedding, residual blocks, norm, bias-free output layer (tied or not)."""

    def __init__(
        self, tied: bool = False, blocks: int = 4, dropout: float = 0.0, vocab: int = VOCAB
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, HIDDEN, padding_idx=0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Dropout(dropout))
            for _ in range(blocks)
        )
        self.ln = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.ln(x))  # type: ignore[no-any-return]


def layer_list() -> nn.Sequential:
    """The same shape as a layer list: embedding first, output layer last."""
    return nn.Sequential(
        nn.Embedding(VOCAB, HIDDEN),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.LayerNorm(HIDDEN),
        nn.Linear(HIDDEN, VOCAB, bias=False),
    )


def tiny_llama(tied: bool = False) -> nn.Module:
    """A 2-layer transformers Llama causal LM from a config (no weights downloaded)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        tie_word_embeddings=tied, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def padded_batch(
    rows: int = 6, length: int = 9, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets: row r has r % 4 padded positions (-100), ids 0 (padding)
    there."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, length), generator=g)
    targets = ids.clone()
    for r in range(rows):
        pad = r % 4
        if pad:
            ids[r, length - pad :] = 0
            targets[r, length - pad :] = -100
    return ids, targets


def unsplit_steps(
    model: nn.Module, steps: list[tuple[torch.Tensor, torch.Tensor]], loss: Any
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit ``model``'s whole-batch token loss of each of ``steps`` (a ``(total,
    count)`` loss), its gradients accumulated over them."""
    losses = []
    for ids, targets in steps:
        total, count = loss(model(ids), targets)
        (total / count).backward()
        losses.append(float((total / count).detach()))
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
