"""``conveyor.integrations.lightning.PipelineStrategy`` against Lightning's own one-process run."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

pytest.importorskip("lightning")
pytest.importorskip("transformers")

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from transformers import GPT2Config, GPT2LMHeadModel

import conveyor
from conveyor.integrations.lightning import TRAINER_STATE, PipelineStrategy
from tests.support.trainer_forked import run_forked


# ---------------------------------------------------------------------- models and data
class LitMLP(L.LightningModule):
    """A plain LightningModule: its network in self.model, its loss in self.loss_fn."""

    def __init__(self, lr: float = 0.2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
        )
        self.loss_fn = F.cross_entropy
        self.lr = lr
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log("train_loss", loss)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log("val_loss", loss)
        self.val_losses.append(float(loss))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])

    def configure_optimizers(self) -> Any:
        # SGD: a gradient off by a factor moves the weights by that factor (Adam would not)
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=8, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def mlp_data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


class Padded(Dataset[dict[str, torch.Tensor]]):
    """Rows of 2 to 16 real tokens: labels -100 and attention 0 past each row's length,
    so batches and micro-batches count very different tokens."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(1, 64, (n, 16), generator=g)
        lengths = torch.randint(2, 17, (n, 1), generator=g)
        self.mask = (torch.arange(16) < lengths).long()
        self.ids = ids * self.mask
        self.labels = torch.where(self.mask.bool(), ids, torch.full_like(ids, -100))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


class LitLM(L.LightningModule):
    """A transformers causal LM computing its own loss: no loss code at all."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(
            GPT2Config(
                n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                bos_token_id=None, eos_token_id=None,
            )
        )  # fmt: skip
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return self.model(**inputs).logits

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def shuffled(data: Any, batch: int) -> DataLoader[Any]:
    """The order of Lightning's sampler for several processes (it shuffles training data
    with a DistributedSampler, seed 0), in one process: replica r of R reads rows r, r + R,
    ... of it, so the replicas' batches together are this loader's."""
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(data, batch_size=batch, sampler=sampler)


def trainer(**kwargs: Any) -> Any:
    """A quiet CPU trainer."""
    options: dict[str, Any] = {
        "accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }  # fmt: skip
    options.update(kwargs)
    return L.Trainer(**options)


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) >= 10, (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


MLP_FIT = {"max_epochs": 4, "accumulate_grad_batches": 2, "gradient_clip_val": 0.3}
LM_FIT = {"max_epochs": 2, "accumulate_grad_batches": 2, "gradient_clip_val": 1.0}


def plain_mlp(batch: int) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    lit = LitMLP()
    trainer(**MLP_FIT).fit(lit, shuffled(mlp_data(), batch),
                           DataLoader(mlp_data(16), batch_size=8))  # fmt: skip
    return lit.losses, lit.model.state_dict(), lit.val_losses


# ---------------------------------------------------------------------- one process
def test_one_process_pp2_equals_lightning_and_saves_a_loadable_checkpoint(tmp_path: Path) -> None:
    """Both stages in this process: the same losses (train, validation), clipping, a step
    LR scheduler, CSV and TensorBoard logs, predict, and a checkpoint the unsplit module
    loads."""
    losses, weights, val = plain_mlp(8)
    lit = LitMLP()
    run = trainer(
        **MLP_FIT, strategy=PipelineStrategy(pp=2, microbatches=2),
        logger=[CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")],
        log_every_n_steps=1,
    )  # fmt: skip
    run.fit(lit, shuffled(mlp_data(), 8), DataLoader(mlp_data(16), batch_size=8))
    assert run.strategy.pipe.context.pp_size == 2 and len(run.strategy.pipe.stages) == 2
    rel = max_rel(lit.losses, losses)
    assert rel < 1e-6, rel
    assert lit.val_losses == pytest.approx(val, rel=1e-6)
    assert sum(losses[-6:]) < sum(losses[:6]) - 0.5  # it learns
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert logged == pytest.approx(losses[1::2], rel=1e-6)  # one line per optimizer step
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    # Another trainer (and strategy) validates the trained module: it splits it anew.
    metrics = trainer(strategy=PipelineStrategy(pp=2)).validate(
        lit, DataLoader(mlp_data(16), batch_size=8)
    )
    assert metrics[0]["val_loss"] == pytest.approx(sum(val[-2:]) / 2, rel=1e-6)
    # Predict: the network's output for the whole batch.
    out = run.predict(lit, DataLoader(mlp_data(16), batch_size=8))
    plain = LitMLP()
    plain.model.load_state_dict(weights)
    with torch.no_grad():
        expected = plain.model(mlp_data(16).tensors[0])
    assert torch.allclose(torch.cat(out), expected, rtol=1e-5, atol=1e-6)
    # A checkpoint: a directory of conveyor's checkpoint and Lightning's state.
    run.save_checkpoint(tmp_path / "last.ckpt")
    assert (tmp_path / "last.ckpt" / TRAINER_STATE).is_file()
    assert conveyor.checkpoint.exists(tmp_path / "last.ckpt")
    unsplit = LitMLP()
    unsplit.model.load_state_dict(conveyor.load_model_state(tmp_path / "last.ckpt"))
    for name, value in weights.items():
        assert torch.allclose(unsplit.model.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_bf16_mixed_runs_as_conveyors_autocast() -> None:
    reference = LitMLP()
    data = DataLoader(mlp_data(), batch_size=8)
    trainer(max_steps=4, precision="bf16-mixed").fit(reference, data)
    lit = LitMLP()
    run = trainer(max_steps=4, precision="bf16-mixed", strategy=PipelineStrategy(pp=2))
    run.fit(lit, DataLoader(mlp_data(), batch_size=8))
    assert run.strategy.pipe.options.autocast is torch.bfloat16
    assert lit.losses == pytest.approx(reference.losses, rel=2e-2)


class Manual(LitMLP):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class Outside(LitMLP):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)


class NoNetwork(LitMLP):
    def __init__(self) -> None:
        super().__init__()
        self.net = self.model
        del self.model


class Metric(LitMLP):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.model(x)
        self.log("accuracy", (out.argmax(-1) == y).float().mean())
        return self.loss_fn(out, y)


class Branchy(nn.Module):
    """A network torch.fx cannot trace (a branch on a value): split on a first batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) if x.sum() > 0 else x)


