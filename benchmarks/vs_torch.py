"""conveyor against ``torch.distributed.pipelining`` on CPU, and against one process.

The model: 8 x (Linear(1024, 1024), ReLU) as one seeded ``nn.Sequential`` of 16 modules
(``--width`` sets the 1024);
batch 64 in 8 micro-batches, MSE loss, SGD; 2 processes on gloo, one thread each. Both
libraries get the same stages (equal contiguous slices, placed as conveyor's schedule
places them) and run in the same processes, alternated round by round so drift hits both
alike; warm-up steps are discarded. The single-process baseline (plain gradient
accumulation over the same 8 micro-batches) runs on rank 0 in its own phase of every round
while rank 1 waits idle in a barrier.

    python benchmarks/vs_torch.py [--steps 10] [--rounds 5] [--warmup 2] [--json FILE]
    python benchmarks/vs_torch.py --width 128   # tiny stages: the runtime's cost per action
    python benchmarks/vs_torch.py --model gpt2     # a transformers GPT-2 instead

Prints a markdown table: median step time of each library, their ratio, conveyor's
speed-up over one process, and the ideal speed-up p * (1 - bubble), with the bubble
simulated by ``conveyor.simulate`` from each stage's action times conveyor measured.
To add a schedule (e.g. a zero-bubble one), add a row to ``ROWS``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from common import alternate, run_on_processes

import conveyor
from conveyor.observe.trace import measured_costs
from conveyor.runtime.timing import Timing
from conveyor.simulate import simulate

LAYERS, WIDTH, BATCH, MICROBATCHES, PROCS = 8, 1024, 64, 8, 2


class Row(NamedTuple):
    """One benchmark row: a conveyor schedule and torch's nearest counterpart.

    ``torch_chunks`` is how many stages per rank torch's schedule runs (its zero-bubble
    schedules need 2 even where ours need 1).
    """

    schedule: str
    chunks: int
    torch_schedule: str | None  # a class in torch.distributed.pipelining, None if it has none
    torch_chunks: int = 1


ROWS = [
    Row("gpipe", 1, "ScheduleGPipe"),
    Row("1f1b", 1, "Schedule1F1B"),
    Row("interleaved-1f1b", 2, "ScheduleInterleaved1F1B", 2),
    Row("looped-bfs", 2, "ScheduleLoopedBFS", 2),
    Row("zb-h1", 1, "ScheduleInterleavedZeroBubble", 2),
    Row("zb-h2", 1, None),
    Row("zb-late", 1, None),
    Row("zbv", 2, "ScheduleZBVZeroBubble", 2),
    Row("dualpipev", 2, "ScheduleDualPipeV", 2),
    # The controllable-memory V schedules: torch has neither. At 2 processes their
    # formulas, (p+2)//2 and (p+4)//3, give 2 micro-batches, 1F1B's own peak.
    Row("v-half", 2, None),
    Row("v-min", 2, None),
]
V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def build_model(width: int = WIDTH) -> nn.Sequential:
    """The benchmark model, identical on every call and every rank."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


Step = Callable[[], None]


def single_process(x: Tensor, y: Tensor) -> Step:
    """The baseline: the whole model in this process, gradient accumulation over micro-batches."""
    model = build_model(x.shape[-1])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
            loss = nn.functional.mse_loss(model(xm), ym) / MICROBATCHES
            loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()

    return step


def conveyor_pipeline(row: Row, width: int, track_memory: bool = False) -> conveyor.Pipeline:
    """``row``'s conveyor pipeline on equal slices of the benchmark model."""
    stages = PROCS * row.chunks
    return conveyor.Pipeline(
        build_model(width),
        loss_fn=nn.functional.mse_loss,
        microbatches=MICROBATCHES,
        schedule=row.schedule,
        chunks=row.chunks,
        balance=[2 * LAYERS // stages] * stages,
        track_memory=track_memory,
    )


class Split(NamedTuple):
    """Where one rank's step went, in seconds: computing actions, waiting for the other
    rank's output, after its last action until ``train_step`` returned (the schedule's
    tail plus the loss broadcast), the runtime's own work between actions, and the
    optimizer step."""

    compute: float
    wait: float
    tail: float
    runtime: float
    optimizer: float


def conveyor_step(
    row: Row, x: Tensor, y: Tensor, timings: list[Timing], splits: list[Split]
) -> tuple[Step, conveyor.Pipeline]:
    """One conveyor training step for ``row`` that adds its action timings to ``timings``
    and where its time went to ``splits``, and the Pipeline."""
    pipe = conveyor_pipeline(row, x.shape[-1])
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)

    def step() -> None:
        t0 = time.perf_counter()
        pipe.train_step(x, y)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        done = pipe.last_step_timings()
        timings.extend(done)
        busy = sum(end - start for *_, start, end in done)
        wait = sum(end - start for *_, start, end in pipe.last_step_waits())
        # Action times count from the engine's start, just after the step began.
        tail = (t1 - t0) - max(end for *_, end in done)
        splits.append(Split(busy, wait, tail, (t1 - t0) - busy - wait - tail, t2 - t1))

    return step, pipe


