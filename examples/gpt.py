"""A small character-level GPT, its token embedding tied to the output head, trained with
conveyor on the Python standard library's own source (a corpus every machine has).

    python examples/gpt.py                                   # one process, 2 stages
    conveyor launch --nproc-per-node 2 examples/gpt.py       # 2 processes
    conveyor launch --nproc-per-node 4 examples/gpt.py --schedule interleaved-1f1b --chunks 2
    conveyor launch --nproc-per-node 2 --max-restarts 3 examples/gpt.py --checkpoint ckpt

Stages are named MindSpore style: ``block.pipeline_stage = k`` on the first block of each
stage; the embeddings take stage 0 and the final norm and head the last stage, because
un-annotated modules take the stage of the data they consume. The tied weight lives on the
first and the last stage; conveyor finds it and keeps both copies equal.

``--dp``, ``--tp`` and ``--fsdp`` add data parallelism, tensor parallelism (the blocks
are written so ``tp_plan()`` can shard them) and FSDP2 to the pipeline.

The training loop is written out here, with conveyor's public pieces: ``pipe.train_step``,
the optimizer, ``conveyor.save`` / ``conveyor.load`` and a ``Progress`` line a tenth of the
way (``conveyor.Trainer`` runs that loop for you in the other examples). With
``--checkpoint DIR`` the run saves every ``--save-every`` steps and resumes from DIR when
started again (or restarted by ``--max-restarts``): batch ``k`` is drawn from a generator
seeded with ``k``, so a resumed run sees the batches the lost one would have.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import conveyor
from conveyor.checkpoint import exists
from conveyor.observe.progress import Progress
from conveyor.schedules import check_chunks


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP.

    Written so tensor parallelism can shard it (:data:`TP_PLAN`): q, k and v are separate
    projections, and the head count per rank is read from the projected width
    (``view(..., -1, head_dim)``), so with q/k/v sharded by columns each rank attends with
    its share of the heads, and ``proj`` / ``mlp.2`` (sharded by rows) sum the shares.
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.ln1 = nn.LayerNorm(width)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        b, t = x.size(0), x.size(1)
        q, k, v = (
            f(h).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.mlp(self.ln2(x))


def tp_plan() -> dict[str, object]:
    """Tensor parallelism for the blocks: q, k, v and the MLP's first layer by columns,
    the attention output and the MLP's second layer by rows (Megatron's layout)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, object] = {
        f"blocks.*.{name}": ColwiseParallel() for name in ("q", "k", "v", "mlp.0")
    }
    plan.update({f"blocks.*.{name}": RowwiseParallel() for name in ("proj", "mlp.2")})
    return plan


