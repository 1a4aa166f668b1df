"""The mixture-of-experts row of ``benchmarks/vocab_parallel.py``: vocabulary parallelism
with expert parallelism against expert parallelism alone, on a transformers Mixtral with a
large vocabulary.

    python benchmarks/vocab_moe.py [--rounds 2] [--steps 3] [--warmup 1] [--json FILE]
    python benchmarks/vocab_moe.py --quick        # tiny sizes, 1 round: a smoke run

The model: ``MixtralForCausalLM`` from a config (nothing downloaded; hidden 128, 2
layers, 8 experts, top-2, expert intermediate 256, a 32k vocabulary with an untied output
layer: the two vocabulary layers are most of the parameters, as in DeepSeek-V3's or
Qwen3-MoE's smaller configurations), built under ``conveyor.empty_weights()``. The layout:
4 processes forked from this one (gloo, one thread each), pp=2 x dp=2 with ep=2, 1F1B, the
model's own loss (``loss_fn=None``), a global batch of 8 sequences of 128 tokens (each
replica 4, in 4 micro-batches), AdamW. Two runs:

- ``ep=2``: the embedding on the first stage's rank, the output layer on the last's;
- ``ep=2 + vocab parallel``: ``vocab_parallel=True``: both layers split by rows over the
  2 pipeline ranks.

Timing: both runs live in the same 4 processes and alternate within every round (the
order flips every round); the median of ``--rounds`` x ``--steps`` steps between two
barriers. Peak resident memory: ``VmHWM`` after 2 steps in fresh processes of their own.
Parameters: each rank's parameter elements (local shards) over an equal share (a quarter
of the model's non-expert parameters plus half its experts, since ep=2 halves those).
4 busy processes on 2 cores time the compute of both runs alike; the ratio, not the
absolute time, is what carries over.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import alternate, on_processes, status_kib, step_times, timing_parser  # noqa: E402
from moe import mixtral, replica_batch  # noqa: E402

PP, DP, EP = 2, 2, 2
MIB = 2**20
FULL = {"hidden": 128, "layers": 2, "experts": 8, "top_k": 2, "intermediate": 256,
        "vocab": 32768, "heads": 4, "batch": 8, "tokens": 128, "microbatches": 4}  # fmt: skip
QUICK = {"hidden": 32, "layers": 2, "experts": 8, "top_k": 2, "intermediate": 64,
         "vocab": 2048, "heads": 4, "batch": 8, "tokens": 16, "microbatches": 4}  # fmt: skip
RUNS = ("ep=2", "ep=2 + vocab parallel")


def build(shape: dict[str, int], run: str, ctx: Any) -> tuple[Any, Any, dict[str, Any]]:
    """(pipeline, optimizer, batch) of one run."""
    import torch

    import conveyor

    batch = replica_batch(shape, ctx.dp_rank)
    pipe = conveyor.Pipeline(
        mixtral(shape), loss_fn=None, microbatches=shape["microbatches"], schedule="1f1b",
        context=ctx, weights=None, init_seed=0, sample=(batch, None),
        vocab_parallel=run != RUNS[0],
    )  # fmt: skip
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-4), batch


def share(pipe: Any, shape: dict[str, int]) -> float:
    """This rank's parameter elements over an equal share of the model's."""
    from conveyor.runtime.sharding import local_shard

    model = mixtral(shape)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    rest = sum(p.numel() for p in model.parameters()) - experts
    equal = rest / PP + experts / (PP * EP)
    return sum(local_shard(p).numel() for p in pipe.parameters()) / equal


def time_rank(args: argparse.Namespace, shape: dict[str, int]) -> dict[str, Any]:
    """Both runs in these processes, alternated; this rank's numbers."""
    import conveyor

    ctx = conveyor.init(pp=PP, dp=DP, ep=EP)
    steps = {}
    shares: dict[str, float] = {}
    losses: dict[str, float] = {}
    for run in RUNS:
        pipe, opt, batch = build(shape, run, ctx)
        shares[run] = share(pipe, shape)

        def step(pipe: Any = pipe, opt: Any = opt, batch: Any = batch, run: str = run) -> None:
            losses[run] = float(pipe.train_step(batch, None))
            opt.step()
            opt.zero_grad()

        steps[run] = step
    times, _ = alternate(steps, None, args.rounds, step_times, args.steps, args.warmup)
    return {"rank": ctx.rank, "times": times, "shares": shares, "losses": losses}


def memory_rank(args: argparse.Namespace, shape: dict[str, int], run: str) -> dict[str, Any]:
    """One run in fresh processes: this rank's peak resident memory after 2 steps."""
    import conveyor

    ctx = conveyor.init(pp=PP, dp=DP, ep=EP)
    before = status_kib("VmHWM")
    pipe, opt, batch = build(shape, run, ctx)
    for _ in range(2):
        pipe.train_step(batch, None)
        opt.step()
        opt.zero_grad()
    return {"rank": ctx.rank, "before": before * 1024, "peak": status_kib("VmHWM") * 1024}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both runs timed side by side, then each run's memory; the results and the table."""
    shape = QUICK if args.quick else FULL
    ranks = on_processes(PP * DP, time_rank, args, shape)
    medians = {run: statistics.median(ranks[0]["times"][run]) for run in RUNS}
    memory = {run: on_processes(PP * DP, memory_rank, args, shape, run) for run in RUNS}
    return {"shape": shape, "medians": medians, "times": ranks[0]["times"],
            "shares": [r["shares"] for r in ranks], "losses": ranks[0]["losses"],
            "memory": memory, "table": table(shape, medians, ranks, memory)}  # fmt: skip


def table(
    shape: dict[str, int],
    medians: dict[str, float],
    ranks: list[dict[str, Any]],
    memory: dict[str, Any],
) -> str:
    """The markdown table of the two runs."""
    lines = [
        f"\nMixtral, vocabulary {shape['vocab']}, pp=2 x dp=2 x ep=2 (4 processes), 1F1B\n",
        "| run | step (ms) | x ep=2 | params / equal share (ranks) | peak RSS MiB (ranks) |",
        "|---|---|---|---|---|",
    ]
    for run in RUNS:
        shares = " / ".join(f"{r['shares'][run]:.2f}" for r in ranks)
        peaks = " / ".join(f"{r['peak'] / MIB:.0f}" for r in memory[run])
        t = medians[run]
        lines.append(f"| {run} | {t * 1e3:.0f} | {t / medians[RUNS[0]]:.2f} | {shares} | {peaks} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table (and write ``--json``)."""
    args = timing_parser(__doc__, rounds=2).parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 1, 0
    import torch  # imported once here: the forked processes inherit it
    import transformers  # noqa: F401

    import conveyor  # noqa: F401

    torch.set_num_threads(1)
    results = measure(args)
    print(results["table"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
