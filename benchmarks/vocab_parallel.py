"""Vocabulary parallelism on CPU: step time, peak memory and parameter share per rank of
a GPT whose output layer dwarfs its blocks, with the vocabulary layers split over the
pipeline ranks (``vocab_parallel=True``) beside every layer split without it, and the
simulator's prediction of both.

    python benchmarks/vocab_parallel.py [--rounds 2] [--steps 3] [--warmup 1] [--json FILE]
    python benchmarks/vocab_parallel.py --quick      # tiny sizes, 1 round: a smoke run
    python benchmarks/vocab_parallel.py --no-moe     # without the mixture-of-experts row

The model: ``examples/gpt.py``'s GPT (token and position embeddings, pre-norm blocks,
a bias-free output layer tied to the token embedding), hidden 256, 4 blocks, 4 heads,
128 tokens, with a 32k and a 128k vocabulary; the token cross-entropy
(``TokenCrossEntropy``), AdamW. The layout: 2 processes (forked by
``torch.multiprocessing`` from the one that runs this script; gloo, one thread each), 1F1B,
a batch of 8 sequences in 4 micro-batches. The runs per vocabulary:

- ``blocks k|4-k`` (k = 0..4): without vocabulary parallelism, the embeddings and the first
  k blocks on rank 0, the other blocks and the output layer on rank 1 (annotations:
  every layer redistribution there is); the best of them is the baseline;
- ``vocab parallel``: ``vocab_parallel=True``: both vocabulary layers split by rows over
  the 2 ranks, the blocks balanced automatically (2 | 2).

Timing: the runs of one vocabulary live in the same 2 processes and alternate within
every round (the order flips every round); each round runs ``--warmup`` untimed and
``--steps`` timed steps of each, between two barriers (train step + optimizer step); the
table gives the median. Memory: ``VmHWM`` of ``/proc/self/status`` on each rank after 2
steps of the best split and of ``vocab parallel``, in fresh processes of their own (the
whole process: the interpreter and torch included, so the table also gives the peak
before the model was built). Parameters: each rank's parameter elements (a tied weight
once, a split one by its local rows) over an equal share of the model's.

The simulation: ``conveyor.simulate`` of the same runs from costs measured in this
process, one micro-batch at a time: a block's forward and backward, the output layer with
the loss, the embeddings; the vocabulary passes cost the output layer's (and
embedding's) time over the ranks. It also gives 4 ranks (simulated only: 4 busy processes
on 2 cores would time nothing): the best split of the blocks against vocabulary
parallelism with the blocks spread evenly.

Then the mixture-of-experts row (``benchmarks/vocab_moe.py``): a Mixtral with a 32k
vocabulary on pp=2 x dp=2 x ep=2, vocabulary parallelism with expert parallelism against
expert parallelism alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
from common import alternate, on_processes, status_kib, step_times, timing_parser  # noqa: E402

PP = 2
MIB = 2**20
FULL = {"hidden": 256, "layers": 4, "heads": 4, "tokens": 128, "batch": 8,
        "microbatches": 4, "vocabs": [32768, 131072]}  # fmt: skip
QUICK = {"hidden": 32, "layers": 4, "heads": 4, "tokens": 16, "batch": 4,
         "microbatches": 2, "vocabs": [2048]}  # fmt: skip
VOCAB = "vocab parallel"


def split_name(k: int, layers: int) -> str:
    return f"blocks {k}|{layers - k}"


def gpt_model(shape: dict[str, Any], vocab: int) -> Any:
    import gpt
    import torch

    torch.manual_seed(0)
    return gpt.GPT(vocab, shape["tokens"], shape["hidden"], shape["layers"], shape["heads"])


def annotated(shape: dict[str, Any], vocab: int, k: int) -> Any:
    """The GPT with its embeddings and first ``k`` blocks on stage 0, the rest on stage 1."""
    import conveyor

    model = gpt_model(shape, vocab)
    conveyor.set_stage(model.tok, 0)
    conveyor.set_stage(model.pos, 0)
    for i, block in enumerate(model.blocks):
        conveyor.set_stage(block, 0 if i < k else 1)
    conveyor.set_stage(model.ln_f, 1)
    conveyor.set_stage(model.head, 1)
    return model


def batch(shape: dict[str, Any], vocab: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (shape["batch"], shape["tokens"] + 1), generator=g)
    return ids[:, :-1], ids[:, 1:].clone()


def build(shape: dict[str, Any], vocab: int, run: str) -> Any:
    import conveyor
    from conveyor.losses import TokenCrossEntropy

    if run == VOCAB:
        model = gpt_model(shape, vocab)
    else:
        model = annotated(shape, vocab, int(run.split()[1].split("|")[0]))
    return conveyor.Pipeline(
        model, loss_fn=TokenCrossEntropy(), microbatches=shape["microbatches"],
        schedule="1f1b", vocab_parallel=run == VOCAB,
    )  # fmt: skip


def runs_of(shape: dict[str, Any]) -> list[str]:
    return [split_name(k, shape["layers"]) for k in range(shape["layers"] + 1)] + [VOCAB]


def stepper(pipe: Any, data: tuple[Any, Any]) -> Callable[[], None]:
    import torch

    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)

    def step() -> None:
        pipe.train_step(*data)
        opt.step()
        opt.zero_grad()

    return step


def share(pipe: Any, total: int) -> float:
    """This rank's parameter elements over an equal share of the model's."""
    held = 0
    for p in pipe.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        held += local.numel()
    return held / (total / PP)


def time_rank(args: argparse.Namespace, shape: dict[str, Any], vocab: int) -> dict[str, Any]:
    """Every run of ``vocab`` in these processes, alternated; this rank's numbers."""
    import conveyor

    ctx = conveyor.init(pp=PP)
    data = batch(shape, vocab)
    total = sum(p.numel() for p in gpt_model(shape, vocab).parameters())
    steps: dict[str, Callable[[], None]] = {}
    shares: dict[str, float] = {}
    for run in runs_of(shape):
        pipe = build(shape, vocab, run)
        steps[run] = stepper(pipe, data)
        shares[run] = share(pipe, total)
    times, _ = alternate(steps, None, args.rounds, step_times, args.steps, args.warmup)
    return {"rank": ctx.rank, "times": times, "shares": shares}


