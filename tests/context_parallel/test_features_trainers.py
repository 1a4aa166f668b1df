"""Context parallelism under the trainers, against their one-process runs of the unsplit
model: ``conveyor.Trainer`` (each data-parallel replica reads its own shard, the cp ranks
of a replica the same rows), transformers' ``PipelineTrainer`` (its token count,
``num_items_in_batch``, spans every cp share: the logged losses are the plain trainer's
on the whole batch) and the Lightning strategy (``PipelineStrategy(cp=...)``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("transformers")
pytest.importorskip("lightning")

import lightning.pytorch as L
from transformers import Trainer

import conveyor
from conveyor.integrations.lightning import PipelineStrategy
from conveyor.integrations.transformers import PipelineTrainer
from tests.context_parallel.test_features import LOSS, net
from tests.context_parallel.test_features_processes import llama
from tests.context_parallel.test_pipeline import VOCAB
from tests.integrations.test_hf_trainer import _curve, arguments, features
from tests.integrations.test_lightning import LM_FIT, LitLM, Padded, shuffled, trainer
from tests.support.helpers import reset_context
from tests.support.trainer_forked import run_forked

STEPS = 4


class LitLlama(LitLM):
    """LitLM's steps (the network's own loss from ``labels``) on a Llama."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.model = llama()
        self.losses: list[float] = []


def plain_curve(tmp: str, batch: int) -> list[float]:
    """The plain transformers trainer's logged losses, one process, the whole batch."""
    args = arguments(tmp, batch)
    args.max_steps = STEPS
    plain = Trainer(model=llama(), args=args, train_dataset=features())
    plain.train()
    return _curve(plain.state.log_history)


def pipeline_curve(tmp: str, batch: int, options: dict[str, Any]) -> list[float]:
    args = arguments(tmp, batch)
    args.max_steps = STEPS
    trainer = PipelineTrainer(llama(), args, train_dataset=features(),
                              pipeline_options={"microbatches": 2, **options})  # fmt: skip
    trainer.train()
    return _curve(trainer.state.log_history)


@pytest.mark.slow  # about 3 s alone: two trainers and a capture
def test_pipeline_trainer_in_one_process(tmp_path: Path) -> None:
    want = plain_curve(str(tmp_path / "plain"), 8)
    reset_context()
    got = pipeline_curve(str(tmp_path / "pipe"), 8, {"pp": 2, "cp": 2})
    assert got == [pytest.approx(w, rel=1e-4) for w in want]


@pytest.mark.slow  # about 3 s alone: two fits and a capture
def test_lightning_in_one_process() -> None:
    lit = LitLlama()
    trainer(max_steps=STEPS).fit(lit, shuffled(Padded(32), 8))
    piped = LitLlama()
    strategy = PipelineStrategy(pp=2, cp=2, microbatches=2)
    trainer(max_steps=STEPS, strategy=strategy).fit(piped, shuffled(Padded(32), 8))
    assert strategy.pipe is not None and strategy.pipe.context.cp_size == 2
    assert piped.losses == [pytest.approx(w, rel=1e-5) for w in lit.losses]


# ---------------------------------------------------------------------- processes
def _conveyor_trainer(rank: int, dp: int, cp: int) -> list[float]:
    """Three steps of ``conveyor.Trainer`` over a seeded shuffle of 40 rows, 8 a step."""
    reset_context()
    conveyor.init(pp=1, dp=dp, cp=cp)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (40, 16), generator=gen)
    pipe = conveyor.Pipeline(net(), loss_fn=LOSS, microbatches=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    torch.manual_seed(11)
    fit = conveyor.Trainer(pipe, opt).fit
    return fit(TensorDataset(ids, ids), batch_size=8, max_steps=3).losses


def _pipeline_trainer(rank: int, tmp: str) -> list[float]:
    return pipeline_curve(tmp, 8, {"pp": 2, "cp": 2})


def _lightning(rank: int, dp: int) -> list[float]:
    lit = LitLlama()
    strategy = PipelineStrategy(pp=1, dp=dp, cp=2, microbatches=2, schedule="zb-h1")
    trainer(**LM_FIT, devices=4, strategy=strategy).fit(
        lit, DataLoader(Padded(48), batch_size=8 // dp)
    )
    return lit.losses


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_trainers_on_four_processes(tmp_path: Path) -> None:
    """``conveyor.Trainer`` on dp 2 x cp 2 reads as the one-process trainer (its seeded
    shuffle, each replica its share, both cp ranks of a replica the same rows);
    ``PipelineTrainer`` on pp 2 x cp 2 logs the plain trainer's losses (the tokens of a
    batch counted once, over every cp share); Lightning on dp 2 x cp 2, its own run's."""
    want = _conveyor_trainer(0, 1, 1)
    for got in run_forked(_conveyor_trainer, 4, 2, 2, timeout=400):
        assert got == [pytest.approx(w, rel=1e-5) for w in want]
    reset_context()
    curve = plain_curve(str(tmp_path / "plain"), 8)
    for got in run_forked(_pipeline_trainer, 4, str(tmp_path / "pipe"), timeout=400):
        assert got == [pytest.approx(w, rel=1e-4) for w in curve]
    lit = LitLlama()
    trainer(**LM_FIT).fit(lit, shuffled(Padded(48), 8))
    for losses in run_forked(_lightning, 4, 2, timeout=400):
        assert losses == [pytest.approx(w, rel=1e-5) for w in lit.losses]
