"""What conveyor costs on top of the work: a one-stage pipeline against a plain
gradient-accumulation loop, generating + validating a large schedule, and the runtime's
efficiency on 2 processes.

One process, one thread, with the glibc malloc tunables ``conveyor launch`` sets (the
script restarts itself with them). The model and batch are ``vs_torch.py``'s (8 x
Linear(1024) + ReLU, batch 64 in 8 micro-batches, MSE, SGD). The plain loop and
``Pipeline`` with one stage (``conveyor.init(pp=1)``) train the same model on the same
data, alternated round by round; warm-up steps are discarded. Then each schedule is
generated and validated for p=64 ranks and m=512 micro-batches (``get_schedule``
validates what it builds).

    python benchmarks/overhead.py [--steps 20] [--rounds 5] [--warmup 3] [--json FILE]
    python benchmarks/overhead.py --width 128   # tiny layers: the runtime's cost per action

``--efficiency``: the runtime against its own bound on 2 processes (gloo, one thread
each), per schedule. Runtime efficiency is the simulated makespan of a step, replayed by
``conveyor.simulate`` from that step's own action times (each stage's median F, B and W
over both ranks' ``pipe.last_step_timings()``, no transfer time), over the step's measured
time (``train_step`` between barriers, the later rank). The gap between the two is split,
on the rank that ends the step, into: compute above the medians, waits beyond the
simulated idle time, posting transfers (``batch_isend_irecv``; "posting CPU" is the part
of it this thread computed, the rest it was blocked in gloo), the step's start and end
(before its first action and after its last: the batch's header, the loss's broadcast,
the last sends), and the rest (Python bookkeeping between actions). Each round runs in
fresh processes; ``--against DIR`` (another revision's tree, e.g. ``git archive REV
conveyor | tar -x -C DIR``) runs that revision's conveyor in alternate rounds. Fresh
processes at different minutes differ by 0.1-0.2 in efficiency on a shared machine, so
``--before`` compares within the same processes instead: each step has a twin that posts
as main 6b64e79 did (no program rule 7, every group's receives before its sends),
alternated step by step.

    python benchmarks/overhead.py --efficiency [--schedules 1f1b,zb-h1,zb-auto,zbv]
        [--rounds 6] [--steps 12] [--before] [--against DIR] [--json FILE]

``--tiny``: tiny stages (8 x Linear(128)) on 2 processes, conveyor's 1F1B step against
``torch.distributed.pipelining``'s ``Schedule1F1B`` in the same processes, alternated, and
what each part of conveyor's step costs (``tiny_stages.py`` says how).

    python benchmarks/overhead.py --tiny [--rounds 6] [--steps 40] [--against DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Run from a checkout; an --efficiency round of --against imports that checkout's conveyor,
# before vs_torch (which puts this checkout first on the path) can import this one's.
sys.path.insert(0, os.environ.get("OVERHEAD_ROOT") or str(Path(__file__).resolve().parents[1]))
import conveyor  # noqa: I001
from vs_torch import BATCH, LAYERS, MICROBATCHES, WIDTH, build_model, single_process

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


EFFICIENCY_SCHEDULES = "1f1b,zb-h1,zb-auto,zbv"
PARTS = ("compute", "waits", "posting", "posting CPU", "start/end", "bookkeeping")


def stage_medians(timings: list[Any], stages: int) -> list[tuple[float, float, float]]:
    """Each stage's median F, B and W duration in ``timings`` (0 for a kind it lacks)."""
    durations: dict[tuple[int, str], list[float]] = {}
    for _, kind, stage, _, start, end in timings:
        durations.setdefault((stage, kind), []).append(end - start)
    return [
        tuple(statistics.median(durations.get((s, k), [0.0])) for k in "FBW")  # type: ignore[misc]
        for s in range(stages)
    ]


def step_record(pipe: conveyor.Pipeline, seconds: float, posting: list[float]) -> dict[str, Any]:
    """This rank's view of the step just run: its time, action timings and waits, and
    ``posting``: seconds in ``batch_isend_irecv``, wall-clock and of this thread's CPU."""
    timings = [tuple(t) for t in pipe.last_step_timings()]
    waits = [tuple(t) for t in pipe.last_step_waits()]
    spans = [(t[4], t[5]) for t in timings + waits]
    return {
        "seconds": seconds,
        "posting": posting[0],
        "posting CPU": posting[1],
        "timings": timings,
        "busy": sum(end - start for *_, start, end in timings),
        "waits": sum(end - start for *_, start, end in waits),
        "span": max(end for _, end in spans) - min(start for start, _ in spans),
    }


