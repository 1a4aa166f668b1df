"""A small Llama from Hugging Face transformers, built from its config (no download), handed
to conveyor as it is and trained by conveyor.Trainer on the Python standard library's own
source.

    python examples/hf_llama.py                                  # one process, 2 stages
    conveyor launch --nproc-per-node 2 examples/hf_llama.py      # 2 processes
    conveyor launch --nproc-per-node 2 examples/hf_llama.py --schedule zb-h1
    conveyor launch --nproc-per-node 2 --max-restarts 3 examples/hf_llama.py --checkpoint ckpt

Nothing in the model is changed or wrapped: conveyor captures ``LlamaForCausalLM`` with
torch.export on a sample batch (``sample=``), cuts it between decoder layers, and the
model computes its own loss from ``labels`` (``loss_fn=None``). Only ``use_cache=False``
(training keeps no key/value cache) is set in the config. The tokens are the source's
bytes; each sample is a dict of ``input_ids`` and ``labels``, as transformers takes them.

``conveyor.Trainer`` runs the loop: AdamW, a progress line every tenth of the run, and with
``--checkpoint DIR`` a checkpoint every ``--save-every`` steps; started again, the run
resumes from DIR exactly where it stopped (model, optimizer, data order). At the end it
prints the loss on bytes held out of training.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import StackDataset
from transformers import LlamaConfig, LlamaForCausalLM

import conveyor
from conveyor.checkpoint import exists
from conveyor.training import ProgressBar


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--pp", type=int, help="pipeline ranks; None: the processes, or 2 alone")
    ap.add_argument("--schedule", default="1f1b", help="pipeline schedule")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=300, help="training steps")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    ap.add_argument("--context", type=int, default=64, help="tokens (bytes) per sequence")
    ap.add_argument("--width", type=int, default=128, help="hidden size")
    ap.add_argument("--depth", type=int, default=4, help="decoder layers")
    ap.add_argument("--bytes", type=int, default=2_000_000, help="corpus size")
    ap.add_argument("--checkpoint", metavar="DIR", help="save to and resume from DIR")
    ap.add_argument("--save-every", type=int, default=50, metavar="K", help="steps between saves")
    args = ap.parse_args(argv)

    torch.manual_seed(0)  # the same weights on every rank
    pp = args.pp or (None if dist.is_torchelastic_launched() else 2)
    ctx = conveyor.init(pp=pp)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = b"".join(f.read_bytes() for f in files)[: args.bytes]
    rows = torch.tensor(list(text)).unfold(0, args.context, args.context)  # whole rows only
    held_out = args.batch_size * max(len(rows) // (20 * args.batch_size), 1)  # a 20th
    train = StackDataset(input_ids=rows[held_out:], labels=rows[held_out:])
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=args.width,
            intermediate_size=args.width * 8 // 3,
            num_hidden_layers=args.depth,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.context,
            tie_word_embeddings=True,
            use_cache=False,
        )
    )
    # sample= splits the model now, so that a checkpoint can be loaded before the first step.
    sample = {"input_ids": rows[: args.batch_size], "labels": rows[: args.batch_size]}
    pipe = conveyor.Pipeline(
        model,
        loss_fn=None,  # the model's own loss: it shifts the labels itself
        microbatches=args.microbatches,
        schedule=args.schedule,
        context=ctx,
        sample=(sample, None),
    )
    if ctx.rank == 0:
        print(f"{len(text):,} bytes, {sum(p.numel() for p in model.parameters()):,} parameters")
        print(pipe)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    trainer = conveyor.Trainer(
        pipe,
        opt,
        callbacks=[ProgressBar()],
        checkpoint_dir=args.checkpoint,
        checkpoint_every=args.save_every if args.checkpoint else None,
    )
    if args.checkpoint and exists(args.checkpoint) and ctx.rank == 0:
        print(f"resuming from {args.checkpoint}")
    trainer.fit(
        train, batch_size=args.batch_size, max_steps=args.steps, resume=bool(args.checkpoint)
    )
    held = trainer.evaluate(
        StackDataset(input_ids=rows[:held_out], labels=rows[:held_out]),
        batch_size=args.batch_size,
    )
    if ctx.rank == 0:
        print(f"held-out loss {held['loss']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