class GPT(nn.Module):
    """Token + position embeddings, blocks, final norm, head tied to the token embedding."""

    def __init__(self, vocab: int, context: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one Parameter used by two modules
        nn.init.normal_(self.tok.weight, std=0.02)  # GPT-2's scale: logits start near 0
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def annotate(model: GPT, stages: int) -> None:
    """Put the first block of each of ``stages`` even groups on its stage."""
    depth = len(model.blocks)
    for s in range(stages):
        model.blocks[s * depth // stages].pipeline_stage = s  # type: ignore[assignment]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position of the micro-batch."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def corpus(limit: int) -> tuple[list[str], torch.Tensor]:
    """The characters of up to ``limit`` characters of the standard library's Python source
    (the vocabulary, sorted) and that text as their indices."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = "".join(f.read_text(encoding="utf-8", errors="replace") for f in files)[:limit]
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    return vocab, torch.tensor([lookup[c] for c in text], dtype=torch.long)


def windows(data: torch.Tensor, step: int, rows: int, length: int) -> torch.Tensor:
    """Step ``step``'s batch: ``rows`` windows of ``length + 1`` tokens drawn by a generator
    seeded with the step alone, so a run resumed from a checkpoint sees the batches the lost
    one would have."""
    at = torch.randint(
        len(data) - length - 1, (rows,), generator=torch.Generator().manual_seed(step)
    )
    return torch.stack([data[i : i + length + 1] for i in at.tolist()])


def sample(
    pipe: conveyor.Pipeline,
    ctx: conveyor.Context,
    prompt: list[int],
    chars: int,
    context: int,
) -> torch.Tensor:
    """Sample ``chars`` characters after ``prompt`` (token ids), one sequence per
    micro-batch (the pipeline needs at least that many rows); every rank ends with the
    same tokens."""
    rows = pipe.microbatches
    idx = torch.tensor([prompt] * rows, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    for _ in range(chars):
        logits = pipe.predict(idx[:, -context:])
        nxt = torch.zeros(rows, 1, dtype=torch.long)
        if logits is not None:
            probs = torch.softmax(logits[:, -1, :], dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
        if ctx.distributed:  # from this pipeline's last rank to its other ranks
            dist.broadcast(nxt, ctx.global_rank(pipe.schedule.placement[-1]), ctx.pp_group)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("``", ""),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument(
        "--pp",
        type=int,
        default=None,
        help="pipeline ranks; None: the processes / (dp x tp), or 2 in one process",
    )
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per pipeline rank")
    ap.add_argument(
        "--fsdp",
        action="store_true",
        help="shard parameters, gradients and optimizer state over the --dp replicas",
    )
    ap.add_argument("--schedule", default="1f1b", help="pipeline schedule")
    ap.add_argument(
        "--chunks", type=int, default=None, help="stages per rank; None: the schedule's"
    )
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=300, help="training steps")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    ap.add_argument("--context", type=int, default=64, help="characters per sequence")
    ap.add_argument("--width", type=int, default=128, help="model width")
    ap.add_argument("--depth", type=int, default=4, help="transformer blocks")
    ap.add_argument("--heads", type=int, default=4, help="attention heads per block")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    ap.add_argument("--chars", type=int, default=2_000_000, help="corpus size in characters")
    ap.add_argument("--sample", type=int, default=200, help="characters to generate")
    ap.add_argument("--checkpoint", default=None, metavar="DIR", help="save to and resume from DIR")
    ap.add_argument("--save-every", type=int, default=50, metavar="K", help="steps between saves")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    # Under conveyor launch the processes give the pipeline ranks; alone, simulate two.
    pp = args.pp or (None if dist.is_torchelastic_launched() else 2)
    ctx = conveyor.init(pp=pp, dp=args.dp, tp=args.tp)
    say = print if ctx.rank == 0 else (lambda *a: None)
    vocab, data = corpus(args.chars)
    model = GPT(len(vocab), args.context, args.width, args.depth, args.heads)
    count = sum(p.numel() for p in model.parameters())  # before sharding unties the copies
    chunks = check_chunks(args.schedule, args.chunks, flags=True)
    annotate(model, ctx.pp_size * chunks)
    pipe = conveyor.Pipeline(
        model,
        loss_fn=lm_loss,
        microbatches=args.microbatches,
        schedule=args.schedule,
        chunks=chunks,
        context=ctx,
        fsdp=args.fsdp,
        tp_plan=tp_plan() if args.tp > 1 else None,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    say(f"{len(data):,} characters, vocabulary {len(vocab)}, {count:,} parameters")
    say(pipe)

    # The loop, written out: conveyor.Trainer (examples/resnet.py) does the same for you.
    start = 0
    if args.checkpoint and exists(args.checkpoint):  # a second run, or torchrun's restart
        start = min(conveyor.load(pipe, args.checkpoint, opt) or 0, args.steps)
        say(f"resumed from {args.checkpoint} at step {start}")
    progress = Progress(pipe, args.steps - start)  # a log line a tenth of the way
    progress.count = start
    loss = torch.tensor(0.0)
    for step in range(start, args.steps):
        rows = windows(data, step, args.batch_size, args.context)
        rows = rows[ctx.dp_rank :: ctx.dp_size]  # this replica's share of the batch
        loss = pipe.train_step(rows[:, :-1], rows[:, 1:])
        opt.step()
        opt.zero_grad()
        progress.step(loss, args.batch_size)
        done = step + 1
        if args.checkpoint and (done % args.save_every == 0 or done == args.steps):
            conveyor.save(pipe, args.checkpoint, opt, step=done)
    progress.close()

    out = sample(pipe, ctx, [vocab.index(c) for c in "def "], args.sample, args.context)
    say("sample:\n" + "".join(vocab[i] for i in out[0].tolist()))
    return 0 if math.isfinite(loss.item()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
