"""A transformers GPT-2 trained by Lightning's own loop, through a pipeline.

    python examples/lightning_gpt.py                          # one process, 2 stages
    python examples/lightning_gpt.py --devices 2              # Lightning starts 2 processes
    conveyor launch --nproc-per-node 4 examples/lightning_gpt.py --dp 2   # torchrun: pp 2 x dp 2

The LightningModule is what it would be on one device: its hyperparameters saved with
``save_hyperparameters()``, its network in ``self.model`` (a GPT-2 built from a config, no
download) whose loss is its own (``self.model(input_ids=ids, labels=ids).loss``), its
data from ``train_dataloader`` and ``val_dataloader``. ``L.Trainer(strategy=
PipelineStrategy(...))`` cuts that network into stages, one process each; Lightning's loop,
AdamW with a warm-up schedule, gradient clipping, ``self.log``, the progress bar and
``ModelCheckpoint`` work as usual. The data is a synthetic language: each sequence counts
up from a random start with a random stride, modulo the vocabulary, so the next token
follows from the two before it. At the end rank 0 loads the last checkpoint (conveyor's,
written by every rank) into the unsplit module.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

import conveyor
from conveyor.integrations.lightning import PipelineStrategy


class LitGPT(L.LightningModule):
    """A plain LightningModule: nothing in it knows about pipelines."""

    def __init__(
        self, layers: int, width: int, vocab: int, length: int, batch_size: int, steps: int
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)  # the same network on every rank
        config = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab,
                            n_positions=length, use_cache=False, bos_token_id=None,
                            eos_token_id=None, resid_pdrop=0, embd_pdrop=0,
                            attn_pdrop=0)  # fmt: skip
        self.model = GPT2LMHeadModel(config)

    def counting(self, rows: int, seed: int) -> DataLoader[Any]:
        """``rows`` sequences ``start, start + stride, ...`` modulo the vocabulary."""
        vocab, g = self.hparams["vocab"], torch.Generator().manual_seed(seed)
        start, stride = torch.randint(vocab, (2, rows, 1), generator=g)
        ids = (start + (1 + stride % 3) * torch.arange(self.hparams["length"])) % vocab
        return DataLoader(TensorDataset(ids), batch_size=self.hparams["batch_size"])

    def train_dataloader(self) -> DataLoader[Any]:
        return self.counting(4096, seed=1)

    def val_dataloader(self) -> DataLoader[Any]:
        return self.counting(64, seed=2)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch[0], labels=batch[0]).loss)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        warmup = max(self.hparams["steps"] // 10, 1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for name, default, what in [
        ("layers", 4, "GPT-2 blocks"), ("width", 64, "model width"),
        ("vocab", 64, "vocabulary size"), ("length", 32, "tokens per sequence"),
        ("batch-size", 16, "sequences per replica and step"), ("steps", 200, "optimizer steps"),
    ]:  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default, help=what)
    ap.add_argument("--pp", type=int, help="pipeline ranks; None: processes / dp, or 2 alone")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--schedule", default="1f1b", help="pipeline schedule")
    ap.add_argument("--devices", type=int, help="processes here; None: torchrun's, else 1")
    ap.add_argument("--precision", default="32-true", help="32-true or bf16-mixed")
    ap.add_argument("--output", help="where checkpoints go; None: a temporary directory")
    args = ap.parse_args(argv)

    devices = args.devices or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    several = devices > 1 or "WORLD_SIZE" in os.environ
    output = args.output or tempfile.mkdtemp(prefix="lightning-gpt-")
    hparams = {k: getattr(args, k) for k in ("layers", "width", "vocab", "length", "steps")}
    module = LitGPT(batch_size=args.batch_size, **hparams)
    strategy = PipelineStrategy(
        pp=args.pp or (None if several else 2), dp=args.dp,
        microbatches=args.microbatches, schedule=args.schedule,
    )  # fmt: skip
    first: list[float] = []

    class FirstLoss(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *a: Any, **k: Any) -> None:
            if not first:
                first.append(float(trainer.callback_metrics["train_loss"]))

    trainer = L.Trainer(
        strategy=strategy, devices=devices, accelerator="cpu", precision=args.precision,
        max_steps=args.steps, gradient_clip_val=1.0, val_check_interval=max(args.steps // 2, 1),
        check_val_every_n_epoch=None, log_every_n_steps=max(args.steps // 10, 1),
        callbacks=[ModelCheckpoint(dirpath=output, save_last=True), FirstLoss()], logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    if trainer.global_rank == 0:
        print(strategy.pipe, flush=True)
        last = float(trainer.callback_metrics["train_loss"])
        print(f"first loss {first[0]:.4f}, last {last:.4f}")
        print(f"val_loss {float(trainer.callback_metrics['val_loss']):.4f}")
        unsplit = LitGPT(**module.hparams)
        unsplit.model.load_state_dict(conveyor.load_model_state(f"{output}/last.ckpt"))
        ids = torch.cat([batch[0] for batch in unsplit.val_dataloader()])
        with torch.no_grad():
            again = unsplit.model(input_ids=ids, labels=ids).loss.item()
        print(f"the unsplit module from {output}/last.ckpt: loss {again:.4f} on the validation set")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
