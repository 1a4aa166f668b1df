"""A Llama no process holds whole: built on the meta device, each rank allocating and
initializing (or loading) only its own stages.

    python examples/big_model.py --save DIR                           # one process, 2 stages
    conveyor launch --nproc-per-node 2 examples/big_model.py          # each rank: its half
    conveyor launch --nproc-per-node 4 examples/big_model.py --depth 8 --weights DIR

The model is built under ``conveyor.empty_weights()``: its parameters are shapes on the meta
device and take no memory; its buffers (the rotary ``inv_freq``) stay real. The pipeline
splits it as it is and each rank gives values only to the parameters of its stages: with
``--weights DIR`` (a transformers checkpoint: ``model.safetensors`` or shards with
``model.safetensors.index.json``, e.g. ``save_pretrained``'s; or a conveyor checkpoint such
as ``--save`` writes, from any layout), each rank reads only its own tensors; without, each
module's own initialization (transformers' ``_init_weights``) seeded by ``--init-seed`` and
the module's name, so every layout starts from the same weights. Each rank prints what it
holds against the whole model, trains a few steps on the bytes of argparse's source, and
prints its peak resident memory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import StackDataset
from transformers import LlamaConfig, LlamaForCausalLM

import conveyor
from conveyor.training import ProgressBar


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
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--weights", metavar="DIR", help="checkpoint to load; None: initialize")
    ap.add_argument("--init-seed", type=int, default=0, help="seed of the initialization")
    ap.add_argument("--save", metavar="DIR", help="write the trained model to DIR at the end")
    ap.add_argument("--pp", type=int, help="pipeline ranks; None: the processes, or 2 alone")
    ap.add_argument("--steps", type=int, default=20, help="training steps")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    ap.add_argument("--context", type=int, default=64, help="tokens (bytes) per sequence")
    ap.add_argument("--width", type=int, default=256, help="hidden size")
    ap.add_argument("--depth", type=int, default=4, help="decoder layers")
    args = ap.parse_args(argv)

    torch.manual_seed(0)  # the data's order
    ctx = conveyor.init(pp=args.pp or (None if dist.is_torchelastic_launched() else 2))
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.width,
        intermediate_size=4 * args.width,
        num_hidden_layers=args.depth,
        num_attention_heads=args.width // 32,
        max_position_embeddings=args.context,
        use_cache=False,
    )
    with conveyor.empty_weights():  # shapes only: no process holds the whole model
        model = LlamaForCausalLM(config)
    whole = sum(p.numel() for p in model.parameters())

    text = Path(argparse.__file__).read_bytes()
    rows = torch.tensor(list(text)).unfold(0, args.context, args.context)  # whole rows only
    pipe = conveyor.Pipeline(
        model,
        loss_fn=None,
        microbatches=4,
        context=ctx,
        sample=({"input_ids": rows[:8], "labels": rows[:8]}, None),  # splits it now
        weights=args.weights,
        init_seed=args.init_seed,
    )
    held = sum(p.numel() for p in pipe.parameters())
    still_meta = sum(p.numel() for p in model.parameters() if p.is_meta)
    print(f"rank {ctx.rank}: stages {list(pipe.held_stages)} hold {held:,} of {whole:,} "
          f"parameters ({held / whole:.0%}); {still_meta:,} stay on the meta device")  # fmt: skip
    if ctx.rank == 0:
        print(pipe)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    trainer = conveyor.Trainer(pipe, opt, callbacks=[ProgressBar()], checkpoint_dir=args.save)
    trainer.fit(
        StackDataset(input_ids=rows, labels=rows), batch_size=args.batch_size, max_steps=args.steps
    )
    print(f"rank {ctx.rank}: peak resident memory {peak_memory_mib():.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
