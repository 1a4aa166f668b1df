"""A Llama no process holds whole: built on the meta device, each rank allocating and
initializing (or loading) only its own stages, trained on the Python standard library's
own source.

    python examples/big_model.py                                      # one process, 2 stages
    conveyor launch --nproc-per-node 2 examples/big_model.py          # each rank: its half
    conveyor launch --nproc-per-node 4 examples/big_model.py --depth 8 --weights DIR

The model is built under ``conveyor.empty_weights()``: its parameters are shapes on the meta
device and take no memory; its buffers (the rotary ``inv_freq``) stay real. The pipeline
splits it as it is and each rank gives values only to the parameters of its stages: with
``--weights DIR`` (a transformers checkpoint: ``model.safetensors`` or shards with
``model.safetensors.index.json``, e.g. ``save_pretrained``'s), each rank reads only its own
tensors; without, each module's own initialization (transformers' ``_init_weights``) seeded
by ``--init-seed`` and the module's name, so every layout starts from the same weights.
Each rank prints what it holds against the whole model, and its peak resident memory.
"""

from __future__ import annotations

import argparse
import math

import torch
from hf_llama import config
from loop import add_pipeline_options, context, printer, train
from text import corpus, encode, windows
from transformers import LlamaForCausalLM

import conveyor
from conveyor.schedules import check_chunks


def peak_memory_mib() -> float:
    """This process's peak resident memory (VmHWM), in MiB (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as status:
            line = next(x for x in status if x.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0.0
    return int(line.split()[1]) / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("``", ""),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_pipeline_options(ap)
    ap.add_argument("--weights", default=None, metavar="DIR",
                    help="a transformers (or conveyor) checkpoint to load; default: initialize")
    ap.add_argument("--init-seed", type=int, default=0, help="seed of the initialization")
    ap.add_argument("--steps", type=int, default=100, help="training steps")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    ap.add_argument("--context", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--width", type=int, default=128, help="hidden size")
    ap.add_argument("--depth", type=int, default=4, help="decoder layers")
    ap.add_argument("--heads", type=int, default=4, help="attention heads")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    ap.add_argument("--chars", type=int, default=2_000_000, help="corpus size")
    args = ap.parse_args(argv)  # fmt: skip

    ctx = context(args)
    text = corpus(args.chars)
    vocab, data = encode(text)
    with conveyor.empty_weights():  # shapes only: no process holds the whole model
        model = LlamaForCausalLM(config(len(vocab), args))
    whole = sum(p.numel() for p in model.parameters())

    def batch(step: int) -> dict[str, torch.Tensor]:
        ids = windows(data, step, args.batch_size, args.context - 1)
        return {"input_ids": ids, "labels": ids}  # the model shifts the labels itself

    pipe = conveyor.Pipeline(
        model,
        loss_fn=None,
        microbatches=args.microbatches,
        schedule=args.schedule,
        chunks=check_chunks(args.schedule, args.chunks, flags=True),
        context=ctx,
        sample=(batch(0), None),
        weights=args.weights,
        init_seed=args.init_seed,
    )
    held = sum(p.numel() for p in pipe.parameters())
    still_meta = sum(p.numel() for p in model.parameters() if p.is_meta)
    print(f"rank {ctx.rank}: stages {list(pipe.held_stages)} hold {held:,} of {whole:,} "
          f"parameters ({held / whole:.0%}); {still_meta:,} stay on the meta device")  # fmt: skip
    say = printer(ctx)
    say(pipe)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    loss = train(pipe, opt, lambda step: pipe.train_step(batch(step), None), args.steps, args, say)
    print(f"rank {ctx.rank}: peak resident memory {peak_memory_mib():.0f} MiB")
    return 0 if math.isfinite(loss.item()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
