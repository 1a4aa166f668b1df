"""Tiny stages: conveyor's 1F1B step against ``torch.distributed.pipelining``'s
``Schedule1F1B`` where only the runtime's own work shows, and what each part of conveyor's
step costs.

The model is ``vs_torch.py``'s at width 128: 8 x (Linear(128, 128), ReLU), batch 64 in 8
micro-batches, MSE, SGD; 2 processes on gloo, one thread each, both libraries on the same
stages in the same processes, alternated block by block (the order flips every round).
Per step it records the wall-clock time between two barriers and each process's CPU time
(``time.process_time``: its main thread and gloo's threads). Then conveyor's steps run
once more with its parts timed (wall-clock and the main thread's CPU time, each part
exclusive of the parts inside it; the timers' own cost measured and taken out):

- ``header``: the batch's shapes and rows, from the first stage's rank to the others (on
  the receiving rank it includes waiting for the other rank to start);
- ``posting (gloo)``: ``batch_isend_irecv`` itself; ``posting (conveyor)``: building and
  recording the groups around it;
- ``waits``: waiting for a transfer (an input, the last sends, the loss);
- ``compute``: the stages' F and B (with the loss on the last stage);
- ``loss``: packing, sending and combining the step's loss sums, and the gradients' scale;
- ``failure board``: entering and leaving the step's failure region;
- ``divide``: cutting the batch into micro-batches;
- ``optimizer``: ``opt.step()`` and ``opt.zero_grad()`` (in both libraries' steps);
- ``bookkeeping``: the rest, the runtime's Python between actions (taking inputs,
  delivering outputs, timing, the program walk, the step's state and record).

torch's step is split into its stages' compute (``forward_one_chunk``,
``backward_one_chunk``), the optimizer and the rest. Each round runs in fresh processes; ``--against
DIR`` (another revision's checkout, e.g. ``git worktree add DIR REV``) runs that
revision's conveyor in alternate rounds.

    python benchmarks/overhead.py --tiny [--rounds 6] [--steps 40] [--warmup 5]
        [--against DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# This checkout, or --against's in its rounds (set before anything imports conveyor).
sys.path.insert(0, os.environ.get("OVERHEAD_ROOT") or str(Path(__file__).resolve().parents[1]))
import torch
from torch import nn

LAYERS, WIDTH, BATCH, MICROBATCHES = 8, 128, 64, 8
PARTS = ("header", "posting (gloo)", "posting (conveyor)", "waits", "compute", "loss",
         "failure board", "divide", "optimizer", "bookkeeping")  # fmt: skip
OPTIMIZER = [("torch.optim", "SGD.step", True), ("torch.optim", "SGD.zero_grad", True)]
# Where each part's functions are: (module, attribute path, opaque). An opaque part's
# time includes what it calls (the parts inside it are not split out).
WHERE: dict[str, list[tuple[str, str, bool]]] = {
    "header": [("conveyor.runtime.engine", "Engine.header", True)],
    "posting (gloo)": [("torch.distributed", "batch_isend_irecv", True)],
    "posting (conveyor)": [
        ("conveyor.runtime.channel", "Remote.post", False),
        ("conveyor.runtime.channel", "Remote.expect_sums", False),
    ],
    "waits": [("conveyor.runtime.transport", "Transport._wait", True)],
    "compute": [
        ("conveyor.runtime.compute", "StageCompute.forward", True),
        ("conveyor.runtime.compute", "StageCompute.backward", True),
        ("conveyor.runtime.compute", "StageCompute.weight_grads", True),
    ],
    "loss": [
        ("conveyor.runtime.engine", "pack", False),
        ("conveyor.runtime.channel", "Remote.share", False),
        ("conveyor.runtime.step", "Stepper._combine", False),
        ("conveyor.runtime.step_grads", "StepGradients.scale", False),
        ("conveyor.runtime.step_grads", "StepGradients.any", False),
    ],
    "failure board": [
        ("conveyor._failure", "Step.__enter__", True),
        ("conveyor._failure", "Step.__exit__", True),
    ],
    "divide": [("conveyor.runtime.step", "Stepper._divide", True)],
    "optimizer": OPTIMIZER,
}
TORCH_WHERE = {
    "compute": [
        ("torch.distributed.pipelining.stage", "PipelineStage.forward_one_chunk", True),
        ("torch.distributed.pipelining.stage", "PipelineStage.backward_one_chunk", True),
    ],
    "optimizer": OPTIMIZER,
}


def build_model() -> nn.Sequential:
    """The benchmark model, identical on every call and every rank."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The benchmark batch (inputs, targets)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)


