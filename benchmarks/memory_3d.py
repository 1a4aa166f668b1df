"""Memory per rank of the GPT example under pipeline, data, fully sharded data and tensor
parallelism: what each rank holds in parameters + gradients + AdamW state, and its peak
activation memory in a step, beside the fraction of the pp=2 run one would expect.

    python benchmarks/memory_3d.py [--width 128] [--depth 4] [--batch 16] [--context 64]

Each configuration runs on its own ``conveyor launch`` (2, 4 or 8 processes, gloo, one
thread each): the GPT of ``examples/gpt.py`` (tied embedding), 2 training steps of the
same global batch (each replica takes its share), ``Pipeline(track_memory=True)``. The
table shows the largest rank of each configuration. Expected state fractions: dp alone
keeps everything (1), fsdp over D keeps 1/D, tensor parallelism over T keeps 1/T of the
sharded matrices (q, k, v, proj, mlp) and all of the rest (embeddings, norms).
Activations are what autograd keeps; with dp each replica runs 1/D of the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {  # name: (pp, dp, tp, fsdp)
    "pp=2": (2, 1, 1, False),
    "pp=2, dp=2": (2, 2, 1, False),
    "pp=2, dp=2, fsdp": (2, 2, 1, True),
    "pp=2, tp=2": (2, 1, 2, False),
    "pp=2, dp=2, tp=2, fsdp": (2, 2, 2, True),
}


def worker(args: argparse.Namespace) -> None:
    """One configuration, on every rank: measure, and write this rank's numbers."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt  # the GPT example

    import conveyor
    from conveyor.runtime.sharding import local_shard

    torch.set_num_threads(1)
    pp, dp, tp, fsdp = CONFIGS[args.config]
    ctx = conveyor.init(pp=pp, dp=dp, tp=tp)
    torch.manual_seed(0)
    model = gpt.GPT(97, args.context, args.width, args.depth, heads=4)
    gpt.annotate(model, pp)
    pipe = conveyor.Pipeline(
        model, loss_fn=gpt.lm_loss, microbatches=4, fsdp=fsdp,
        tp_plan=gpt.tp_plan() if tp > 1 else None, track_memory=True, context=ctx,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (args.batch, args.context + 1), generator=gen)
    for _ in range(2):
        mine = ids[ctx.dp_rank :: ctx.dp_size]
        pipe.train_step(mine[:, :-1], mine[:, 1:])
        opt.step()
    state = sharded = 0
    plan_names = [n for n in gpt.tp_plan()]
    import fnmatch

    for name, p in pipe.named_parameters():
        tensors = [p, p.grad, *opt.state[p].values()]
        size = sum(
            local_shard(t).numel() * t.element_size()
            for t in tensors
            if isinstance(t, torch.Tensor)
        )
        state += size
        if any(fnmatch.fnmatchcase(name.rpartition(".")[0], pat) for pat in plan_names):
            sharded += size
    report = {
        "rank": ctx.rank,
        "state": state,
        "sharded": sharded,
        "activations": pipe.last_step_memory().peak,
    }
    with open(os.path.join(args.out, f"{ctx.rank}.json"), "w") as f:
        json.dump(report, f)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=128, help="model width (default 128)")
    p.add_argument("--depth", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    p.add_argument("--context", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.config:
        worker(args)
        return 0
    rows = []
    base: dict[str, float] = {}
    for name, (pp, dp, tp, fsdp) in CONFIGS.items():
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "conveyor.launch", "--nproc-per-node",
                   str(pp * dp * tp), __file__, "--config", name, "--out", out,
                   "--width", str(args.width), "--depth", str(args.depth),
                   "--batch", str(args.batch), "--context", str(args.context)]
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode:
                print(done.stdout + done.stderr, file=sys.stderr)
                return done.returncode
            reports = [json.loads(f.read_text()) for f in Path(out).glob("*.json")]
        top = max(reports, key=lambda r: r["state"])
        state, acts = top["state"], max(r["activations"] for r in reports)
        if not base:  # pp=2: the matrices tensor parallelism would shard, as a fraction
            base = {"state": state, "activations": acts, "matrices": top["sharded"] / state}
        f = base["matrices"]
        expected = (f / tp + 1 - f) / (dp if fsdp else 1)
        rows.append((name, state, acts, expected))
    print(f"\nGPT example: width {args.width}, depth {args.depth}, batch {args.batch} x "
          f"{args.context}, 4 micro-batches, AdamW; largest rank of each configuration\n")
    print(
        "| configuration | params+grads+AdamW MiB | vs pp=2 | expected | activations MiB "
        "| vs pp=2 |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, state, acts, expected in rows:
        print(
            f"| {name} | {state / 2**20:.2f} | {state / base['state']:.2f} | {expected:.2f} | "
            f"{acts / 2**20:.2f} | {acts / base['activations']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