class LogsFirst(LitMLP):
    def __init__(self) -> None:
        super().__init__()
        self.model = Branchy()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("lr", 0.1)  # outside Lightning's loop (the first-batch run) it cannot
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    ("module", "strategy", "message"),
    [
        (Manual, {}, r"^PipelineStrategy runs Lightning's automatic optimization .*; remove"),
        (Outside, {}, r"^PipelineStrategy trains self.model only, .*\['head.weight', "),
        (NoNetwork, {}, r"found in self.model; put the network there .*\(module_attr="),
        (Metric, {}, r"^output.argmax: under PipelineStrategy the network's output exists"),
        (
            LogsFirst,
            {},
            r"^PipelineStrategy ran training_step on a first batch to find the "
            r"network's inputs and it raised .*; pass sample=\(inputs, targets\)",
        ),
    ],
    ids=[
        "manual-optimization",
        "parameters-outside",
        "no-network",
        "output-used",
        "first-batch-run-fails",
    ],
)
def test_what_it_cannot_split_is_one_sentence(module: Any, strategy: Any, message: str) -> None:
    with pytest.raises(conveyor.ConfigError, match=message):
        trainer(max_steps=1, strategy=PipelineStrategy(pp=2, **strategy)).fit(
            module(), DataLoader(mlp_data(), batch_size=8)
        )


def test_unsupported_options_are_one_sentence() -> None:
    with pytest.raises(conveyor.ConfigError, match=r"^PipelineStrategy does not know \['micro'\]"):
        PipelineStrategy(micro=2)
    with pytest.raises(conveyor.ConfigError, match=r"^PipelineStrategy does not take loss_fn="):
        PipelineStrategy(loss_fn=F.cross_entropy)
    with pytest.raises(conveyor.ConfigError, match=r"runs precision '32-true' and 'bf16-mixed'"):
        trainer(strategy=PipelineStrategy(pp=2), precision="64-true")


