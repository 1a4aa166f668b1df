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
    python benchmarks/vs_torch.py --schedules --rounds 5   # the zero-bubble schedules only
    python benchmarks/vs_torch.py --schedules 1f1b,zb-h1   # these conveyor schedules only
    python benchmarks/vs_torch.py --width 128   # tiny stages: the runtime's cost per action
    python benchmarks/vs_torch.py --model gpt2     # a transformers GPT-2 instead

Prints a markdown table: median step time of each library, their ratio, conveyor's
speed-up over one process, and the ideal speed-up p * (1 - bubble), with the bubble
simulated by ``conveyor.simulate`` from each stage's action times conveyor measured.
To add a schedule (e.g. a zero-bubble one), add a row to ``ROWS``.

``--schedules`` alone runs the zero-bubble side by side (``ZERO_BUBBLE``): conveyor's
``zb-h1``, ``zbv`` and ``dualpipev`` against torch's ``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``, and conveyor's ``zb-auto`` fitted to
the stage costs it measured in this run (a cap of p micro-batches, zb-h1's memory; one
stage per rank and its V of 2), plus the 1F1B pair.
Both libraries' activation memory is measured in a step with the same meter (what autograd
saves, held until it is freed), and the closing lines compare each library's fastest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from common import alternate, run_on_processes

import conveyor
from conveyor.observe.trace import measured_costs
from conveyor.runtime.memory import ActivationMeter
from conveyor.runtime.timing import Timing
from conveyor.schedules import Schedule, zero_bubble_auto
from conveyor.simulate import peak_activations, simulate

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

    @property
    def name(self) -> str:
        """The row's label, and its key in every table: the schedule and its chunks."""
        return self.schedule + (f" (chunks={self.chunks})" if self.chunks > 1 else "")


ROWS = [
    Row("gpipe", 1, "ScheduleGPipe"),
    Row("1f1b", 1, "Schedule1F1B"),
    Row("interleaved-1f1b", 2, "ScheduleInterleaved1F1B", 2),
    Row("looped-bfs", 2, "ScheduleLoopedBFS", 2),
    Row("zb-h1", 1, "ScheduleInterleavedZeroBubble", 2),
    # Fitted in the run to the stage costs conveyor measured, under zb-h1's memory cap.
    Row("zb-auto", 1, None),
    Row("zb-h2", 1, None),
    Row("zb-late", 1, None),
    Row("zbv", 2, "ScheduleZBVZeroBubble", 2),
    Row("zb-auto", 2, None),  # its V, fitted the same way under zbv's memory
    Row("dualpipev", 2, "ScheduleDualPipeV", 2),
    # The controllable-memory V schedules: torch has neither. At 2 processes their
    # formulas, (p+2)//2 and (p+4)//3, give 2 micro-batches, 1F1B's own peak.
    Row("v-half", 2, None),
    Row("v-min", 2, None),
]
V_SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
# What ``--schedules`` alone runs: the zero-bubble side by side (1F1B is always added).
ZERO_BUBBLE = ("zb-h1", "zb-auto", "zbv", "dualpipev")
TORCH_ZERO_BUBBLE = (
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)


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


def conveyor_pipeline(
    row: Row, width: int, track_memory: bool = False, schedule: Schedule | None = None
) -> conveyor.Pipeline:
    """``row``'s conveyor pipeline on equal slices of the benchmark model (``schedule``:
    a built schedule to run instead of ``row.schedule``'s registry one)."""
    stages = PROCS * row.chunks
    return conveyor.Pipeline(
        build_model(width),
        loss_fn=nn.functional.mse_loss,
        microbatches=MICROBATCHES,
        schedule=row.schedule if schedule is None else schedule,
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
    row: Row,
    x: Tensor,
    y: Tensor,
    timings: list[Timing],
    splits: list[Split],
    schedule: Schedule | None = None,
) -> tuple[Step, conveyor.Pipeline]:
    """One conveyor training step for ``row`` (``schedule``: built for it) that adds its
    action timings to ``timings`` and where its time went to ``splits``, and the
    Pipeline."""
    pipe = conveyor_pipeline(row, x.shape[-1], schedule=schedule)
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


def fitted_zb_auto(row: Row, x: Tensor, y: Tensor, steps: int = 3) -> Schedule:
    """``zero_bubble_auto`` fitted to the per-stage (F, B, W) times conveyor measures on
    this model (over ``steps`` steps of zb-h1, or of zbv for 2 chunks), capped at p
    micro-batches (zb-h1's and zbv's memory); the same on every rank (the costs are
    gathered from all of them). Collective."""
    probe = Row("zb-h1" if row.chunks == 1 else "zbv", row.chunks, None)
    pipe = conveyor_pipeline(probe, x.shape[-1])
    pipe.train_step(x, y)  # warm-up, not counted
    timings: list[Timing] = []
    for _ in range(steps):
        pipe.train_step(x, y)
        timings.extend(pipe.last_step_timings())
    costs = stage_costs(timings, pipe.schedule.stages)
    return zero_bubble_auto(PROCS, MICROBATCHES, costs, microbatch_cap=PROCS, chunks=row.chunks)


