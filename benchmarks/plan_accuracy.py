"""How well ``conveyor.plan`` predicts a real step, and whether time balance beats
parameter balance, on 2 processes (gloo, one thread each).

Models: the benchmark model of ``vs_torch.py`` (8 x Linear(1024) + ReLU, batch 64, MSE)
and an unbalanced one (widths 256 -> 2048 -> 256 -> 64 with GELUs and a wide LayerNorm, whose
parameter counts say little about their time). For each: plan on both ranks, run the
chosen configuration, and print predicted vs measured median step (no optimizer step; the
planner does not count it). For the unbalanced model the same schedule also runs with the
parameter-balanced split (``balance=None``).

    python benchmarks/plan_accuracy.py [--steps 10] [--rounds 3] [--warmup 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
import conveyor
from conveyor.launch import main as launch
from conveyor.plan import Plan, plan
from conveyor.simulate import simulate
from conveyor.trace import Timing, measured_costs

BATCH, PROCS = 64, 2
TIMINGS: list[Timing] = []  # action timings of the planned runs, for the replay


def benchmark_model() -> tuple[nn.Sequential, int, int]:
    """8 x (Linear(1024), ReLU), input and output width."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers), 1024, 1024


def unbalanced_model() -> tuple[nn.Sequential, int, int]:
    """Very different widths; the parameter-free GELU / LayerNorm on 4096 features cost time
    that a parameter count does not see."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [
        nn.Linear(256, 2048),
        nn.ReLU(),
        nn.Linear(2048, 2048),
        nn.ReLU(),
        nn.Linear(2048, 256),
        nn.ReLU(),
        nn.Linear(256, 4096),
        nn.GELU(),
        nn.LayerNorm(4096, elementwise_affine=False),
        nn.GELU(),
        nn.LayerNorm(4096, elementwise_affine=False),
        nn.GELU(),
        nn.Linear(4096, 64),
        nn.ReLU(),
        nn.Linear(64, 64),
    ]
    return nn.Sequential(*layers), 256, 64


def median_step(step: Callable[[], None], steps: int, warmup: int) -> float:
    """Median seconds of ``step`` between barriers, after ``warmup`` untimed steps."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pipeline_step(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    microbatches: int,
    schedule: object,
    chunks: int,
    balance: list[int] | None,
) -> Callable[[], None]:
    """One training step (gradients cleared after; no optimizer step)."""
    pipe = conveyor.Pipeline(
        model,
        loss_fn=nn.functional.mse_loss,
        microbatches=microbatches,
        schedule=schedule,
        chunks=chunks,
        balance=balance,  # type: ignore[arg-type]
    )

    def step() -> None:
        pipe.train_step(x, y)
        for p in pipe.parameters():
            p.grad = None
        TIMINGS.extend(pipe.last_step_timings())

    return step


def chosen_costs(chosen: Plan) -> list[tuple[float, float, float]]:
    """The per-stage (F, B, W) the planner predicted for its choice."""
    assert chosen.profile is not None
    return chosen.profile.costs(chosen.balance, chosen.built.split_backward)


def worker(args: argparse.Namespace) -> None:
    """Each of the 2 processes: plan, then measure."""
    torch.set_num_threads(1)
    conveyor.init()
    rank = dist.get_rank()
    for label, build in (("benchmark", benchmark_model), ("unbalanced", unbalanced_model)):
        model, width_in, width_out = build()
        gen = torch.Generator().manual_seed(1)
        x, y = (
            torch.randn(BATCH, width_in, generator=gen),
            torch.randn(BATCH, width_out, generator=gen),
        )
        t0 = time.perf_counter()
        chosen = plan(model, x, y, nn.functional.mse_loss, PROCS)
        took = time.perf_counter() - t0
        runs = {
            "planned": pipeline_step(
                model, x, y, chosen.microbatches, chosen.built, chosen.chunks, chosen.balance
            )
        }
        if label == "unbalanced":
            runs["parameter-balanced"] = pipeline_step(
                model, x, y, chosen.microbatches, chosen.built, chosen.chunks, None
            )
        measured: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.rounds):
            for key in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                TIMINGS.clear()
                measured[key].append(median_step(runs[key], args.steps, args.warmup))
                if key == "planned":
                    planned_timings = list(TIMINGS)
        # Replay the planned run with the action times it really took: tells a wrong cost
        # (profile) from a wrong model of the step (overheads, waits).
        parts: list[list[Timing]] = [[] for _ in range(PROCS)]
        dist.all_gather_object(parts, planned_timings)
        real = measured_costs([t for part in parts for t in part], chosen.built.stages)
        replay = simulate(chosen.built, real).makespan
        if rank != 0:
            continue
        got = statistics.median(measured["planned"])
        print(
            f"\n## {label}: planned in {took:.1f} s: {chosen.schedule} chunks={chosen.chunks} "
            f"microbatches={chosen.microbatches} balance={chosen.balance}"
        )
        print(
            f"predicted {chosen.predicted_step * 1e3:.2f} ms, measured {got * 1e3:.2f} ms, "
            f"measured/predicted {got / chosen.predicted_step:.3f}"
        )
        print(
            f"replayed with measured action times: {replay * 1e3:.2f} ms; "
            f"stage costs predicted/measured (ms): "
            f"{[[round(c * 1e3, 2) for c in st] for st in chosen_costs(chosen)]} / "
            f"{[[round(c * 1e3, 2) for c in st] for st in real]}"
        )
        if "parameter-balanced" in measured:
            other = statistics.median(measured["parameter-balanced"])
            print(
                f"parameter-balanced split, same schedule: {other * 1e3:.2f} ms "
                f"(time-balanced is {other / got:.2f}x faster)"
            )
        print("\n" + "\n".join(chosen.table().splitlines()[:8]))


def main(argv: list[str] | None = None) -> int:
    """Parse flags; outside torchrun, launch this script in 2 processes."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        return launch(["--nproc-per-node", str(PROCS), os.path.abspath(__file__), *argv])
    worker(args)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