class Parts:
    """Exclusive wall-clock and main-thread CPU seconds per part, from wrapped functions."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls = 0
        self._stack: list[list[Any]] = []  # [part, wall0, cpu0, child wall, child cpu]
        self._opaque = 0

    def wrap(self, part: str, fn: Callable[..., Any], opaque: bool) -> Callable[..., Any]:
        """``fn``, timed as ``part``."""
        stack, clock, cpu = self._stack, time.perf_counter, time.thread_time

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._opaque:
                return fn(*args, **kwargs)
            self.calls += 1
            self._opaque += opaque
            frame = [part, clock(), cpu(), 0.0, 0.0]
            stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                wall, used = clock() - frame[1], cpu() - frame[2]
                stack.pop()
                self._opaque -= opaque
                self.wall[part] = self.wall.get(part, 0.0) + wall - frame[3]
                self.cpu[part] = self.cpu.get(part, 0.0) + used - frame[4]
                if stack:
                    stack[-1][3] += wall
                    stack[-1][4] += used

        return timed

    def reset(self) -> None:
        """Forget what was timed."""
        self.wall, self.cpu, self.calls = {}, {}, 0


@contextmanager
def wrapped(parts: Parts, where: dict[str, list[tuple[str, str, bool]]]) -> Iterator[None]:
    """Every function of ``where`` timed by ``parts`` (those a revision lacks skipped)."""
    undo: list[tuple[Any, str, Any]] = []
    for part, places in where.items():
        for module_name, path, opaque in places:
            try:
                owner: Any = importlib.import_module(module_name)
            except ImportError:
                continue
            *owners, name = path.split(".")
            for attr in owners:
                owner = getattr(owner, attr, None)
            if owner is None or not hasattr(owner, name):
                continue
            own = name in vars(owner)  # else inherited: the wrapper shadows it here
            original = vars(owner)[name] if own else getattr(owner, name)
            setattr(owner, name, parts.wrap(part, original, opaque))
            undo.append((owner, name, original if own else None))
    try:
        yield
    finally:
        for owner, name, original in reversed(undo):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def timer_cost(parts: Parts, n: int = 20000) -> tuple[float, float]:
    """Seconds (wall, CPU) one timed call adds outside any part (the timers' own cost)."""

    def nothing() -> None:
        return None

    timed = parts.wrap("calibration", nothing, False)
    outer = parts.wrap("outer", lambda: [timed() for _ in range(n)], False)
    bare = parts.wrap("outer", lambda: [nothing() for _ in range(n)], False)
    best = (float("inf"), float("inf"))
    for _ in range(3):
        parts.reset()
        outer()
        with_timer = (parts.wall["outer"], parts.cpu["outer"])
        parts.reset()
        bare()
        best = min(best, ((with_timer[0] - parts.wall["outer"]) / n,
                          (with_timer[1] - parts.cpu["outer"]) / n))  # fmt: skip
    parts.reset()
    return best


def worker(args: argparse.Namespace) -> None:
    """In each of 2 processes: the timed phases; rank 0 writes the records to ``--out``."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    import conveyor

    torch.set_num_threads(1)
    conveyor.init()
    rank = dist.get_rank()
    x, y = batch()
    pipe = conveyor.Pipeline(
        build_model(), loss_fn=nn.functional.mse_loss, microbatches=MICROBATCHES,
        schedule="1f1b", balance=[8, 8],
    )  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)
    model = build_model()
    size = len(model) // 2
    held = pipelining.PipelineStage(model[rank * size : (rank + 1) * size], rank, 2,
                                    torch.device("cpu"))  # fmt: skip
    schedule = pipelining.Schedule1F1B(held, MICROBATCHES, nn.functional.mse_loss)
    torch_opt = torch.optim.SGD(held.submod.parameters(), lr=1e-3)

    def conveyor_step() -> None:
        pipe.train_step(x, y)
        opt.step()
        opt.zero_grad()

    def torch_step() -> None:
        schedule.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None,
                      losses=[], return_outputs=False)  # fmt: skip
        torch_opt.step()
        torch_opt.zero_grad()

    runs = {"conveyor": conveyor_step, "torch": torch_step}
    parts = Parts()
    cost = timer_cost(parts)
    out: dict[str, Any] = {key: {"wall": [], "cpu": []} for key in runs}
    out |= {f"{key} parts": [] for key in runs}
    for run in runs.values():
        for _ in range(args.warmup):
            run()
    blocks = 4
    for b in range(blocks):
        for key in list(runs) if (b + args.round) % 2 == 0 else list(runs)[::-1]:
            for _ in range(args.steps // blocks):
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                runs[key]()
                dist.barrier()
                out[key]["wall"].append(time.perf_counter() - t0)
                out[key]["cpu"].append(time.process_time() - c0)
    for key, where in (("conveyor", WHERE), ("torch", TORCH_WHERE)):
        with wrapped(parts, where):
            for _ in range(args.steps // 2):
                dist.barrier()
                parts.reset()
                c0, t0 = time.thread_time(), time.perf_counter()
                runs[key]()
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                known_wall, known_cpu = sum(parts.wall.values()), sum(parts.cpu.values())
                record = {f"{p} wall": parts.wall.get(p, 0.0) for p in where}
                record |= {f"{p} cpu": parts.cpu.get(p, 0.0) for p in where}
                # The rest, less what the timers themselves cost around the timed calls.
                record["rest wall"] = wall - known_wall - parts.calls * cost[0]
                record["rest cpu"] = cpu - known_cpu - parts.calls * cost[1]
                record["step wall"], record["step cpu"] = wall, cpu
                out[f"{key} parts"].append(record)
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, out)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def rounds(args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` rounds in fresh processes, this checkout's and ``--against``'s
    alternated; the records per checkout."""
    roots = {"this checkout": str(Path(__file__).resolve().parents[1])}
    if args.against:
        roots = {"--against": str(Path(args.against).resolve()), **roots}
    found: dict[str, Any] = {label: {"ranks": []} for label in roots}
    for r in range(args.rounds):
        for label in list(roots) if r % 2 == 0 else list(roots)[::-1]:
            env = {**os.environ, "OVERHEAD_ROOT": roots[label], "PYTHONPATH": roots[label],
                   "OMP_NUM_THREADS": "1"}  # fmt: skip
            common = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "out.json")
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", os.path.abspath(__file__), "--worker",
                           "--out", out, "--round", str(r), *common]  # fmt: skip
                subprocess.run(command, env=env, check=True, stderr=subprocess.DEVNULL)
                found[label]["ranks"].append(json.loads(Path(out).read_text()))
    return found


