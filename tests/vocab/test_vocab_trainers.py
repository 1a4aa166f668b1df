"""Vocabulary parallelism under conveyor.Trainer and transformers' PipelineTrainer: the
loss curve is the one training without it gives (the same data order, the same steps),
in one process and on 2 processes (where every rank reads the data: each scores its rows
of the vocabulary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import conveyor
from conveyor.losses import TokenCrossEntropy
from conveyor.training import Trainer
from tests.support.helpers import reset_context
from tests.support.trainer_forked import run_forked
from tests.vocab.models import TinyGPT, padded_batch

transformers = pytest.importorskip("transformers")


def _dataset() -> torch.utils.data.TensorDataset:
    ids, targets = padded_batch(24, 8, seed=2)
    return torch.utils.data.TensorDataset(ids, targets)


def _conveyor_curve(vocab: bool) -> list[float]:
    ctx = conveyor.current() if torch.distributed.is_initialized() else conveyor.init(pp=2)
    torch.manual_seed(0)
    pipe = conveyor.Pipeline(TinyGPT(tied=True), loss_fn=TokenCrossEntropy(shift=True),
                             microbatches=2, context=ctx, vocab_parallel=vocab)  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    history = Trainer(pipe, opt).fit(_dataset(), batch_size=8, max_steps=6)
    return history.losses


def test_trainer_one_process_matches_training_without() -> None:
    reset_context()
    with_vocab = _conveyor_curve(True)
    reset_context()
    without = _conveyor_curve(False)
    assert with_vocab == pytest.approx(without, rel=1e-5)
    assert with_vocab[-1] < with_vocab[0]


def _hf_curve(rank: int, tmp: str, vocab: bool) -> list[float]:
    from conveyor.integrations.transformers import PipelineTrainer
    from tests.integrations.test_hf_trainer import _curve, arguments, features, gpt2

    args = arguments(tmp, 8)
    args.max_steps = 6
    options = {"pp": 2, "microbatches": 2, "vocab_parallel": vocab, "schedule": "zb-h1"}
    trainer = PipelineTrainer(gpt2(), args, train_dataset=features(), pipeline_options=options)
    trainer.train()
    curve = _curve(trainer.state.log_history)
    eval_loss = trainer.evaluate(features(16, seed=1))["eval_loss"]
    return [*curve, eval_loss]


@pytest.mark.slow
def test_pipeline_trainer_one_process_matches_training_without(tmp_path: Path) -> None:
    reset_context()
    with_vocab = _hf_curve(0, str(tmp_path / "a"), True)
    reset_context()
    without = _hf_curve(0, str(tmp_path / "b"), False)
    assert with_vocab == pytest.approx(without, rel=1e-4)


def _both(rank: int, tmp: str) -> dict[str, Any]:
    return {"conveyor": _conveyor_curve(True), "hf": _hf_curve(rank, tmp, True)}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_both_trainers_on_two_processes(tmp_path: Path) -> None:
    reset_context()
    want_hf = _hf_curve(0, str(tmp_path / "plain"), False)
    reset_context()
    want = _conveyor_curve(False)
    for got in run_forked(_both, 2, str(tmp_path / "pipe")):
        assert got["conveyor"] == pytest.approx(want, rel=1e-5)
        assert got["hf"] == pytest.approx(want_hf, rel=1e-4)
