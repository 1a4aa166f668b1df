"""A training script that Lightning itself starts on ``devices=2`` processes (for
tests/integrations/test_lightning_launchers.py).

``python lightning_launched.py PACKAGE START_METHOD OUT``: PACKAGE ``lightning`` or
``pytorch_lightning``, START_METHOD ``popen`` (Lightning runs this script again for rank
1) or ``spawn`` (workers started from this process, which gets the whole trained network
back). Each rank writes its step losses to ``OUT/losses-RANK.pt``; the ranks write a
checkpoint to ``OUT/ckpt``; with spawn this process writes the network it got back to
``OUT/returned.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as lpl
import pytorch_lightning as ppl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

EPOCHS = 2
BATCH = 8
LR = 0.2


def network() -> nn.Sequential:
    """The network, the same in every process."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def optimizer(params: Any) -> torch.optim.Optimizer:
    # SGD: a gradient off by a factor moves the weights by that factor
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


class Steps:
    """The LightningModule's steps, for either package's LightningModule."""

    model: nn.Module
    loss_fn: Any
    losses: list[float]
    out: Path
    trainer: Any

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return optimizer(self.parameters())  # type: ignore[attr-defined]

    def on_train_end(self) -> None:
        torch.save(self.losses, self.out / f"losses-{self.trainer.global_rank}.pt")
        self.trainer.save_checkpoint(self.out / "ckpt")


class LitLightning(Steps, lpl.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.model, self.loss_fn, self.losses, self.out = network(), F.cross_entropy, [], out


class LitPytorchLightning(Steps, ppl.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.model, self.loss_fn, self.losses, self.out = network(), F.cross_entropy, [], out


def main(package: str, start_method: str, out: Path) -> None:
    torch.set_num_threads(1)
    if package == "lightning":
        from conveyor.integrations.lightning import PipelineStrategy

        module: Any = LitLightning(out)
        trainer_class: Any = lpl.Trainer
    else:
        from conveyor.integrations.pytorch_lightning import PipelineStrategy as PLStrategy

        module, trainer_class, PipelineStrategy = LitPytorchLightning(out), ppl.Trainer, PLStrategy
    strategy = PipelineStrategy(pp=2, microbatches=2, start_method=start_method, timeout=120)
    trainer = trainer_class(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=EPOCHS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data(), batch_size=BATCH))
    if start_method == "spawn":  # this process is no worker: it got the network back
        torch.save(module.model.state_dict(), out / "returned.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