def memory_rank(args: argparse.Namespace, shape: dict[str, Any], vocab: int, run: str) -> Any:
    """Two steps of ``run`` in fresh processes: this rank's peak resident memory."""
    import conveyor

    before = status_kib("VmHWM")
    conveyor.init(pp=PP)
    step = stepper(build(shape, vocab, run), batch(shape, vocab))
    for _ in range(2):
        step()
    return {"before": before * 1024, "peak": status_kib("VmHWM") * 1024}


def costs(shape: dict[str, Any], vocab: int, repeats: int) -> dict[str, float]:
    """Seconds per micro-batch, measured in this process (one thread): a block's forward
    and backward, the output layer with the loss, the embeddings."""
    import torch

    from conveyor.losses import TokenCrossEntropy

    model = gpt_model(shape, vocab)
    rows = shape["batch"] // shape["microbatches"]
    ids, targets = batch(shape, vocab)
    ids, targets = ids[:rows], targets[:rows]
    x = (model.tok(ids) + model.pos.weight[: ids.shape[1]]).detach().requires_grad_()
    loss = TokenCrossEntropy()

    def timed(forward: Callable[[], Any]) -> tuple[float, float]:
        f = b = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = forward()
            t1 = time.perf_counter()
            root = out[0] if isinstance(out, tuple) else out.float().square().mean()
            root.backward()
            f, b = min(f, t1 - t0), min(b, time.perf_counter() - t1)
        return f, b

    out: dict[str, float] = {}
    out["blockF"], out["blockB"] = timed(lambda: model.blocks[0](x))
    out["outputF"], out["outputB"] = timed(lambda: loss(model.head(model.ln_f(x)), targets))
    positions = torch.arange(ids.shape[1])
    out["embedF"], out["embedB"] = timed(lambda: model.tok(ids) + model.pos(positions))
    return out


def simulated(shape: dict[str, Any], c: dict[str, float]) -> dict[str, float]:
    """Simulated seconds per step (1F1B, the measured costs) of every run."""
    from conveyor.schedules import get_schedule
    from conveyor.schedules.vocab import with_vocab
    from conveyor.simulate import simulate

    layers, m = shape["layers"], shape["microbatches"]
    sched = get_schedule("1f1b", PP, m)
    block = (c["blockF"], c["blockB"])
    out: dict[str, float] = {}
    for k in range(layers + 1):
        first = (k * block[0] + c["embedF"], k * block[1] + c["embedB"], 0.0)
        last = ((layers - k) * block[0] + c["outputF"], (layers - k) * block[1] + c["outputB"], 0.0)
        out[split_name(k, layers)] = simulate(sched, [first, last]).makespan
    half = layers // PP
    stage = (half * block[0], half * block[1], 0.0)
    passes = (c["embedF"] / PP, c["outputF"] / PP, c["outputB"] / PP, c["embedB"] / PP)
    placed = with_vocab(sched, (stage[0], stage[1], 0.0))
    out[VOCAB] = simulate(placed, [stage, stage], vocab=passes).makespan
    return out