def test_pipeline_keywords_come_from_its_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """A keyword Pipeline gains (weights=, init_seed=, ...) is taken without a change here."""
    from conveyor.pipeline import Pipeline

    def init(self: Any, model: Any, *, loss_fn: Any, microbatches: int, init_seed: int = 0,
             fresh_option: bool = False) -> None: ...  # fmt: skip

    monkeypatch.setattr(Pipeline, "__init__", init)
    strategy = PipelineStrategy(pp=2, tp=1, init_seed=3, fresh_option=True)
    assert strategy.pipeline_options == {"init_seed": 3, "fresh_option": True}
    assert strategy.init_options == {"pp": 2, "dp": 1, "tp": 1}
    with pytest.raises(conveyor.ConfigError, match=r"does not know \['schedule'\]"):
        PipelineStrategy(schedule="gpipe")  # gone from this Pipeline


class MetaMLP(LitMLP):
    """LitMLP's network built on the meta device: no process holds it whole."""

    def __init__(self) -> None:
        super().__init__()
        with conveyor.empty_weights():
            self.model = nn.Sequential(
                nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
            )


def test_a_network_on_the_meta_device_is_initialized_per_stage() -> None:
    """PipelineStrategy(init_seed=...) passes Pipeline's keywords: each stage gets the
    values conveyor.materialize gives the unsplit network, and trains as it does."""
    reference = MetaMLP()
    conveyor.materialize(reference.model, init_seed=7)
    trainer(max_steps=6).fit(reference, DataLoader(mlp_data(), batch_size=8))
    lit = MetaMLP()
    run = trainer(max_steps=6, strategy=PipelineStrategy(pp=2, init_seed=7, weights=None))
    run.fit(lit, DataLoader(mlp_data(), batch_size=8))
    assert run.strategy.pipe.context.pp_size == 2
    assert lit.losses == pytest.approx(reference.losses, rel=1e-6)


@pytest.mark.slow
def test_compiled_stages_train_as_lightnings_own_run() -> None:
    """Pipeline keywords pass through: compile=True runs each stage through torch.compile."""
    reference = LitMLP()
    trainer(max_steps=4).fit(reference, DataLoader(mlp_data(), batch_size=8))
    lit = LitMLP()
    run = trainer(max_steps=4, strategy=PipelineStrategy(pp=2, microbatches=2, compile=True))
    run.fit(lit, DataLoader(mlp_data(), batch_size=8))
    assert run.strategy.pipe.compile_stats is not None
    assert lit.losses == pytest.approx(reference.losses, rel=1e-5)


