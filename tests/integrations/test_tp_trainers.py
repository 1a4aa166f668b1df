"""Tensor parallelism on a transformers Llama through the trainers: ``PipelineTrainer``
(``pipeline_options={"tp": 2, "tp_plan": "auto"}``) and the Lightning strategy
(``PipelineStrategy(tp=2, tp_plan="auto")``), pp=2 x tp=2 on 4 processes: each step's
loss equals the plain trainer's on padded rows of very different lengths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import tp_models as M
from tests.support.trainer_forked import run_forked

pytest.importorskip("transformers")
L = pytest.importorskip("lightning")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

from conveyor.integrations.lightning import PipelineStrategy  # noqa: E402
from conveyor.integrations.transformers import PipelineTrainer  # noqa: E402
from tests.integrations.test_hf_trainer import _curve, arguments, features  # noqa: E402
from tests.integrations.test_lightning import Padded, shuffled, trainer  # noqa: E402

STEPS = 4


def _args(tmp: str) -> Any:
    args = arguments(tmp, 8)
    args.max_steps = STEPS
    return args


def _pipeline_trainer(rank: int, tmp: str) -> list[float]:
    trainer = PipelineTrainer(
        M.tiny("llama"), _args(tmp), train_dataset=features(),
        pipeline_options={"pp": 2, "tp": 2, "tp_plan": "auto", "microbatches": 2},
    )  # fmt: skip
    assert trainer.context.tp_size == 2
    trainer.train()
    sharded = [p for p in trainer.pipe.parameters() if hasattr(p, "placements")]
    assert sharded, "no parameter is sharded over tp"
    return _curve(trainer.state.log_history)


def test_pipeline_trainer_with_auto_tp_plan(tmp_path: Path) -> None:
    from transformers import Trainer

    plain = Trainer(model=M.tiny("llama"), args=_args(str(tmp_path / "plain")),
                    train_dataset=features())  # fmt: skip
    plain.train()
    want = _curve(plain.state.log_history)
    assert len(want) == STEPS
    for got in run_forked(_pipeline_trainer, 4, str(tmp_path / "pipe"), timeout=600):
        assert got == [pytest.approx(w, rel=1e-5) for w in want]


class LitLlama(L.LightningModule):  # type: ignore[misc]
    """The tiny Llama computing its own loss."""

    def __init__(self) -> None:
        super().__init__()
        self.model = M.tiny("llama")
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _lightning(rank: int) -> list[float]:
    lit = LitLlama()
    strategy = PipelineStrategy(tp=2, tp_plan="auto", microbatches=2)
    trainer(max_steps=STEPS, devices=4, strategy=strategy).fit(
        lit, torch.utils.data.DataLoader(Padded(32), batch_size=8)
    )
    return lit.losses


def test_lightning_strategy_with_auto_tp_plan() -> None:
    lit = LitLlama()
    trainer(max_steps=STEPS).fit(lit, shuffled(Padded(32), 8))
    assert len(lit.losses) == STEPS
    for losses in run_forked(_lightning, 4, timeout=600):
        assert losses == [pytest.approx(w, rel=1e-5) for w in lit.losses]