def simulated_p4(shape: dict[str, Any], c: dict[str, float]) -> tuple[str, float, float]:
    """On 4 ranks (simulated only: 4 busy processes on 2 cores time nothing): the best
    split of the blocks without vocabulary parallelism, its makespan, and vocabulary
    parallelism's (blocks spread evenly) per step."""
    import itertools

    from conveyor.schedules import get_schedule
    from conveyor.schedules.vocab import with_vocab
    from conveyor.simulate import simulate

    ranks, layers, m = 4, shape["layers"], shape["microbatches"]
    sched = get_schedule("1f1b", ranks, m)
    bf, bb = c["blockF"], c["blockB"]
    best = ("", float("inf"))
    for cuts in itertools.combinations_with_replacement(range(layers + 1), ranks - 1):
        sizes = [b - a for a, b in zip((0, *cuts), (*cuts, layers), strict=True)]
        costs = [(k * bf, k * bb, 0.0) for k in sizes]
        costs[0] = (costs[0][0] + c["embedF"], costs[0][1] + c["embedB"], 0.0)
        costs[-1] = (costs[-1][0] + c["outputF"], costs[-1][1] + c["outputB"], 0.0)
        span = simulate(sched, costs).makespan
        if span < best[1]:
            best = ("|".join(map(str, sizes)), span)
    even = [layers // ranks + (r < layers % ranks) for r in range(ranks)]
    costs = [(k * bf, k * bb, 0.0) for k in even]
    passes = (c["embedF"] / ranks, c["outputF"] / ranks, c["outputB"] / ranks, c["embedB"] / ranks)
    placed = with_vocab(sched, costs[0])
    return best[0], best[1], simulate(placed, costs, vocab=passes).makespan


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table (and write ``--json``)."""
    p = timing_parser(__doc__, rounds=2)
    p.add_argument("--no-moe", action="store_true", help="skip the mixture-of-experts row")
    args = p.parse_args(argv)
    shape = QUICK if args.quick else FULL
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 1, 0
    import torch  # imported once here: the forked processes inherit it

    import conveyor  # noqa: F401

    torch.set_num_threads(1)
    results: dict[str, Any] = {"shape": shape, "vocabs": {}}
    for vocab in shape["vocabs"]:
        ranks = on_processes(PP, time_rank, args, shape, vocab)
        medians = {r: statistics.median(ranks[0]["times"][r]) for r in ranks[0]["times"]}
        splits = [r for r in medians if r != VOCAB]
        best = min(splits, key=lambda r: medians[r])
        memory = {
            run: on_processes(PP, memory_rank, args, shape, vocab, run) for run in (best, VOCAB)
        }
        c = costs(shape, vocab, 2 if args.quick else 3)
        sim = simulated(shape, c)
        sim_best = min((r for r in sim if r != VOCAB), key=lambda r: sim[r])
        p4 = simulated_p4(shape, c)
        results["vocabs"][str(vocab)] = {
            "medians": medians, "best": best, "times": ranks[0]["times"],
            "shares": [r["shares"] for r in ranks], "memory": memory, "costs": c,
            "simulated": sim, "simulated_best": sim_best, "simulated_p4": p4,
        }  # fmt: skip
        print(table(vocab, medians, best, ranks, memory, sim, sim_best))
        print(f"4 ranks, simulated: best split {p4[0]}, vocab parallel {p4[2] / p4[1]:.2f}x it")
    if not args.no_moe:
        import vocab_moe

        results["moe"] = vocab_moe.measure(args)
        print(results["moe"]["table"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def table(
    vocab: int,
    medians: dict[str, float],
    best: str,
    ranks: list[dict[str, Any]],
    memory: dict[str, list[dict[str, int]]],
    sim: dict[str, float],
    sim_best: str,
) -> str:
    """The markdown table of one vocabulary's runs."""
    lines = [
        f"\nvocabulary {vocab}: 1F1B, 2 processes; best split without vocabulary "
        f"parallelism: {best} (simulated: {sim_best})\n",
        "| run | step (ms) | x best split | simulated x | params / equal share (ranks) "
        "| peak RSS MiB (ranks) |",
        "|---|---|---|---|---|---|",
    ]
    for run, t in medians.items():
        peaks = memory.get(run)
        peak = " / ".join(f"{r['peak'] / MIB:.0f}" for r in peaks) if peaks else ""
        shares = " / ".join(f"{r['shares'][run]:.2f}" for r in ranks)
        lines.append(
            f"| {run} | {t * 1e3:.0f} | {t / medians[best]:.2f} | "
            f"{sim[run] / sim[sim_best]:.2f} | {shares} | {peak} |"
        )
    before = " / ".join(f"{r['before'] / MIB:.0f}" for r in memory[VOCAB])
    lines.append(f"\n(peak RSS before the model was built: {before} MiB)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
