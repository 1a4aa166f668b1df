"""The transformers half of ``vs_torch.py --model gpt2``: a Hugging Face GPT-2 (8 blocks of
width 256, 8 heads, vocabulary 1024, sequence 128, built from its config, no dropout),
batch 16 in 8 micro-batches, next-token cross-entropy, SGD, 2 processes on gloo with one
thread each.

conveyor gets the model as it is and splits it itself (captured with torch.export, cut
between blocks 3 and 4); ``torch.distributed.pipelining`` gets the same model through its
own tracer with the split written by hand (``split_spec={"transformer.h.4":
SplitPoint.BEGINNING}``), the split conveyor chose. Runs alternate round by round; a
single-process gradient-accumulation loop on rank 0 is the baseline.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import alternate
from torch import Tensor, nn

import conveyor

BLOCKS, WIDTH, HEADS, VOCAB, SEQUENCE, BATCH, MICROBATCHES = 8, 256, 8, 1024, 128, 16, 8
# (conveyor schedule, torch schedule class or None)
HF_ROWS: list[tuple[str, str | None]] = [
    ("gpipe", "ScheduleGPipe"),
    ("1f1b", "Schedule1F1B"),
    ("zb-h1", None),
    ("zb-late", None),
]
Step = Callable[[], None]


def build_gpt2() -> nn.Module:
    """The benchmark transformer, identical on every call and every rank."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=BLOCKS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQUENCE,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )
    return transformers.GPT2LMHeadModel(config)


def lm_loss(out: Any, targets: Tensor) -> Tensor:
    """Cross-entropy of the logits (torch's last stage returns them bare, conveyor's the
    model's own output object)."""
    logits = out if isinstance(out, Tensor) else out.logits
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def conveyor_step(schedule: str, x: Tensor, y: Tensor) -> tuple[Step, conveyor.Pipeline]:
    pipe = conveyor.Pipeline(
        build_gpt2(), loss_fn=lm_loss, microbatches=MICROBATCHES, schedule=schedule,
        sample=(x, y),
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)

    def step() -> None:
        pipe.train_step(x, y)
        opt.step()
        opt.zero_grad()

    return step, pipe


def torch_step(schedule: str, x: Tensor, y: Tensor) -> Step:
    from torch.distributed import pipelining

    model = build_gpt2()
    rank = dist.get_rank()
    pipe = pipelining.pipeline(
        model,
        mb_args=(x.tensor_split(MICROBATCHES)[0],),
        split_spec={f"transformer.h.{BLOCKS // 2}": pipelining.SplitPoint.BEGINNING},
    )
    stage = pipe.build_stage(rank, torch.device("cpu"))
    runner = getattr(pipelining, schedule)(stage, MICROBATCHES, loss_fn=lm_loss)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=1e-3)

    def step() -> None:
        if rank == 0:
            runner.step(x)
        else:
            runner.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()

    return step


def single_process(x: Tensor, y: Tensor) -> Step:
    model = build_gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        for xm, ym in zip(x.tensor_split(MICROBATCHES), y.tensor_split(MICROBATCHES), strict=True):
            (lm_loss(model(xm), ym) / MICROBATCHES).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()

    return step


def worker(args: argparse.Namespace, timed: Callable[..., list[float]]) -> None:
    """Runs in each of the 2 processes; rank 0 prints the table."""
    torch.set_num_threads(1)
    conveyor.init()
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    runs: dict[tuple[str, str], Step] = {}
    split = ""
    for schedule, theirs in HF_ROWS:
        runs[("conveyor", schedule)], pipe = conveyor_step(schedule, x, y)
        split = str(pipe.describe())
        if theirs is not None:
            runs[("torch", schedule)] = torch_step(theirs, x, y)
    baseline = single_process(x, y) if rank == 0 else None
    times, one_process = alternate(runs, baseline, args.rounds, timed, args.steps, args.warmup)
    if rank != 0:
        return
    base = statistics.median(one_process)
    torch_1f1b = statistics.median(times[("torch", "1f1b")])
    print(
        f"\nGPT-2 (transformers) {BLOCKS} blocks x width {WIDTH}, sequence {SEQUENCE}, batch "
        f"{BATCH} in {MICROBATCHES} micro-batches, 2 processes x 1 thread, gloo; median of "
        f"{args.rounds} rounds x {args.steps} steps; one process: {base * 1e3:.0f} ms/step\n"
        f"conveyor's automatic split:\n{split}\n"
    )
    print(
        "| conveyor schedule | conveyor ms | torch schedule | torch ms | conveyor/torch "
        "| conveyor/torch 1F1B | speed-up vs 1 process |"
    )
    print("|---|---:|---|---:|---:|---:|---:|")
    for schedule, theirs in HF_ROWS:
        ours = statistics.median(times[("conveyor", schedule)])
        other = times.get(("torch", schedule))
        cell = "— | — |" if not other else (
            f"{statistics.median(other) * 1e3:.0f} | {ours / statistics.median(other):.2f} |"
        )
        print(
            f"| {schedule} | {ours * 1e3:.0f} | {theirs or '—'} | {cell} "
            f"{ours / torch_1f1b:.2f} | {base / ours:.2f} |"
        )
