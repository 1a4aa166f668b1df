"""A small Llama from Hugging Face transformers, built from its config (no download), handed
to conveyor as it is and trained on the Python standard library's own source.

    python examples/hf_llama.py                                  # one process, 2 stages
    conveyor launch --nproc-per-node 2 examples/hf_llama.py      # 2 processes
    conveyor launch --nproc-per-node 2 examples/hf_llama.py --schedule zb-h1
    conveyor launch --nproc-per-node 2 --max-restarts 3 examples/hf_llama.py --checkpoint ckpt

Nothing in the model is changed or wrapped: conveyor captures ``LlamaForCausalLM`` with
torch.export on the first batch (``sample=``), cuts it between decoder layers, and the
model computes its own loss from ``labels`` (``loss_fn=None``). Only ``use_cache=False``
(training keeps no key/value cache) and no dropout are set in the config. The run prints
the split, a loss line every tenth of the run, and a sample.

Characters are the tokens (the vocabulary is the corpus's characters); batch ``k`` is drawn
from a generator seeded with ``k``, so a run resumed from ``--checkpoint`` repeats nothing.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import conveyor
from conveyor.checkpoint import exists
from conveyor.observe.progress import Progress
from conveyor.schedules import check_chunks

# --- what the other examples have too, copied so that this file runs on its own ---


def add_pipeline_options(ap: argparse.ArgumentParser) -> None:
    """``--pp``, ``--schedule``, ``--chunks``, ``--microbatches``, ``--checkpoint`` and
    ``--save-every``."""
    ap.add_argument(
        "--pp", type=int, default=None, help="pipeline ranks (default: processes, or 2)"
    )
    ap.add_argument("--schedule", default="1f1b", help="schedule name (default: %(default)s)")
    ap.add_argument(
        "--chunks", type=int, default=None, help="stages per rank (default: the schedule's)"
    )
    ap.add_argument(
        "--microbatches", type=int, default=4, help="micro-batches per step (default: %(default)s)"
    )
    ap.add_argument("--checkpoint", default=None, metavar="DIR", help="save to / resume from DIR")
    ap.add_argument(
        "--save-every",
        type=int,
        default=50,
        metavar="K",
        help="steps between saves (default: %(default)s)",
    )


def context(args: argparse.Namespace, dp: int = 1, tp: int = 1) -> conveyor.Context:
    """``--pp`` pipeline ranks; without it, as many as the launched processes allow, or two
    in one process when started with plain ``python``."""
    pp = args.pp or (None if dist.is_torchelastic_launched() else 2)
    return conveyor.init(pp=pp, dp=dp, tp=tp)


def printer(ctx: conveyor.Context) -> Callable[..., None]:
    """``print`` on rank 0, nothing elsewhere."""
    return print if ctx.rank == 0 else (lambda *a, **k: None)


def train(
    pipe: conveyor.Pipeline,
    opt: torch.optim.Optimizer,
    step_of: Callable[[int], torch.Tensor],
    steps: int,
    args: argparse.Namespace,
    say: Callable[..., Any],
) -> torch.Tensor:
    """Resume from ``--checkpoint`` if it holds one, run the steps that are left
    (``step_of(k)`` trains step k and returns its loss), log a tenth of the way each, save
    every ``--save-every`` steps and at the end; returns the last loss."""
    start = 0
    if args.checkpoint and exists(args.checkpoint):
        start = min(conveyor.load(pipe, args.checkpoint, opt) or 0, steps)
        say(f"resumed from {args.checkpoint} at step {start}")
    progress = Progress(pipe, steps - start, every=max(steps // 10, 1))
    progress.count = start
    loss = torch.tensor(0.0)
    for step in range(start, steps):
        loss = step_of(step)
        opt.step()
        opt.zero_grad()
        progress.step(loss, args.batch_size)
        done = step + 1
        if args.checkpoint and (done % args.save_every == 0 or done == steps):
            conveyor.save(pipe, args.checkpoint, opt, step=done)
    progress.close()
    return loss


def corpus(limit: int) -> str:
    """Up to ``limit`` characters of the standard library's Python source, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= limit:
            break
    return "".join(parts)[:limit]


