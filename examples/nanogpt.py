"""A GPT written the way nanoGPT writes it, trained with conveyor as nanoGPT's own script
would train it: the model computes its own loss, and the optimizer is built first.

    python examples/nanogpt.py                                 # one process, 2 stages
    conveyor launch --nproc-per-node 2 examples/nanogpt.py     # 2 processes
    conveyor launch --nproc-per-node 2 examples/nanogpt.py --schedule zb-h1

The model keeps nanoGPT's interface: ``forward(idx, targets=None)`` returns ``(logits,
loss)`` (the loss ``None`` without targets, and then only the last position's logits),
and ``configure_optimizers`` builds AdamW with weight decay on the matrices alone. So
conveyor gets it as it is:

- ``loss_fn=None``: the loss is the output tuple's one 0-dim tensor;
- the batch is the model's positional inputs ``(idx, targets)``, cut into micro-batches;
- the optimizer is built over the model's parameters before the ``Pipeline``, and trains
  what the pipeline trains.

nanoGPT's loss is the mean over a micro-batch's tokens; conveyor weighs each micro-batch's
by its rows, which is the whole batch's token mean when every row counts all its tokens (as
here: windows of one length). With padded rows (targets ``-1``) pass a token loss instead:
``loss_fn=lambda out, y: TokenCrossEntropy(ignore_index=-1)(out[0], y)`` and the targets
again (docs/guide/losses.md).
"""

import argparse
import inspect
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import conveyor


@dataclass
class GPTConfig:
    """nanoGPT's configuration fields."""

    block_size: int = 64
    vocab_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """LayerNorm whose bias is optional."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with one projection for q, k and v."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module):
    """The block's feed-forward part: 4x wider, GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model: ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=LayerNorm(config.n_embd, config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:  # inference: the last position's logits only
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(
        self, weight_decay: float, learning_rate: float, betas: tuple[float, float]
    ) -> torch.optim.AdamW:
        """AdamW, with weight decay on the parameters of two or more dimensions only."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters
        extra = {"fused": True} if fused and next(self.parameters()).is_cuda else {}
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra)


def corpus(limit: int) -> tuple[int, torch.Tensor]:
    """Up to ``limit`` bytes of the standard library's Python source, as byte values (a
    vocabulary of 128 covers ASCII; other bytes are folded into it)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = b"".join(f.read_bytes() for f in files)[:limit]
    return 128, torch.tensor(list(data), dtype=torch.long) % 128


def batch(data: torch.Tensor, step: int, rows: int, length: int) -> tuple[torch.Tensor, ...]:
    """Step ``step``'s ``(idx, targets)``: windows drawn by a generator seeded with the step
    (every rank draws the same batch)."""
    gen = torch.Generator().manual_seed(step)
    at = torch.randint(len(data) - length - 1, (rows,), generator=gen).tolist()
    x = torch.stack([data[i : i + length] for i in at])
    y = torch.stack([data[i + 1 : i + 1 + length] for i in at])
    return x, y


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="nanoGPT's model trained with conveyor.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--pp", type=int, default=None, help="pipeline ranks; None: the processes, or 2 alone"
    )
    ap.add_argument("--schedule", default="1f1b", help="pipeline schedule")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=200, help="training steps")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    ap.add_argument("--block-size", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    ap.add_argument("--n-embd", type=int, default=128, help="model width")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    ap.add_argument("--chars", type=int, default=1_000_000, help="corpus size in bytes")
    args = ap.parse_args(argv)

    # Under conveyor launch the processes give the pipeline ranks; alone, simulate two.
    ctx = conveyor.init(pp=args.pp or (None if dist.is_torchelastic_launched() else 2))
    torch.manual_seed(1337)  # the same model on every rank
    vocab, data = corpus(args.chars)
    config = GPTConfig(args.block_size, vocab, args.n_layer, 4, args.n_embd)
    model = GPT(config)
    # nanoGPT's order: the optimizer first, over the model's own parameters.
    optimizer = model.configure_optimizers(0.1, args.lr, (0.9, 0.95))
    pipe = conveyor.Pipeline(
        model, loss_fn=None, microbatches=args.microbatches, schedule=args.schedule
    )
    start = time.perf_counter()
    for step in range(args.steps):
        loss = pipe.train_step(batch(data, step, args.batch_size, args.block_size))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if ctx.rank == 0 and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            ms = 1000 * (time.perf_counter() - start) / (step + 1)
            print(f"step {step:4d} loss {loss.item():.4f} {ms:.0f} ms/step", flush=True)
    if ctx.rank == 0:
        print(pipe)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