def activation_memory(
    row: Row, x: Tensor, y: Tensor, schedule: Schedule | None = None
) -> tuple[int, int]:
    """(measured, simulated) peak activation bytes on this rank in a tracked step."""
    pipe = conveyor_pipeline(row, x.shape[-1], track_memory=True, schedule=schedule)
    for _ in range(2):  # the second step has .grad already, like the timed ones
        pipe.train_step(x, y)
    report = pipe.last_step_memory()
    return report.peak, report.simulated_peak


def torch_step(row: Row, x: Tensor, y: Tensor) -> tuple[Step, nn.Module, Callable[[], int]]:
    """One ``torch.distributed.pipelining`` training step of ``row``'s torch schedule on
    equal slices of the same model, the model whose slices it trains, and a function that
    runs one more step measuring this rank's peak activation bytes (conveyor's meter:
    what autograd saves, from F until it is freed)."""
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

    def memory() -> int:
        meter = ActivationMeter(p for h in held for p in h.submod.parameters())
        with meter.hooks():
            step()
        return meter.peak

    return step, model, memory


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
    chosen = ZERO_BUBBLE if args.schedules == "" else (args.schedules or "").split(",")
    rows = [r for r in ROWS if args.schedules is None or r.schedule in chosen]
    if not any(r.schedule == "1f1b" for r in rows):
        rows.insert(0, ROWS[1])  # every ratio is also taken against torch's 1F1B
    built = {r.name: fitted_zb_auto(r, x, y) for r in rows if r.schedule == "zb-auto"}
    timings: dict[str, list[Timing]] = {row.name: [] for row in rows}
    splits: dict[str, list[Split]] = {row.name: [] for row in rows}
    torch_memory: dict[str, Callable[[], int]] = {}
    mismatch = 0.0  # largest weight difference after one step of each library
    for row in rows:
        runs[("conveyor", row.name)], pipe = conveyor_step(
            row, x, y, timings[row.name], splits[row.name], built.get(row.name)
        )
        pipes[row.name] = pipe
        if row.torch_schedule is not None:
            step, model, torch_memory[row.name] = torch_step(row, x, y)
            runs[("torch", row.name)] = step
            runs[("conveyor", row.name)]()
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
        memory_parts,
        {row.name: activation_memory(row, x, y, built.get(row.name)) for row in rows},
    )
    torch_memory_parts: list[dict[str, int]] = [{}] * PROCS
    dist.all_gather_object(
        torch_memory_parts, {name: measure() for name, measure in torch_memory.items()}
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
        ours = statistics.median(times[("conveyor", row.name)])
        theirs = times.get(("torch", row.name))
        torch_s = statistics.median(theirs) if theirs else None
        bubble = bubbles[row.name]
        name = row.name
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
                "conveyor_round_ms": per_round(times[("conveyor", row.name)], args.rounds),
                "torch_round_ms": None if not theirs else per_round(theirs, args.rounds),
                "ratio": None if torch_s is None else ours / torch_s,
                "ratio_to_torch_1f1b": ours / torch_1f1b,
                "speedup": base / ours,
                "ideal_speedup": PROCS * (1 - bubble),
                "simulated_bubble": bubble,
                "stage_costs_ms": [[c * 1e3 for c in cost] for cost in costs[row.name]],
                "peak_microbatches": list(peak_activations(pipes[row.name].schedule)),
                "split_backward": pipes[row.name].schedule.split_backward,
            }
        )
    print(
        "\nWhere each rank's step goes (medians, ms: compute / waiting for the other rank / "
        "after its last action / runtime between actions / optimizer step), and peak "
        "activation memory (KiB per rank: conveyor's measured in a step / its schedule's "
        "memory model with the measured sizes; torch's measured with the same meter):\n"
    )
    print(
        "| conveyor schedule | "
        + " | ".join(f"rank {r} ms" for r in range(PROCS))
        + " | "
        + " | ".join(f"rank {r} KiB" for r in range(PROCS))
        + " | torch KiB per rank |"
    )
    print("|---|" + "---:|" * (2 * PROCS + 1))
    for result, row in zip(results, rows, strict=True):
        times_ms = [" / ".join(f"{v * 1e3:.1f}" for v in part[row.name]) for part in split_parts]
        memory = [
            f"{part[row.name][0] / 1024:.0f} / {part[row.name][1] / 1024:.0f}"
            for part in memory_parts
        ]
        theirs_kib = (
            " / ".join(f"{part[row.name] / 1024:.0f}" for part in torch_memory_parts)
            if row.name in torch_memory_parts[0]
            else "—"
        )
        print(f"| {row.name} | " + " | ".join([*times_ms, *memory, theirs_kib]) + " |")
        result.update(
            split_ms=[[v * 1e3 for v in part[row.name]] for part in split_parts],
            activation_bytes_measured=[part[row.name][0] for part in memory_parts],
            activation_bytes_simulated=[part[row.name][1] for part in memory_parts],
            torch_activation_bytes=(
                [part[row.name] for part in torch_memory_parts]
                if row.name in torch_memory_parts[0]
                else None
            ),
        )
    summary = fastest(results)
    print("\n" + summary_line(summary))
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
            "fastest": summary,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def per_round(seconds: list[float], rounds: int) -> list[float]:
    """The median milliseconds of each round's steps (``seconds`` holds them round by
    round, the same number per round)."""
    n = len(seconds) // rounds
    return [statistics.median(seconds[r * n : (r + 1) * n]) * 1e3 for r in range(rounds)]