def efficiency(pipe: conveyor.Pipeline, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One step's efficiency and the gap's parts on the rank that ended it, in seconds."""
    from conveyor.simulate import simulate

    schedule = pipe.schedule
    everyone = [t for r in ranks for t in r["timings"]]
    costs = stage_medians(everyone, schedule.stages)
    makespan = simulate(schedule, cost=costs, comm=0.0).makespan
    rank = max(range(len(ranks)), key=lambda r: ranks[r]["seconds"])
    mine = ranks[rank]
    # What this rank computes in the simulation: its actions at the stage medians.
    busy = sum(costs[t[2]]["FBW".index(t[1])] for t in mine["timings"])
    ends = mine["seconds"] - mine["span"]
    rest = mine["span"] - mine["busy"] - mine["waits"] - mine["posting"]
    return {
        "efficiency": makespan / mine["seconds"],
        "seconds": mine["seconds"],
        "makespan": makespan,
        "compute": mine["busy"] - busy,
        "waits": mine["waits"] - (makespan - busy),
        "posting": mine["posting"],
        "posting CPU": mine["posting CPU"],  # part of posting; the rest blocked in gloo
        "start/end": ends,
        "bookkeeping": rest,
    }


def efficiency_worker(args: argparse.Namespace) -> None:
    """In each of 2 processes: every schedule's steps, alternated; rank 0 writes each
    step's :func:`efficiency` to ``args.out`` (JSON)."""
    import torch.distributed as dist

    from conveyor.runtime.transport import Transport

    posting = [0.0, 0.0]  # wall-clock, this thread's CPU
    post_now = Transport._post_now

    def timed_post(self: Transport, ops: list[Any]) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return post_now(self, ops)
        finally:
            posting[0] += time.perf_counter() - start
            posting[1] += time.thread_time() - cpu

    Transport._post_now = timed_post  # type: ignore[method-assign]
    torch.set_num_threads(1)
    conveyor.init()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)
    names = args.schedules.split(",")
    pipes = {}
    for name in names:
        chunks = 2 if name in ("zbv", "dualpipev", "v-half", "v-min") else 1
        stages = 2 * chunks
        pipes[name] = conveyor.Pipeline(
            build_model(WIDTH),
            loss_fn=nn.functional.mse_loss,
            microbatches=MICROBATCHES,
            schedule=name,
            chunks=chunks,
            balance=[2 * LAYERS // stages] * stages,
        )
    import conveyor.runtime.program as program

    # --before: each step has a twin that posts as main 6b64e79 did (no program rule 7, a
    # group's receives before its sends), in the same processes, alternated step by step.
    rule7 = getattr(program, "ahead_ranks", None)
    variants = [""] + (["before"] if args.before and rule7 else [])
    out: dict[str, dict[str, list[dict[str, Any]]]] = {v: {n: [] for n in names} for v in variants}
    post = Transport.post

    def receives_first(self: Transport, ops: list[Any]) -> list[Any]:
        order = sorted(range(len(ops)), key=lambda i: ops[i].send)  # stable: receives first
        works = post(self, [ops[i] for i in order])
        back: list[Any] = [None] * len(ops)
        for k, i in enumerate(order):
            back[i] = works[k]
        return back

    order = names if args.round % 2 == 0 else names[::-1]
    for name in order:
        pipe = pipes[name]
        engine = pipe._parts.stepper.engine  # each variant keeps its own programs
        programs: dict[str, Any] = {v: {} for v in variants}
        opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
        for i in range(args.warmup + args.steps):
            for variant in variants if i % 2 == 0 else variants[::-1]:
                engine._programs = programs[variant]
                if rule7 is not None:
                    program.ahead_ranks = (lambda *_: {}) if variant else rule7  # type: ignore[assignment]
                    Transport.post = receives_first if variant else post  # type: ignore[method-assign]
                dist.barrier()
                posting[:] = [0.0, 0.0]
                start = time.perf_counter()
                pipe.train_step(x, y)
                seconds = time.perf_counter() - start
                opt.step()
                opt.zero_grad()
                ranks: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(ranks, step_record(pipe, seconds, posting))
                if i >= args.warmup:
                    out[variant][name].append(efficiency(pipe, ranks))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def efficiency_rounds(args: argparse.Namespace) -> int:
    """Run ``args.rounds`` rounds of :func:`efficiency_worker` on 2 fresh processes each
    (this checkout's conveyor, and ``--against``'s in alternate rounds) and print the
    medians per schedule."""
    roots = {"this checkout": str(Path(__file__).resolve().parents[1])}
    if args.against:
        roots = {"--against": str(Path(args.against).resolve()), **roots}
    steps: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in range(args.rounds):
        for label in list(roots) if r % 2 == 0 else list(roots)[::-1]:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "steps.json")
                env = {**os.environ, "OVERHEAD_ROOT": roots[label], "PYTHONPATH": roots[label]}
                env.pop("PYTHONDONTWRITEBYTECODE", None)
                command = [
                    sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", os.path.abspath(__file__), "--efficiency-worker",
                    "--out", out, "--schedules", args.schedules, "--steps", str(args.steps),
                    "--warmup", str(args.warmup), "--round", str(r),
                ]  # fmt: skip
                if args.before:
                    command.append("--before")
                subprocess.run(command, env=env, check=True, stderr=subprocess.DEVNULL)
                for variant, runs in json.loads(Path(out).read_text()).items():
                    key = f"{label}, {variant}" if variant else label
                    for name, rows in runs.items():
                        steps.setdefault(key, {}).setdefault(name, []).extend(rows)
    runs = list(steps)  # every run, in the order first seen
    print(
        f"\nRuntime efficiency: {LAYERS} x Linear({WIDTH}) + ReLU, batch {BATCH} in "
        f"{MICROBATCHES} micro-batches, 2 processes x 1 thread, gloo; medians over "
        f"{args.rounds} rounds x {args.steps} steps (fresh processes each round)\n"
    )
    names = args.schedules.split(",")
    head = " | ".join(f"efficiency ({label})" for label in runs)
    print(f"| schedule | {head} | step ms | simulated ms |")
    print("|---|" + "---:|" * (len(runs) + 2))
    median = statistics.median
    for name in names:
        effs = " | ".join(
            f"{median(s['efficiency'] for s in steps[label][name]):.3f}" for label in runs
        )
        rows = steps["this checkout"][name]
        print(
            f"| {name} | {effs} | {median(s['seconds'] for s in rows) * 1e3:.1f} | "
            f"{median(s['makespan'] for s in rows) * 1e3:.1f} |"
        )
    for label in runs:
        print(
            f"\nThe gap ({label}), ms per step on the rank that ends it (medians): step "
            f"minus simulated, then its parts\n"
        )
        print("| schedule | gap | " + " | ".join(PARTS) + " |")
        print("|---|" + "---:|" * (len(PARTS) + 1))
        for name in names:
            rows = steps[label][name]
            gap = median(s["seconds"] - s["makespan"] for s in rows)
            parts = " | ".join(f"{median(s[p] for s in rows) * 1e3:.2f}" for p in PARTS)
            print(f"| {name} | {gap * 1e3:.2f} | {parts} |")
    if args.json:
        Path(args.json).write_text(json.dumps(steps, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run both measurements and print them as markdown tables (``--tiny``: the tiny-stage
    comparison with torch of ``tiny_stages.py``, which takes the rest of the options)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--tiny" in argv:
        import tiny_stages  # beside this script

        return tiny_stages.main([a for a in argv if a != "--tiny"])
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per run per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each run")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--width", type=int, default=WIDTH, help="the Linear layers' width")
    p.add_argument("--efficiency", action="store_true", help="runtime efficiency, 2 processes")
    p.add_argument("--schedules", default=EFFICIENCY_SCHEDULES, help="with --efficiency")
    p.add_argument("--against", help="with --efficiency: a checkout to compare with")
    p.add_argument(
        "--before",
        action="store_true",
        help="with --efficiency: also each step posted as main 6b64e79 did, alternated",
    )
    p.add_argument("--efficiency-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.efficiency_worker:
        efficiency_worker(args)
        return 0
    if any(name not in os.environ for name in (*MALLOC_TUNABLES, "OMP_NUM_THREADS")):
        # As `conveyor launch` runs workers: glibc reads these at start, so start again.
        env = {name: str(1 << 30) for name in MALLOC_TUNABLES} | {"OMP_NUM_THREADS": "1"}
        env |= os.environ
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)
    if args.efficiency:
        if "--steps" not in sys.argv:
            args.steps = 12
        return efficiency_rounds(args)
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