def activation_memory(row: Row, x: Tensor, y: Tensor) -> tuple[int, int]:
    """(measured, simulated) peak activation bytes on this rank in a tracked step."""
    pipe = conveyor_pipeline(row, x.shape[-1], track_memory=True)
    for _ in range(2):  # the second step has .grad already, like the timed ones
        pipe.train_step(x, y)
    report = pipe.last_step_memory()
    return report.peak, report.simulated_peak


def torch_step(row: Row, x: Tensor, y: Tensor) -> tuple[Step, nn.Module]:
    """One ``torch.distributed.pipelining`` training step of ``row``'s torch schedule on
    equal slices of the same model, and the model whose slices it trains."""
    from torch.distributed import pipelining

    assert row.torch_schedule is not None
    model = build_model(x.shape[-1])
    rank, stages = dist.get_rank(), PROCS * row.torch_chunks
    size = len(model) // stages
    if row.torch_schedule in V_SCHEDULES:
        mine = [rank, 2 * PROCS - 1 - rank]
    else:
        mine = [s for s in range(stages) if s % PROCS == rank]
    held = [
        pipelining.PipelineStage(model[s * size : (s + 1) * size], s, stages, torch.device("cpu"))
        for s in mine
    ]
    cls = getattr(pipelining, row.torch_schedule)
    schedule = cls(held[0] if row.torch_chunks == 1 else held, MICROBATCHES, nn.functional.mse_loss)
    opt = torch.optim.SGD([p for h in held for p in h.submod.parameters()], lr=1e-3)
    first, last = 0 in mine, stages - 1 in mine

    def step() -> None:
        losses: list[Tensor] = []
        args = (x,) if first else ()
        schedule.step(*args, target=y if last else None, losses=losses, return_outputs=False)
        opt.step()
        opt.zero_grad()

    return step, model


