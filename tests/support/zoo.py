"""Models of every shape the partitioner meets: skips, pytrees, annotations, tied weights,
sequences (models and their inputs only; comparisons and training runs are in helpers.py)."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from conveyor.partition import ExecutionSequence, sequence, set_stage


class Skip(nn.Module):
    """Four blocks; block 3 also reads h0, which crosses two stage boundaries."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.tanh(self.blocks[0](x))
        h = torch.tanh(self.blocks[1](h0))
        h = torch.tanh(self.blocks[2](h))
        return self.blocks[3](h + h0)


@torch.fx.wrap
def pack(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """Opaque to fx: one node whose value is a nested pytree with an int inside."""
    return {"a": a, "pair": (b, 3)}


class Consume(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, d: dict[str, Any], n: int) -> torch.Tensor:
        return self.lin(d["a"]) * d["pair"][1] + d["pair"][0] / n


class Pytree(nn.Module):
    """Two inputs; a dict holding a tuple and an int, and an int from ``x.size``, cross
    the boundary; the output is nested with an int in it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.consume = Consume()
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        d = pack(self.a(x), self.b(y))
        n = x.size(1)
        h = self.consume(d, n)
        return self.out(h), {"h": h, "n": n}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.lin(self.norm(x)))


class Deep(nn.Module):
    def __init__(self, blocks: int = 6, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class CausalSelfAttention(nn.Module):
    """GPT-2's attention, one head: each position sees itself and those before it (a mask
    buffer, which stages must carry). ``real_models.Attention`` is timm's, multi-head and
    unmasked, written so that fx cannot trace it."""

    def __init__(self, width: int, context: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        mask = torch.tril(torch.ones(context, context, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        return self.proj(att @ v)


class GPTBlock(nn.Module):
    def __init__(self, width: int, context: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, context)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token embedding tied to the output head, as in GPT-2."""

    def __init__(self, vocab: int = 11, width: int = 8, context: int = 5, layers: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Parameter(torch.randn(context, width) * 0.1)
        self.blocks = nn.ModuleList(GPTBlock(width, context) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok_emb(idx) + self.pos_emb[: idx.size(1)]
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))


def tokens() -> torch.Tensor:
    return torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(0))


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = -h
        return self.b(h)


class Net(nn.Module):
    """A small ResNet-like model for execution sequences."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.layer1 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Conv2d(4, 2, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(2 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(h, 1))


def annotated_deep(style: str) -> Deep:
    model = Deep()
    if style == "attribute":
        model.blocks[2].pipeline_stage = 1
        model.blocks[4].pipeline_stage = 2
    else:
        set_stage(model.blocks[2], 1)
        set_stage(model.blocks[4], 2)
    return model


def net_sequence(model: Net) -> ExecutionSequence:
    flatten = functools.partial(torch.flatten, start_dim=1)
    return sequence(
        model, ["conv1", "bn1", model.relu, "layer1.0", "layer1.1", "layer2", flatten, "fc"]
    )


class InitGPT(TinyGPT):
    """TinyGPT with the ``reset_parameters`` its own position embedding needs to be built
    on the meta device (``conveyor.empty_weights``): a parameter a module owns directly is
    initialized by that module's rule."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.pos_emb, std=0.1)