def ms(values: list[float]) -> float:
    """The median, in milliseconds."""
    return statistics.median(values) * 1e3


def report(found: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the side-by-side and the parts as markdown tables."""
    print(
        f"\nTiny stages: {LAYERS} x Linear({WIDTH}) + ReLU, batch {BATCH} in {MICROBATCHES} "
        f"micro-batches, 2 processes x 1 thread, gloo; 1F1B; medians of {args.rounds} "
        f"rounds x {args.steps} steps (fresh processes each round); load average "
        f"{os.getloadavg()[0]:.1f} at the end\n"
    )
    print("| conveyor | conveyor ms | torch ms | conveyor/torch | CPU ms rank 0 / 1: conveyor "
          "| torch | conveyor/torch CPU, rank 0 / 1 |")  # fmt: skip
    print("|---|---:|---:|---:|---|---|---|")
    for label, runs in found.items():
        wall = {k: [w for rnd in runs["ranks"] for w in rnd[0][k]["wall"]]
                for k in ("conveyor", "torch")}  # fmt: skip
        cpu = {
            k: [ms([c for rnd in runs["ranks"] for c in rnd[r][k]["cpu"]]) for r in (0, 1)]
            for k in ("conveyor", "torch")
        }
        per_round = [ms(rnd[0]["conveyor"]["wall"]) / ms(rnd[0]["torch"]["wall"])
                     for rnd in runs["ranks"]]  # fmt: skip
        ratios = " / ".join(f"{cpu['conveyor'][r] / cpu['torch'][r]:.2f}" for r in (0, 1))
        print(
            f"| {label} | {ms(wall['conveyor']):.2f} | {ms(wall['torch']):.2f} | "
            f"{ms(wall['conveyor']) / ms(wall['torch']):.2f} (rounds "
            f"{', '.join(f'{v:.2f}' for v in per_round)}; their median "
            f"{statistics.median(per_round):.2f}) | "
            + " / ".join(f"{v:.2f}" for v in cpu["conveyor"]) + " | "
            + " / ".join(f"{v:.2f}" for v in cpu["torch"]) + f" | {ratios} |"
        )
    print("\nconveyor's step in parts, ms per step (medians; each part exclusive of those "
          "inside it), rank 0 / rank 1: main thread's CPU, then wall-clock\n")  # fmt: skip
    labels = list(found)
    print("| part | " + " | ".join(f"{label}: CPU | {label}: wall" for label in labels) + " |")
    print("|---|" + "---:|---:|" * len(labels))
    names = [p for p in PARTS if p != "bookkeeping"] + ["rest", "step"]
    for part in names:
        cells = []
        for label in labels:
            for unit in ("cpu", "wall"):
                values = [
                    ms([rec.get(f"{part} {unit}", 0.0) for rnd in found[label]["ranks"]
                        for rec in rnd[r]["conveyor parts"]])
                    for r in (0, 1)
                ]  # fmt: skip
                cells.append(" / ".join(f"{v:.2f}" for v in values))
        print(f"| {'bookkeeping' if part == 'rest' else part} | " + " | ".join(cells) + " |")
    print("\ntorch's step, ms per step, rank 0 / rank 1 (main thread's CPU | wall):\n")
    print("| part | " + " | ".join(f"{label} round: CPU | wall" for label in labels) + " |")
    print("|---|" + "---:|---:|" * len(labels))
    for part in ("compute", "optimizer", "rest", "step"):
        cells = []
        for label in labels:
            for unit in ("cpu", "wall"):
                values = [
                    ms([rec.get(f"{part} {unit}", 0.0) for rnd in found[label]["ranks"]
                        for rec in rnd[r]["torch parts"]])
                    for r in (0, 1)
                ]  # fmt: skip
                cells.append(" / ".join(f"{v:.2f}" for v in values))
        print(f"| {part} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    """Run the rounds and print the tables (or, inside a round, one worker)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=40, help="timed steps per library per round")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before each run")
    p.add_argument("--against", help="another checkout, run in alternate rounds")
    p.add_argument("--json", help="also write every record to this JSON file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    found = rounds(args)
    report(found, args)
    if args.json:
        Path(args.json).write_text(json.dumps(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
