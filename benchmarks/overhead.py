"""What conveyor costs on top of the work: a one-stage pipeline against a plain
gradient-accumulation loop, and generating + validating a large schedule.

One process, one thread, with the glibc malloc tunables ``conveyor launch`` sets (the
script restarts itself with them). The model and batch are ``vs_torch.py``'s (8 x
Linear(1024) + ReLU, batch 64 in 8 micro-batches, MSE, SGD). The plain loop and
``Pipeline`` with one stage (``conveyor.init(pp=1)``) train the same model on the same
data, alternated round by round; warm-up steps are discarded. Then each schedule is
generated and validated for p=64 ranks and m=512 micro-batches (``get_schedule``
validates what it builds).

    python benchmarks/overhead.py [--steps 20] [--rounds 5] [--warmup 3] [--json FILE]
    python benchmarks/overhead.py --width 128   # tiny layers: the runtime's cost per action
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from vs_torch import BATCH, LAYERS, MICROBATCHES, WIDTH, build_model, single_process

import conveyor
from conveyor.cli.launch import MALLOC_TUNABLES
from conveyor.schedules.registry import SCHEDULE_NAMES, get_schedule

BIG_RANKS, BIG_MICROBATCHES = 64, 512
Step = Callable[[], None]


def one_stage(x: torch.Tensor, y: torch.Tensor) -> Step:
    """The same training through a one-stage ``Pipeline``."""
    pipe = conveyor.Pipeline(
        build_model(x.shape[-1]),
        loss_fn=nn.functional.mse_loss,
        microbatches=MICROBATCHES,
        schedule="1f1b",
        context=conveyor.init(pp=1),
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)

    def step() -> None:
        pipe.train_step(x, y)
        opt.step()
        opt.zero_grad()

    return step


def timed(step: Step, steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` steps after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def schedule_times() -> dict[str, float]:
    """Seconds to generate and validate each named schedule at p=64, m=512."""
    out = {}
    for name in SCHEDULE_NAMES:
        t0 = time.perf_counter()
        get_schedule(name, BIG_RANKS, BIG_MICROBATCHES)  # each at its default chunks
        out[name] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    """Run both measurements and print them as markdown tables."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per run per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each run")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--width", type=int, default=WIDTH, help="the Linear layers' width")
    args = p.parse_args(argv)
    if any(name not in os.environ for name in (*MALLOC_TUNABLES, "OMP_NUM_THREADS")):
        # As `conveyor launch` runs workers: glibc reads these at start, so start again.
        env = {name: str(1 << 30) for name in MALLOC_TUNABLES} | {"OMP_NUM_THREADS": "1"}
        env |= os.environ
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    width = args.width
    x, y = torch.randn(BATCH, width, generator=gen), torch.randn(BATCH, width, generator=gen)
    runs = {"plain loop": single_process(x, y), "one-stage Pipeline": one_stage(x, y)}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.rounds):
        for key in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            times[key] += timed(runs[key], args.steps, args.warmup)
    plain = statistics.median(times["plain loop"])
    ours = statistics.median(times["one-stage Pipeline"])
    print(
        f"\n{LAYERS} x Linear({width}) + ReLU, batch {BATCH}, {MICROBATCHES} micro-batches, "
        f"1 process x 1 thread; median of {args.rounds} rounds x {args.steps} steps\n"
    )
    print("| run | ms/step | vs plain loop |\n|---|---:|---:|")
    print(f"| plain gradient accumulation | {plain * 1e3:.2f} | 1.000 |")
    print(f"| one-stage Pipeline (1f1b) | {ours * 1e3:.2f} | {ours / plain:.3f} |")
    per_action = (ours - plain) / (2 * MICROBATCHES)  # an F and a B per micro-batch
    print(f"\nconveyor's own cost: {per_action * 1e6:.1f} µs per action")
    gen_times = schedule_times()
    print(f"\nGenerate + validate, p={BIG_RANKS}, m={BIG_MICROBATCHES}:\n")
    print("| schedule | seconds |\n|---|---:|")
    for name, seconds in gen_times.items():
        print(f"| {name} | {seconds:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "plain_ms": plain * 1e3,
                    "one_stage_ms": ours * 1e3,
                    "overhead": ours / plain - 1,
                    "width": width,
                    "us_per_action": per_action * 1e6,
                    "schedule_seconds": gen_times,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
