"""Planning a model built on the meta device vs the same model built real, in one process
(one thread): the memory it takes and what its profile measures.

1. Peak resident memory (``VmHWM``) after building the model and after
   ``conveyor.plan(model, ..., ranks=2)``, each case in a fresh process: the meta model is
   profiled one unit at a time, each on a real copy of that unit alone, so planning holds
   about one layer, never the whole model.
2. The profile of ``plan_accuracy.py``'s two models (one micro-batch's forward and backward
   through every unit), real and meta alternating for ``--rounds`` pairs: meta / real per
   pair.

    python benchmarks/plan_meta.py [--layers 16] [--width 2048] [--batch 16] [--rounds 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
import conveyor
from conveyor.planning.planner import plan
from conveyor.planning.profiler import profile

MB = 2**20


def peak_rss() -> int:
    """This process's peak resident set (``VmHWM``), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def build(layers: int, width: int) -> nn.Sequential:
    """``layers`` x (Linear(width), ReLU)."""
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def case(meta: bool, args: argparse.Namespace) -> dict[str, float]:
    """Build (real or meta), plan, and report sizes, peaks and time."""
    torch.set_num_threads(1)
    start = peak_rss()
    if meta:
        with conveyor.empty_weights():
            model = build(args.layers, args.width)
    else:
        model = build(args.layers, args.width)
    built = peak_rss()
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    t0 = time.perf_counter()
    chosen = plan(model, x, y, nn.functional.mse_loss, 2, microbatch_counts=[2])
    took = time.perf_counter() - t0
    size = sum(p.numel() * 4 for p in model.parameters())
    return {
        "model MB": size / MB,
        "layer MB": (args.width + 1) * args.width * 4 / MB,
        "start MB": start / MB,
        "built MB": built / MB,
        "planned MB": peak_rss() / MB,
        "plan s": took,
        "predicted ms": chosen.predicted_step * 1e3,
        "balance": chosen.balance,  # type: ignore[dict-item]
        "schedule": chosen.schedule,  # type: ignore[dict-item]
    }


def profiles(rounds: int) -> None:
    """Print, per model of ``plan_accuracy.py``, the profiled F + B of real and meta."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from plan_accuracy import benchmark_model, unbalanced_model

    torch.set_num_threads(1)
    print("\n| model | real ms | meta ms | meta / real: median | quartiles |")
    print("|---|---:|---:|---:|---|")
    for build_model, shape in ((benchmark_model, (64, 1024)), (unbalanced_model, (64, 64, 128))):
        model, _, width_out = build_model()
        with conveyor.empty_weights():
            meta = build_model()[0]
        x, y = torch.randn(*shape), torch.randn(64, width_out)
        ratios: list[float] = []
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(rounds):
            pair: dict[bool, float] = {}
            for is_meta in (False, True) if i % 2 == 0 else (True, False):
                net = meta if is_meta else model
                pair[is_meta] = sum(profile(net, x, y, nn.functional.mse_loss, 8).times(False))
                times[is_meta].append(pair[is_meta])
            ratios.append(pair[True] / pair[False])
        q = statistics.quantiles(ratios, n=4)
        print(
            f"| {build_model.__name__} | {statistics.median(times[False]) * 1e3:.2f} | "
            f"{statistics.median(times[True]) * 1e3:.2f} | {statistics.median(ratios):.3f} | "
            f"{q[0]:.2f}-{q[2]:.2f} |"
        )


def main(argv: list[str] | None = None) -> int:
    """Run each case in its own process, or (with ``--case``) one case here."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=8, help="pairs of profiles (0: none)")
    p.add_argument("--case", choices=["real", "meta"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case is not None:
        print(json.dumps(case(args.case == "meta", args)))
        return 0
    flags = ["--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch)]
    print("| model | model MB | one layer MB | peak after build MB | peak after plan MB | "
          "plan s | plan |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in ("real", "meta"):
        out = subprocess.run(
            [sys.executable, __file__, *flags, "--case", name],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"| {name} | {r['model MB']:.0f} | {r['layer MB']:.0f} | {r['built MB']:.0f} | "
            f"{r['planned MB']:.0f} | {r['plan s']:.1f} | {r['schedule']} {r['balance']}, "
            f"{r['predicted ms']:.1f} ms |"
        )
    if args.rounds:
        profiles(args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
