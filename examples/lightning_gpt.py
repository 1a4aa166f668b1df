"""A transformers GPT-2 trained by Lightning's own loop, through a pipeline.

    python examples/lightning_gpt.py                          # one process, 2 stages
    python examples/lightning_gpt.py --devices 2              # Lightning starts 2 processes
    conveyor launch --nproc-per-node 4 examples/lightning_gpt.py --dp 2   # torchrun: pp 2 x dp 2

The LightningModule is what it would be on one device: its network in ``self.model`` (a
GPT-2 built from a config, no download), whose loss is its own (``self.model(**batch)
.loss``). ``L.Trainer(strategy=PipelineStrategy(...))`` cuts that network into stages, one
process each; Lightning's loop, AdamW with a warm-up schedule, gradient clipping,
``self.log``, the progress bar and ``ModelCheckpoint`` work as usual. The data is a
synthetic language: each sequence counts up from a random start with a random stride,
modulo the vocabulary, so the next token follows from the two before it. At the end rank 0
loads the last checkpoint (conveyor's, written by every rank) into the unsplit module.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

import conveyor
from conveyor.integrations.lightning import PipelineStrategy

# --- what the other examples have too, copied so that this file runs on its own ---


class Counting(Dataset[dict[str, torch.Tensor]]):
    """``n`` sequences ``start, start + stride, ...`` (mod ``vocab``), as inputs and labels."""

    def __init__(self, n: int, length: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def gpt2(args: argparse.Namespace) -> GPT2LMHeadModel:
    """The model, from a config (no download): the same on every rank."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=args.vocab, n_positions=args.length, n_embd=args.width, n_layer=args.layers,
            n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
            bos_token_id=None, eos_token_id=None,
        )
    )  # fmt: skip


def options(ap: argparse.ArgumentParser) -> Callable[[str, object, str], None]:
    """The model's, data's and pipeline's options; returns the helper that adds one."""

    def option(name: str, default: object, what: str) -> None:
        kind = type(default) if default is not None else int
        ap.add_argument(name, type=kind, default=default, help=f"{what} (default: %(default)s)")

    option("--steps", 200, "optimizer steps")
    option("--layers", 4, "GPT-2 blocks")
    option("--width", 64, "model width")
    option("--vocab", 64, "vocabulary size")
    option("--length", 32, "tokens per sequence")
    option("--batch-size", 16, "sequences per replica and step")
    option("--microbatches", 4, "micro-batches per step")
    option("--schedule", "1f1b", "pipeline schedule")
    option("--pp", None, "pipeline ranks; None: processes / dp, or 2 in one process")
    option("--dp", 1, "data-parallel replicas")
    return option


# --- this example ---


class LitGPT(L.LightningModule):
    """A plain LightningModule: nothing in it knows about pipelines."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.model = gpt2(args)  # the same network on every rank
        self.steps = args.steps

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, prog_bar=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        warmup = max(self.steps // 10, 1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )

    option = options(ap)  # the model's, data's and pipeline's, as examples/hf_trainer.py's
    option("--devices", None, "processes on this machine; None: torchrun's, else 1")
    option("--precision", "32-true", "Lightning's precision: 32-true or bf16-mixed")
    ap.add_argument("--output", default=None, help="checkpoints (default: a temporary directory)")
    args = ap.parse_args(argv)

    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    several = devices > 1 or "WORLD_SIZE" in os.environ
    pp = args.pp or (None if several else 2)
    output = args.output or tempfile.mkdtemp(prefix="lightning-gpt-")
    module = LitGPT(args)
    strategy = PipelineStrategy(
        pp=pp, dp=args.dp, microbatches=args.microbatches, schedule=args.schedule
    )
    trainer = L.Trainer(
        strategy=strategy, devices=devices, accelerator="cpu", precision=args.precision,
        max_steps=args.steps, gradient_clip_val=1.0, val_check_interval=max(args.steps // 2, 1),
        check_val_every_n_epoch=None, log_every_n_steps=max(args.steps // 10, 1),
        callbacks=[ModelCheckpoint(dirpath=output, save_last=True)], logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    train = DataLoader(Counting(4096, args.length, args.vocab, seed=1), batch_size=args.batch_size)
    val = DataLoader(Counting(64, args.length, args.vocab, seed=2), batch_size=args.batch_size)
    first: list[float] = []

    class FirstLoss(L.Callback):
        def on_train_batch_end(self, *a: Any, **k: Any) -> None:
            if not first:
                first.append(float(trainer.callback_metrics["train_loss"]))

    trainer.callbacks.append(FirstLoss())
    trainer.fit(module, train, val)
    if trainer.global_rank == 0:
        print(strategy.pipe, flush=True)
        last = float(trainer.callback_metrics["train_loss"])
        print(f"first loss {first[0]:.4f}, last {last:.4f}")
        print(f"val_loss {float(trainer.callback_metrics['val_loss']):.4f}")
        unsplit = LitGPT(args)
        unsplit.model.load_state_dict(conveyor.load_model_state(f"{output}/last.ckpt"))
        batch = Counting(64, args.length, args.vocab, seed=2).ids
        with torch.no_grad():
            again = unsplit.model(input_ids=batch, labels=batch).loss.item()
        print(f"the unsplit module from {output}/last.ckpt: loss {again:.4f} on the validation set")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