def timed(step: Step, steps: int, warmup: int, sync: bool = True) -> list[float]:
    """Seconds per step after ``warmup`` untimed steps; with ``sync``, each ends at a barrier."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if sync:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        if sync:
            dist.barrier()
        times.append(time.perf_counter() - t0)
    return times


def stage_costs(timings: list[Timing], stages: int) -> list[tuple[float, float, float]]:
    """Each stage's mean F, B, W action times (seconds) over this and the other ranks'
    ``timings``."""
    parts: list[list[Timing]] = [[] for _ in range(PROCS)]
    dist.all_gather_object(parts, timings)
    return measured_costs([t for part in parts for t in part], stages)


def worker(args: argparse.Namespace) -> None:
    """Runs in each of the 2 processes: build everything, then alternate the runs."""
    if args.model == "gpt2":
        from vs_torch_hf import worker as gpt2_worker

        gpt2_worker(args, timed)
        return
    if args.model == "llama-tp":
        from vs_torch_tp import worker as tp_worker

        tp_worker(args, timed)
        return
    torch.set_num_threads(1)
    conveyor.init()
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    width = args.width
    x, y = torch.randn(BATCH, width, generator=gen), torch.randn(BATCH, width, generator=gen)

    runs: dict[tuple[str, str], Step] = {}
    pipes: dict[str, conveyor.Pipeline] = {}
    rows = [r for r in ROWS if not args.schedules or r.schedule in args.schedules.split(",")]
    if not any(r.schedule == "1f1b" for r in rows):
        rows.insert(0, ROWS[1])  # every ratio is also taken against torch's 1F1B
    timings: dict[str, list[Timing]] = {row.schedule: [] for row in rows}
    splits: dict[str, list[Split]] = {row.schedule: [] for row in rows}
    mismatch = 0.0  # largest weight difference after one step of each library
    for row in rows:
        runs[("conveyor", row.schedule)], pipe = conveyor_step(
            row, x, y, timings[row.schedule], splits[row.schedule]
        )
        pipes[row.schedule] = pipe
        if row.torch_schedule is not None:
            step, model = torch_step(row, x, y)
            runs[("torch", row.schedule)] = step
            runs[("conveyor", row.schedule)]()
            step()
            torch_params = dict(model.named_parameters())
            for name, p in pipe.named_parameters():
                mismatch = max(mismatch, (p - torch_params[name]).abs().max().item())
    mismatches: list[float] = [0.0] * PROCS
    dist.all_gather_object(mismatches, mismatch)
    baseline = single_process(x, y) if rank == 0 else None

    times, one_process = alternate(runs, baseline, args.rounds, timed, args.steps, args.warmup)
    # Replay each schedule in simulated time with the stage costs conveyor measured.
    costs = {name: stage_costs(timings[name], pipes[name].schedule.stages) for name in pipes}
    bubbles = {
        name: simulate(pipes[name].schedule, cost=cost, comm=0.0).bubble
        for name, cost in costs.items()
    }
    # Medians over the timed steps of each rank: compute / wait / other milliseconds.
    mine = {
        name: Split(*(statistics.median(getattr(s, f) for s in part) for f in Split._fields))
        for name, part in splits.items()
    }
    split_parts: list[dict[str, Split]] = [{}] * PROCS
    dist.all_gather_object(split_parts, mine)
    memory_parts: list[dict[str, tuple[int, int]]] = [{}] * PROCS
    dist.all_gather_object(
        memory_parts, {row.schedule: activation_memory(row, x, y) for row in rows}
    )
    if rank != 0:
        return

    base = statistics.median(one_process)
    print(
        f"\n{LAYERS} x Linear({width}, {width}) + ReLU, batch {BATCH}, {MICROBATCHES} "
        f"micro-batches, {PROCS} processes x 1 thread, gloo; median of {args.rounds} rounds "
        f"x {args.steps} steps; one process: {base * 1e3:.1f} ms/step; after one step, "
        f"conveyor's and torch's weights differ by at most {max(mismatches):.1e}\n"
    )
    torch_1f1b = statistics.median(times[("torch", "1f1b")])
    print(
        "| conveyor schedule | conveyor ms | torch schedule | torch ms | conveyor/torch "
        "| conveyor/torch 1F1B | speed-up vs 1 process | ideal speed-up |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    results = []
    for row in rows:
        ours = statistics.median(times[("conveyor", row.schedule)])
        theirs = times.get(("torch", row.schedule))
        torch_s = statistics.median(theirs) if theirs else None
        bubble = bubbles[row.schedule]
        name = row.schedule + (f" (chunks={row.chunks})" if row.chunks > 1 else "")
        torch_name = (
            "—"
            if row.torch_schedule is None
            else (
                row.torch_schedule
                + (f" ({row.torch_chunks} stages/rank)" if row.torch_chunks > 1 else "")
            )
        )
        print(
            f"| {name} | {ours * 1e3:.1f} | {torch_name} | "
            + ("— | — |" if torch_s is None else f"{torch_s * 1e3:.1f} | {ours / torch_s:.2f} |")
            + f" {ours / torch_1f1b:.2f} | {base / ours:.2f} | {PROCS * (1 - bubble):.2f} |"
        )
        results.append(
            {
                "schedule": row.schedule,
                "chunks": row.chunks,
                "torch_schedule": row.torch_schedule,
                "torch_chunks": row.torch_chunks,
                "conveyor_ms": ours * 1e3,
                "torch_ms": None if torch_s is None else torch_s * 1e3,
                "ratio": None if torch_s is None else ours / torch_s,
                "ratio_to_torch_1f1b": ours / torch_1f1b,
                "speedup": base / ours,
                "ideal_speedup": PROCS * (1 - bubble),
                "simulated_bubble": bubble,
                "stage_costs_ms": [[c * 1e3 for c in cost] for cost in costs[row.schedule]],
            }
        )
    print(
        "\nWhere each rank's step goes (medians, ms: compute / waiting for the other rank / "
        "after its last action / runtime between actions / optimizer step), and peak "
        "activation memory (KiB per rank: measured in a step / the schedule's memory model "
        "with the measured sizes):\n"
    )
    print(
        "| conveyor schedule | "
        + " | ".join(f"rank {r} ms" for r in range(PROCS))
        + " | "
        + " | ".join(f"rank {r} KiB" for r in range(PROCS))
        + " |"
    )
    print("|---|" + "---:|" * (2 * PROCS))
    for row in rows:
        times_ms = [
            " / ".join(f"{v * 1e3:.1f}" for v in part[row.schedule]) for part in split_parts
        ]
        memory = [
            f"{part[row.schedule][0] / 1024:.0f} / {part[row.schedule][1] / 1024:.0f}"
            for part in memory_parts
        ]
        print(f"| {row.schedule} | " + " | ".join(times_ms + memory) + " |")
        results[[r["schedule"] for r in results].index(row.schedule)].update(
            split_ms=[[v * 1e3 for v in part[row.schedule]] for part in split_parts],
            activation_bytes_measured=[part[row.schedule][0] for part in memory_parts],
            activation_bytes_simulated=[part[row.schedule][1] for part in memory_parts],
        )
    if args.json:
        report = {
            "model": f"{LAYERS}x Linear({width},{width})+ReLU",
            "batch": BATCH,
            "microbatches": MICROBATCHES,
            "processes": PROCS,
            "threads": 1,
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "torch": torch.__version__,
            "one_process_ms": base * 1e3,
            "max_weight_difference_after_one_step": max(mismatches),
            "rows": results,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    """Parse flags; outside torchrun, launch this script in 2 processes."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per run per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each run")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--width", type=int, default=WIDTH, help="the Linear layers' width")
    p.add_argument("--schedules", help="comma-separated conveyor schedules to run (default all)")
    p.add_argument(
        "--model",
        choices=["linear", "gpt2", "llama-tp"],
        default="linear",
        help="the Linear stack, a transformers GPT-2 (benchmarks/vs_torch_hf.py), or a "
        "transformers Llama on pp 2 x tp 2 (benchmarks/vs_torch_tp.py, 4 processes)",
    )
    args = p.parse_args(argv)
    procs = 4 if args.model == "llama-tp" else PROCS
    return run_on_processes(__file__, procs, argv, worker, args)


if __name__ == "__main__":
    raise SystemExit(main())
