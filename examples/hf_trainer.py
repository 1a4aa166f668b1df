"""A transformers GPT-2 trained by ``transformers.Trainer``'s own loop, through a pipeline.

    python examples/hf_trainer.py                                   # one process, 2 stages
    conveyor launch --nproc-per-node 2 examples/hf_trainer.py       # 2 processes
    conveyor launch --nproc-per-node 4 examples/hf_trainer.py --dp 2   # pp 2 x dp 2

``PipelineTrainer`` is a ``transformers.Trainer``: ``TrainingArguments`` work as usual
(AdamW, linear warm-up, gradient clipping, logging, evaluation and save steps), but the
model runs as a conveyor pipeline (``pipeline_options``) instead of a DDP replica. The
model is built from a config (no download) and learns a synthetic language: each sequence
counts up from a random start with a random stride, modulo the vocabulary, so the next
token follows from the two before it. The run logs the loss, evaluates, saves the whole
model with ``save_model`` and loads it back with ``from_pretrained`` on rank 0.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from conveyor.integrations.transformers import PipelineTrainer


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].replace("``", ""),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps")
    ap.add_argument("--layers", type=int, default=4, help="GPT-2 blocks")
    ap.add_argument("--width", type=int, default=64, help="model width")
    ap.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    ap.add_argument("--length", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per replica and step")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--schedule", default="1f1b", help="pipeline schedule")
    ap.add_argument("--pp", type=int, help="pipeline ranks; None: processes / dp, or 2 alone")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    ap.add_argument("--output", help="output directory; None: a temporary one")
    args = ap.parse_args(argv)

    pp = args.pp or (None if dist.is_torchelastic_launched() else 2)
    model = gpt2(args)
    output = args.output or tempfile.mkdtemp(prefix="hf-trainer-")
    training = TrainingArguments(
        output_dir=output,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=max(args.steps // 10, 1),
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=max(args.steps // 10, 1),
        eval_strategy="steps",
        eval_steps=max(args.steps // 2, 1),
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        use_cpu=not torch.cuda.is_available(),  # so transformers counts CPU processes
    )
    trainer = PipelineTrainer(
        model,
        training,
        train_dataset=Counting(2048, args.length, args.vocab, seed=1),
        eval_dataset=Counting(128, args.length, args.vocab, seed=2),
        pipeline_options={
            "pp": pp, "dp": args.dp, "schedule": args.schedule,
            "microbatches": args.microbatches,
        },
    )  # fmt: skip
    rank = trainer.context.rank
    if rank == 0:
        print(trainer.pipe, flush=True)
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(f"{output}/final")
    if rank == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"first logged loss {losses[0]:.4f}, last {losses[-1]:.4f}")
        print(f"eval_loss {metrics['eval_loss']:.4f}")
        loaded = GPT2LMHeadModel.from_pretrained(f"{output}/final")
        batch = Counting(128, args.length, args.vocab, seed=2).ids
        with torch.no_grad():
            again = loaded(input_ids=batch, labels=batch).loss.item()
        # The model's own loss averages over the tokens it predicts (all but the first of
        # each sequence); the trainer's eval_loss divides by every label, as
        # transformers.Trainer does for GPT-2.
        print(f"from_pretrained({output}/final): its own loss {again:.4f} on the evaluation data")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