# ---------------------------------------------------------------------- several processes
def _mlp_worker(rank: int, world: int, dp: int, tmp: str) -> dict[str, Any]:
    """pp=2 (x dp): with dp=1, 2 epochs, a checkpoint, and 2 more epochs resumed from it."""
    lit = LitMLP()
    data = DataLoader(mlp_data(), batch_size=8 // dp)
    val = DataLoader(mlp_data(16), batch_size=8 // dp)
    strategy = PipelineStrategy(dp=dp, microbatches=2, fsdp=dp > 1)
    if dp > 1:  # replicas with FSDP2: sharded parameters, gradients and optimizer state
        run = trainer(**MLP_FIT, devices=world, strategy=strategy)
        run.fit(lit, data, val)
        # every rank, the first stage's too, gets its replica's predictions
        out = torch.cat(run.predict(lit, DataLoader(mlp_data(16), batch_size=4)))
        return {"losses": lit.losses, "val": lit.val_losses, "predict": out, "dp_rank": rank // 2}
    saves = ModelCheckpoint(dirpath=f"{tmp}/ckpt", save_last=True)
    first = trainer(**{**MLP_FIT, "max_epochs": 2}, devices=world, strategy=strategy,
                    enable_checkpointing=True, callbacks=[saves])  # fmt: skip
    first.fit(lit, data, val)
    losses, vals = list(lit.losses), list(lit.val_losses)
    again = LitMLP(lr=1.0)  # the checkpoint's learning rate wins
    saves = ModelCheckpoint(dirpath=f"{tmp}/ckpt", save_last=True)
    resumed = trainer(**MLP_FIT, devices=world, strategy=PipelineStrategy(microbatches=2),
                      enable_checkpointing=True, callbacks=[saves])  # fmt: skip
    resumed.fit(again, data, val, ckpt_path=f"{tmp}/ckpt/last.ckpt")
    return {"losses": losses + again.losses, "val": vals + again.val_losses}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("world", "dp"), [(2, 1), (4, 2)], ids=["pp2-resumed", "pp2xdp2"])
def test_mlp_loss_curve_equals_lightnings(world: int, dp: int, tmp_path: Path) -> None:
    losses, weights, val = plain_mlp(8)
    for r in run_forked(_mlp_worker, world, world, dp, str(tmp_path)):
        rel = max_rel(r["losses"], losses)
        print(f"MLP, {world} processes, dp {dp}: max relative difference {rel:.2e}")
        assert rel < 1e-6
        assert r["val"] == pytest.approx(val, rel=1e-6)
        if dp > 1:
            unsplit = LitMLP()
            unsplit.model.load_state_dict(weights)
            with torch.no_grad():
                expected = unsplit.model(mlp_data(16).tensors[0][r["dp_rank"] :: dp])
            assert torch.allclose(r["predict"], expected, rtol=1e-5, atol=1e-6)
    if dp == 1:  # the resumed run's checkpoints load into the unsplit module
        unsplit = LitMLP()
        unsplit.model.load_state_dict(conveyor.load_model_state(tmp_path / "ckpt" / "last.ckpt"))
        for name, value in weights.items():
            assert torch.allclose(unsplit.model.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def _lm_worker(rank: int, world: int, dp: int) -> list[float]:
    lit = LitLM()
    strategy = PipelineStrategy(dp=dp, microbatches=2, schedule="zb-h1")
    trainer(**LM_FIT, devices=world, strategy=strategy).fit(
        lit, DataLoader(Padded(96), batch_size=8 // dp)
    )
    return lit.losses


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("world", "dp"), [(2, 1), (4, 2)], ids=["pp2", "pp2xdp2"])
def test_causal_lm_with_accumulation_equals_lightnings(world: int, dp: int) -> None:
    """Padded rows of very different lengths, accumulate_grad_batches=2: each batch's loss
    is its tokens' mean over the replicas, and each counts half, as in Lightning's run."""
    lit = LitLM()
    trainer(**LM_FIT).fit(lit, shuffled(Padded(96), 8))
    assert max(lit.losses) - min(lit.losses) > 0.05  # random tokens: it moves, not learns
    for losses in run_forked(_lm_worker, world, world, dp):
        rel = max_rel(losses, lit.losses)
        print(f"GPT-2, {world} processes, dp {dp}: max relative difference {rel:.2e}")
        assert rel < 1e-6


@pytest.mark.multiprocess
@pytest.mark.slow
def test_lightnings_fork_launcher_returns_the_whole_network() -> None:
    """devices=2 started by Lightning itself (start_method='fork'); the main process gets
    the whole trained network back."""
    losses, weights, _ = plain_mlp(8)
    lit = LitMLP()
    run = trainer(**MLP_FIT, devices=2,
                  strategy=PipelineStrategy(pp=2, microbatches=2, start_method="fork"))  # fmt: skip
    environment = dict(os.environ)
    try:
        run.fit(lit, DataLoader(mlp_data(), batch_size=8), DataLoader(mlp_data(16), batch_size=8))
    finally:  # the launcher sets MASTER_PORT here: leave this process as it was
        os.environ.clear()
        os.environ.update(environment)
    assert math.isclose(float(run.callback_metrics["train_loss"]), losses[-1], rel_tol=1e-6)
    for name, value in weights.items():
        assert torch.allclose(lit.model.state_dict()[name], value, rtol=1e-5, atol=1e-6), name


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_fork_launcher_leaves_a_meta_network_unassembled(tmp_path: Path) -> None:
    """A network built on the meta device is never gathered whole into the main process;
    its trained weights are in the last checkpoint, which the unsplit network loads."""
    reference = MetaMLP()
    conveyor.materialize(reference.model, init_seed=7)
    trainer(max_steps=4).fit(reference, shuffled(mlp_data(), 8))  # as Lightning's sampler
    lit = MetaMLP()
    run = trainer(max_steps=4, devices=2, default_root_dir=tmp_path,
                  strategy=PipelineStrategy(pp=2, microbatches=2, init_seed=7,
                                            start_method="fork"))  # fmt: skip
    environment = dict(os.environ)
    try:
        run.fit(lit, DataLoader(mlp_data(), batch_size=8))
    finally:  # the launcher sets MASTER_PORT here: leave this process as it was
        os.environ.clear()
        os.environ.update(environment)
    assert all(p.is_meta for p in lit.model.parameters())  # nothing assembled here
    assert math.isclose(float(run.callback_metrics["train_loss"]), reference.losses[-1],
                        rel_tol=1e-6)  # fmt: skip


@pytest.mark.slow
def test_a_checkpoint_validates_and_predicts_in_a_new_trainer(tmp_path: Path) -> None:
    """A network captured on a batch (transformers): fit saves, then new trainers split it
    on a validation batch and on a predict batch, and load the checkpoint."""
    lit = LitLM()
    fit = trainer(max_steps=3, strategy=PipelineStrategy(pp=2, microbatches=2))
    fit.fit(lit, DataLoader(Padded(24), batch_size=8))
    fit.save_checkpoint(tmp_path / "lm.ckpt")
    unsplit = LitLM()
    unsplit.model.load_state_dict(conveyor.load_model_state(tmp_path / "lm.ckpt"))
    batches = list(DataLoader(Padded(16, seed=5), batch_size=8))
    with torch.no_grad():
        expected = sum(float(unsplit.model(**b).loss) for b in batches) / len(batches)
        logits = torch.cat([unsplit.predict_step(b, 0) for b in batches])
    val = DataLoader(Padded(16, seed=5), batch_size=8)
    new = trainer(strategy=PipelineStrategy(pp=2, microbatches=2))
    metrics = new.validate(LitLM(), val, ckpt_path=tmp_path / "lm.ckpt")
    assert metrics[0]["val_loss"] == pytest.approx(expected, rel=1e-5)
    new = trainer(strategy=PipelineStrategy(pp=2, microbatches=2))
    out = new.predict(LitLM(), val, ckpt_path=tmp_path / "lm.ckpt")
    assert torch.allclose(torch.cat(out), logits, rtol=1e-4, atol=1e-5)


def test_the_standalone_pytorch_lightning_package_takes_it_too() -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from conveyor.integrations.pytorch_lightning import PipelineStrategy as PLStrategy

    class Module(pl.LightningModule):  # LitMLP's network and steps, on the other package
        def __init__(self) -> None:
            super().__init__()
            self.model, self.loss_fn, self.losses = LitMLP().model, F.cross_entropy, []

        training_step = LitMLP.training_step

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.05)

    reference = LitMLP()
    reference.configure_optimizers = lambda: torch.optim.AdamW(reference.parameters(), lr=0.05)
    trainer(max_steps=6).fit(reference, DataLoader(mlp_data(), batch_size=8))
    module = Module()
    run = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, strategy=PLStrategy(pp=2))  # fmt: skip
    assert isinstance(run.strategy, pl.strategies.ParallelStrategy)
    run.fit(module, DataLoader(mlp_data(), batch_size=8))
    assert module.losses == pytest.approx(reference.losses, rel=1e-6)


class LitTokens(LitLM):
    """The LM with an exact token loss of its own: a pair (total, count)."""

    def __init__(self) -> None:
        super().__init__()
        self.loss_fn = conveyor.losses.TokenCrossEntropy(shift=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss = self.loss_fn(out, batch["labels"])
        if isinstance(loss, tuple):  # one process: the pair is ours to divide
            loss = loss[0] / loss[1]
        self.log("train_loss", loss)
        self.losses.append(float(loss.detach()))
        return loss


@pytest.mark.slow
def test_a_pair_loss_with_accumulation_equals_lightnings() -> None:
    """TokenCrossEntropy's (total, count) over padded rows, cut into micro-batches of very
    different token counts, accumulated over 2 batches: the batch's token mean, exactly."""
    reference = LitTokens()
    trainer(**LM_FIT).fit(reference, DataLoader(Padded(48), batch_size=8))
    lit = LitTokens()
    run = trainer(**LM_FIT, strategy=PipelineStrategy(pp=2, microbatches=4, schedule="gpipe"))
    run.fit(lit, DataLoader(Padded(48), batch_size=8))
    rel = max_rel(lit.losses, reference.losses)
    print(f"TokenCrossEntropy in one process, pp 2: max relative difference {rel:.2e}")
    assert rel < 1e-6