def encode(text: str) -> tuple[list[str], torch.Tensor]:
    """The characters of ``text`` (the vocabulary, sorted) and ``text`` as their indices."""
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    return vocab, torch.tensor([lookup[c] for c in text], dtype=torch.long)


def windows(data: torch.Tensor, step: int, rows: int, length: int) -> torch.Tensor:
    """``rows`` windows of ``length + 1`` tokens; the batch of a step depends on the step
    alone, so a run resumed from a checkpoint repeats nothing."""
    gen = torch.Generator().manual_seed(step)
    at = torch.randint(len(data) - length - 1, (rows,), generator=gen)
    return torch.stack([data[i : i + length + 1] for i in at.tolist()])


# --- this example ---


def config(vocab: int, args: argparse.Namespace) -> LlamaConfig:
    """The model's shape, from the options (no weights, nothing downloaded)."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.width,
        intermediate_size=args.width * 8 // 3,
        num_hidden_layers=args.depth,
        num_attention_heads=args.heads,
        num_key_value_heads=max(args.heads // 2, 1),
        max_position_embeddings=args.context,
        use_cache=False,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build(vocab: int, args: argparse.Namespace) -> LlamaForCausalLM:
    """The model, from its config: random weights."""
    return LlamaForCausalLM(config(vocab, args))


def generate(
    pipe: conveyor.Pipeline, ctx: conveyor.Context, prompt: list[int], count: int, context: int
) -> list[int]:
    """``prompt`` continued by ``count`` sampled tokens (every rank gets them)."""
    rows = pipe.microbatches  # predict splits the batch into micro-batches
    idx = torch.tensor([prompt] * rows, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    for _ in range(count):
        window = idx[:, -context:]
        # Inputs keep the structure the model was captured with: labels too (unused here).
        out = pipe.predict({"input_ids": window, "labels": window})
        nxt = torch.zeros(rows, 1, dtype=torch.long)
        if out is not None:
            probs = torch.softmax(out.logits[:, -1, :], dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
        if ctx.distributed:
            dist.broadcast(nxt, pipe.schedule.placement[-1])
        idx = torch.cat([idx, nxt], dim=1)
    return idx[0].tolist()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("``", ""),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_pipeline_options(ap)
    ap.add_argument("--steps", type=int, default=300, help="training steps")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    ap.add_argument("--context", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--width", type=int, default=128, help="hidden size")
    ap.add_argument("--depth", type=int, default=4, help="decoder layers")
    ap.add_argument("--heads", type=int, default=4, help="attention heads")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    ap.add_argument("--chars", type=int, default=2_000_000, help="corpus size")
    ap.add_argument("--sample", type=int, default=80, help="characters to generate")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    ctx = context(args)
    text = corpus(args.chars)
    vocab, data = encode(text)
    model = build(len(vocab), args)

    def batch(step: int) -> dict[str, torch.Tensor]:
        ids = windows(data, step, args.batch_size, args.context - 1)
        return {"input_ids": ids, "labels": ids}  # the model shifts the labels itself

    # sample= splits the model now, so a checkpoint can be loaded before the first step.
    pipe = conveyor.Pipeline(
        model,
        loss_fn=None,
        microbatches=args.microbatches,
        schedule=args.schedule,
        chunks=check_chunks(args.schedule, args.chunks, flags=True),
        context=ctx,
        sample=(batch(0), None),
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    say = printer(ctx)
    say(
        f"{len(text):,} characters, vocabulary {len(vocab)}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters"
    )
    say(pipe)
    loss = train(pipe, opt, lambda step: pipe.train_step(batch(step), None), args.steps, args, say)
    out = generate(pipe, ctx, [vocab.index(c) for c in "def "], args.sample, args.context)
    say("sample:\n" + "".join(vocab[i] for i in out))
    return 0 if math.isfinite(loss.item()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