def fastest(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each library's fastest run among ``results`` (the JSON rows): torch's over its
    zero-bubble schedules and over all it ran, conveyor's over its split-backward rows and
    over those needing no more activation memory (the larger rank's, measured) than
    torch's fastest; each with its milliseconds and that memory, and the ratios: of the
    medians over all rounds, and (``... per round``) of each round's medians, the two runs
    measured minutes apart at most, so that the machine's drift cancels."""

    def most(r: dict[str, Any], key: str) -> int:
        return int(max(r[key]))

    def pick(rows: list[dict[str, Any]], ms: str, memory: str, name: str) -> dict[str, Any]:
        if not rows:
            return {}
        best = min(rows, key=lambda r: r[ms])
        rounds = best[ms.replace("_ms", "_round_ms")]
        return {"name": best[name], "ms": best[ms], "activation_bytes": most(best, memory),
                "round_ms": rounds}  # fmt: skip

    def label(r: dict[str, Any]) -> str:
        return str(r["schedule"]) + (f" (chunks={r['chunks']})" if r["chunks"] > 1 else "")

    for r in results:
        r["name"] = label(r)
    ran = [r for r in results if r["torch_ms"] is not None]
    torch_zb = [r for r in ran if r["torch_schedule"] in TORCH_ZERO_BUBBLE]
    ours_zb = [r for r in results if r["split_backward"]]
    out: dict[str, Any] = {
        "torch_zero_bubble": pick(torch_zb, "torch_ms", "torch_activation_bytes", "torch_schedule"),
        "torch_any": pick(ran, "torch_ms", "torch_activation_bytes", "torch_schedule"),
        "conveyor_zero_bubble": pick(ours_zb, "conveyor_ms", "activation_bytes_measured", "name"),
    }
    if out["torch_zero_bubble"]:
        bound = out["torch_zero_bubble"]["activation_bytes"]
        within = [r for r in ours_zb if most(r, "activation_bytes_measured") <= bound]
        out["conveyor_within_memory"] = pick(
            within, "conveyor_ms", "activation_bytes_measured", "name"
        )
    for ours, theirs in (("conveyor_zero_bubble", "torch_zero_bubble"),
                         ("conveyor_within_memory", "torch_zero_bubble"),
                         ("conveyor_zero_bubble", "torch_any")):  # fmt: skip
        if out.get(ours) and out.get(theirs):
            out[f"{ours}/{theirs}"] = out[ours]["ms"] / out[theirs]["ms"]
            pairs = zip(out[ours]["round_ms"], out[theirs]["round_ms"], strict=True)
            out[f"{ours}/{theirs} per round"] = [a / b for a, b in pairs]
    return out


def summary_line(summary: dict[str, Any]) -> str:
    """The closing lines: each library's fastest (:func:`fastest`) and their ratios."""

    def run(key: str) -> str:
        r = summary.get(key)
        if not r:
            return "none ran"
        return f"{r['name']} {r['ms']:.1f} ms ({r['activation_bytes'] / 1024:.0f} KiB)"

    lines = [
        "Fastest (median ms; the larger rank's peak activation memory, measured):",
        f"- conveyor, zero-bubble: {run('conveyor_zero_bubble')}",
        f"- conveyor, zero-bubble within torch's memory: {run('conveyor_within_memory')}",
        f"- torch, zero-bubble: {run('torch_zero_bubble')}",
        f"- torch, any schedule: {run('torch_any')}",
    ]
    for key, value in summary.items():
        if "/" in key and not key.endswith(" per round"):
            rounds = summary[key + " per round"]
            lines.append(
                f"- {key}: {value:.2f} (per round: median {statistics.median(rounds):.2f}, "
                f"{min(rounds):.2f} to {max(rounds):.2f})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse flags; outside torchrun, launch this script in 2 processes."""
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per run per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each run")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--width", type=int, default=WIDTH, help="the Linear layers' width")
    p.add_argument(
        "--schedules",
        nargs="?",
        const="",
        help="comma-separated conveyor schedules to run (default all); alone: the "
        "zero-bubble side by side (" + ", ".join(ZERO_BUBBLE) + ", and 1f1b)",
    )
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
