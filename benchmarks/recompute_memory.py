"""Activation memory and step time with and without ``Pipeline(recompute=True)``.

The model is ``examples/gpt.py``'s GPT (tied embedding and head, pre-norm blocks with
``scaled_dot_product_attention``), 2 processes on gloo, one thread each. For each schedule
two pipelines are built from the same seeded model, recompute off and on; after a warm-up
step (so ``.grad`` exists), one step runs under :class:`conveyor.runtime.memory.
TensorMemory`: the peak, over the step, of bytes of tensors created during the step that
are alive at once on this rank (saved activations, the inputs recompute keeps, received and
sent activations and gradients, backward temporaries; parameters and their ``.grad`` are
not counted). Then timed steps alternate between the two pipelines (outside the memory
counter, which slows every operator down); medians are printed.

    python benchmarks/recompute_memory.py [--steps 6] [--schedules 1f1b,zb-h1] [--autocast]

Prints a markdown table: per schedule and rank, peak step memory without and with
recompute, the fraction saved, median step times and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from common import run_on_processes
from gpt import GPT, annotate, lm_loss

import conveyor
from conveyor.runtime.memory import TensorMemory

PROCS = 2
SCHEDULES = {  # name -> chunks
    "gpipe": 1,
    "1f1b": 1,
    "interleaved-1f1b": 2,
    "zb-h1": 1,
    "zb-h2": 1,
    "zbv": 2,
}
VOCAB, CONTEXT, WIDTH, DEPTH, HEADS, BATCH, MICROBATCHES = 96, 128, 128, 8, 4, 32, 8


def _pipeline(
    ctx: conveyor.Context, name: str, recompute: bool, autocast: torch.dtype | None
) -> conveyor.Pipeline:
    torch.manual_seed(0)
    model = GPT(VOCAB, CONTEXT, WIDTH, DEPTH, HEADS)
    chunks = SCHEDULES[name]
    annotate(model, ctx.pp_size * chunks)
    return conveyor.Pipeline(
        model,
        loss_fn=lm_loss,
        microbatches=MICROBATCHES,
        schedule=name,
        chunks=chunks,
        context=ctx,
        recompute=recompute,
        autocast=autocast,
    )


def _step(pipe: conveyor.Pipeline, x: torch.Tensor, y: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    pipe.train_step(x, y)
    return time.perf_counter() - start


def worker(args: argparse.Namespace) -> None:
    """Measure every schedule on this rank; rank 0 prints the table."""
    ctx = conveyor.init()
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(VOCAB, (BATCH, CONTEXT), generator=gen)
    y = torch.randint(VOCAB, (BATCH, CONTEXT), generator=gen)
    autocast = torch.bfloat16 if args.autocast else None
    rows: list[tuple[Any, ...]] = []
    for name in args.schedules.split(","):
        pipes = [_pipeline(ctx, name, rc, autocast) for rc in (False, True)]
        peaks = []
        for pipe in pipes:
            pipe.train_step(x, y)  # warm-up: gradients exist, shapes are learnt
            with TensorMemory() as mem:
                pipe.train_step(x, y)
            peaks.append(mem.peak)
        times: list[list[float]] = [[], []]
        for _ in range(args.steps):
            for i, pipe in enumerate(pipes):
                times[i].append(_step(pipe, x, y))
        medians = [statistics.median(t) for t in times]
        rows.append((name, ctx.pp_rank, *peaks, *medians))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if ctx.rank != 0:
        return
    print(
        f"GPT width {WIDTH}, depth {DEPTH}, context {CONTEXT}, batch {BATCH} in "
        f"{MICROBATCHES} micro-batches, {PROCS} processes"
        + (", autocast bfloat16" if args.autocast else "")
    )
    print(
        "| schedule | rank | peak MiB | peak MiB, recompute | saved | step ms | "
        "step ms, recompute | time ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    mib = 2.0**20
    for row in sorted((r for part in gathered for r in part), key=lambda r: r[:2]):
        name, rank, without, with_, t0, t1 = row
        print(
            f"| {name} | {rank} | {without / mib:.1f} | {with_ / mib:.1f} | "
            f"{1 - with_ / without:.0%} | {t0 * 1e3:.0f} | {t1 * 1e3:.0f} | {t1 / t0:.2f} |"
        )


def main(argv: list[str] | None = None) -> int:
    """Parse flags; outside torchrun, launch this script in 2 processes."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="timed steps per pipeline")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--autocast", action="store_true", help="both pipelines under bfloat16")
    args = p.parse_args(argv)
    unknown = set(args.schedules.split(",")) - set(SCHEDULES)
    if unknown:
        p.error(f"unknown schedules {sorted(unknown)}; choose from {', '.join(SCHEDULES)}")
    return run_on_processes(__file__, PROCS, argv, worker, args)


if __name__ == "__main__":
    raise SystemExit(main())
