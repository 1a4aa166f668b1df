"""Every schedule on one GPU, beside the unsplit model: step time and peak memory.

One process holds every pipeline rank's stages on the one device (conveyor's one-process
world, placed on the GPU): what each schedule costs in time and memory over the same
model trained whole, with the same micro-batches accumulated. The model: ``--layers`` x
(Linear(width, width), ReLU), MSE loss, SGD; a batch of ``--batch`` rows in
``--microbatches`` micro-batches; the runs alternate round by round, in reversed order
every other round.

    python benchmarks/gpu.py [--pp 2] [--rounds 3] [--steps 10] [--json FILE]
    python benchmarks/gpu.py --device cpu --quick     # tiny sizes, on the CPU

Prints a markdown table: each schedule's median step time and its ratio to the unsplit
model's, and the step's peak memory above what was allocated when it started (activations,
temporaries and the gradients, which ``zero_grad`` frees between steps; CUDA:
``torch.cuda.max_memory_allocated`` after a reset; CPU: conveyor's ``TensorMemory``, which
counts the tensors created in the step) and its ratio to the unsplit model's. The absolute
CUDA peak (parameters, gradients and workspace too) is in the JSON.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # imported by a test
from common import timing_parser

import conveyor
from conveyor.runtime.memory import TensorMemory
from conveyor.schedules.registry import default_chunks

SCHEDULES = [
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "zb-h1",
    "zb-h2",
    "zb-auto",
    "zbv",
    "dualpipev",
    "v-half",
    "v-min",
]
UNSPLIT = "unsplit"

Step = Callable[[], None]


def build_model(layers: int, width: int) -> nn.Sequential:
    """The benchmark model, identical on every call."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def unsplit_step(args: Any, device: torch.device, x: Tensor, y: Tensor) -> Step:
    """The whole model on ``device``, gradients accumulated over the micro-batches."""
    model = build_model(args.layers, args.width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    m = args.microbatches

    def step() -> None:
        for xm, ym in zip(x.chunk(m), y.chunk(m), strict=True):
            loss = nn.functional.mse_loss(model(xm), ym) / m
            loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def pipeline_step(args: Any, device: torch.device, name: str, x: Tensor, y: Tensor) -> Step:
    """``name`` on ``args.pp`` pipeline ranks, every stage on ``device`` in this process."""
    chunks = default_chunks(name)
    stages = args.pp * chunks
    ctx = dataclasses.replace(conveyor.init(pp=args.pp), device=device)
    pipe = conveyor.Pipeline(
        build_model(args.layers, args.width),
        loss_fn=nn.functional.mse_loss,
        microbatches=args.microbatches,
        schedule=name,
        chunks=chunks,
        # Equal stages where the modules divide evenly, else conveyor's own balance.
        balance=None if 2 * args.layers % stages else [2 * args.layers // stages] * stages,
        context=ctx,
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)

    def step() -> None:
        pipe.train_step(x, y)
        opt.step()
        opt.zero_grad()

    return step


def seconds(step: Step, device: torch.device, steps: int, warmup: int) -> list[float]:
    """Seconds of each of ``steps`` steps after ``warmup`` untimed ones, the device idle
    at both ends of each."""
    for _ in range(warmup):
        step()
    out = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def peak_memory(step: Step, device: torch.device) -> tuple[int, int | None]:
    """One step's peak bytes above what was allocated when it started, and on CUDA the
    absolute peak (None on the CPU)."""
    step()  # gradients and workspace exist before the measured step, as in training
    if device.type != "cuda":
        with TensorMemory() as meter:
            step()
        return meter.peak, None
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    return peak - before, peak


def table(rows: dict[str, dict[str, Any]]) -> str:
    """The markdown table of ``rows`` (by run name, the unsplit model's first)."""
    base = rows[UNSPLIT]
    lines = [
        "| run | ms/step | vs unsplit | step peak MiB | vs unsplit |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['ms']:.2f} | {row['ms'] / base['ms']:.2f} | "
            f"{row['step_peak'] / 2**20:.2f} | {row['step_peak'] / base['step_peak']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run every schedule and the unsplit model, print the table."""
    p = timing_parser(__doc__ or "", rounds=3)
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks, all on the one device")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--schedules", help="comma-separated schedules (default: every one)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.layers, args.width, args.batch, args.microbatches = 4, 32, 32, 4
        args.rounds, args.steps, args.warmup = 1, 1, 1
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu", file=sys.stderr)
        return 2
    names = args.schedules.split(",") if args.schedules else SCHEDULES
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g).to(device)
    y = torch.randn(args.batch, args.width, generator=g).to(device)
    runs = {UNSPLIT: unsplit_step(args, device, x, y)}
    runs.update({name: pipeline_step(args, device, name, x, y) for name in names})
    memory = {name: peak_memory(step, device) for name, step in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            times[name] += seconds(runs[name], device, args.steps, args.warmup)
    rows = {
        name: {
            "ms": statistics.median(times[name]) * 1e3,
            "step_peak": memory[name][0],
            "device_peak": memory[name][1],
        }
        for name in runs
    }
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"\n{args.layers} x Linear({args.width}, {args.width}) + ReLU, batch {args.batch} in "
        f"{args.microbatches} micro-batches, pp {args.pp} in one process on {where}; "
        f"median of {args.rounds} rounds x {args.steps} steps\n"
    )
    print(table(rows))
    if args.json:
        report = {
            "device": where,
            "torch": torch.__version__,
            **{k: getattr(args, k) for k in ("pp", "layers", "width", "batch", "microbatches")},
            **{k: getattr(args, k) for k in ("rounds", "steps", "warmup")},
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
