"""Lightning's train / eval modes reach a network captured with torch.export: its graph
reads dropout's mode from the original network, which the strategy's stand-in sets."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("lightning")

import lightning as L

from conveyor.integrations.lightning import PipelineStrategy


class ShapeBranch(nn.Module):
    """A network with dropout that torch.fx cannot trace (a branch on a shape) and
    torch.export captures on a first batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.drop, self.b = nn.Linear(8, 32), nn.Dropout(0.5), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if x.shape[-1] == 8:
            h = self.drop(h)
        return self.b(h)


class LitDropout(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model, self.loss_fn = ShapeBranch(), F.cross_entropy
        self.val_losses: list[float] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log("val_loss", loss)
        self.val_losses.append(float(loss))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g))


def test_validation_of_an_exported_network_runs_without_dropout() -> None:
    """Lightning validates in eval mode: the exported graph's dropout is off, as in the
    unsplit network's validation."""
    unsplit = LitDropout().eval()
    with torch.no_grad():
        expected = [float(F.cross_entropy(unsplit.model(x), y))
                    for x, y in DataLoader(data(), batch_size=8)]  # fmt: skip
    lit = LitDropout()
    strategy = PipelineStrategy(pp=2, microbatches=2)
    run = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, strategy=strategy)  # fmt: skip
    metrics = run.validate(lit, DataLoader(data(), batch_size=8))
    assert len(run.strategy.pipe.stages) == 2  # split, as a captured graph
    assert lit.val_losses == pytest.approx(expected, rel=1e-6)
    assert metrics[0]["val_loss"] == pytest.approx(sum(expected) / 2, rel=1e-6)
