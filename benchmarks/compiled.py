"""Compiled stages against eager ones on this machine's CPU (inductor's C++ backend).

One process runs a 2-rank pipeline (``conveyor.init(pp=2)``: both stages here, one after
the other) of a small pre-norm transformer layer list (width 256, 4 blocks with
``scaled_dot_product_attention``, 8 rows x 128 tokens, 4 micro-batches), one thread.
Per schedule it prints the median training-step time eager and compiled (after two
warm-up steps, which pay the compilation, reported apart), and their ratio. On a CPU the
matmuls dominate and inductor does not speed them up, so expect a ratio near 1.0; what
compiling buys there is the fused element-wise work (layer norms, GELU, residual adds).

    python benchmarks/compiled.py [--steps 10] [--schedules 1f1b,zb-h1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import conveyor
from conveyor.schedules import default_chunks


class Block(nn.Module):
    """Pre-norm attention and MLP, each with a skip."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block on ``x`` of shape (rows, tokens, width)."""
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def step_times(
    pipe: conveyor.Pipeline, x: torch.Tensor, y: torch.Tensor, steps: int
) -> tuple[float, list[float]]:
    """Seconds of the two warm-up steps, and of each timed step."""
    start = time.perf_counter()
    for _ in range(2):
        pipe.train_step(x, y)
    warm = time.perf_counter() - start
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        pipe.train_step(x, y)
        times.append(time.perf_counter() - t)
    return warm, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--schedules", default="1f1b,zb-h1")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width, blocks = 256, 4
    net = nn.Sequential(*[Block(width, 4) for _ in range(blocks)])
    x, y = torch.randn(8, 128, width), torch.randn(8, 128, width)
    for name in args.schedules.split(","):
        row = []
        for compiled in (False, True):
            pipe = conveyor.Pipeline(
                copy.deepcopy(net),
                loss_fn=F.mse_loss,
                microbatches=4,
                schedule=name,
                chunks=default_chunks(name),
                context=conveyor.init(pp=2),
                compile=compiled,
            )
            warm, times = step_times(pipe, x, y, args.steps)
            stats = pipe.compile_stats
            spent = stats.total_seconds() if stats is not None else 0.0
            row.append((statistics.median(times) * 1e3, warm, spent))
        (eager, _, _), (comp, warm, spent) = row
        print(
            f"{name:10s} eager {eager:8.1f} ms/step | compiled {comp:8.1f} ms/step "
            f"({comp / eager:.2f} of eager) | compiling took {spent:.1f} s of the warm-up's "
            f"{warm:.1f} s"
        )


if __name__ == "__main__":
    main()
