"""What Lightning's fork / spawn launcher hands the main process after ``fit`` under
``PipelineStrategy``: the trained network, bit for bit, gathered into rank 0 for a network
of at most ``gather_limit`` bytes, else through a temporary conveyor checkpoint that every
rank writes its part of and the main process reads one tensor at a time, then removes.
On ``lightning`` and the standalone ``pytorch_lightning`` (forked workers, ``devices=2``:
the LightningModules of tests/support/lightning_launched.py, whose ``on_train_end`` saves
the workers' trained weights as a conveyor checkpoint to compare with)."""

from __future__ import annotations

import importlib
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

pytest.importorskip("lightning")
pytest.importorskip("pytorch_lightning")

import conveyor
from conveyor.errors import CheckpointError, ConfigError
from conveyor.integrations._lightning.processes import GATHER_LIMIT, fill_from, network_bytes
from tests.support import lightning_launched as script

PACKAGES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}


def strategy_module(package: str) -> Any:
    return importlib.import_module(f"conveyor.integrations.{package}")


def test_the_bound_is_a_documented_number_of_bytes_that_pickles() -> None:
    module = strategy_module("lightning")
    assert module.GATHER_LIMIT == GATHER_LIMIT == 2**30
    assert module.PipelineStrategy(pp=2).gather_limit == GATHER_LIMIT
    strategy = module.PipelineStrategy(pp=2, gather_limit=0, start_method="spawn")
    assert pickle.loads(pickle.dumps(strategy)).gather_limit == 0  # what spawn sends
    for bad in (-1, "1GB", 1.5, True):
        with pytest.raises(ConfigError, match="gather_limit is a number of bytes"):
            module.PipelineStrategy(pp=2, gather_limit=bad)


def test_a_networks_bytes_count_each_tensor_once_meta_too() -> None:
    shared = nn.Linear(4, 4)  # 16 + 4 floats
    net = nn.Sequential(shared, nn.BatchNorm1d(4), shared)  # 4 x 4 floats + 1 int64
    assert network_bytes(net) == 4 * (20 + 16) + 8
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    assert network_bytes(meta) == network_bytes(net)


class Tied(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.embed, self.body, self.head = (
            nn.Embedding(6, width),
            nn.Linear(width, width),
            nn.Linear(width, 6, bias=False),
        )
        self.head.weight = self.embed.weight


def test_the_main_process_fills_its_network_from_the_checkpoint_tied_weights_too(
    tmp_path: Path,
) -> None:
    torch.manual_seed(1)
    trained = Tied()
    conveyor.save(trained, tmp_path / "weights")  # a tied weight is stored once
    torch.manual_seed(2)
    main = Tied()
    main.extra = nn.Linear(2, 2)  # not in the checkpoint: left as it is
    extra = main.extra.weight.clone()
    fill_from(main, tmp_path / "weights")
    for name, value in trained.state_dict().items():
        assert torch.equal(main.state_dict()[name], value), name
    assert main.head.weight is main.embed.weight and torch.equal(main.extra.weight, extra)
    with pytest.raises(CheckpointError, match="build the same network in every process"):
        fill_from(Tied(width=5), tmp_path / "weights")


def fit_forked(package: str, gather_limit: int | None, out: Path) -> tuple[Any, list[Any]]:
    """Fit the script's module on 2 forked workers (pp=2); returns the module as the main
    process has it afterwards, and each ``weights_path`` the launcher handed it."""
    module = strategy_module(package)
    handed: list[Any] = []
    launcher = module.Launcher
    recover = launcher._recover_results_in_main_process

    def spy(self: Any, output: Any, trainer: Any) -> None:
        handed.append(output.weights_path)
        recover(self, output, trainer)

    lit = (script.LitLightning if package == "lightning" else script.LitPytorchLightning)(out)
    options = {} if gather_limit is None else {"gather_limit": gather_limit}
    strategy = module.PipelineStrategy(pp=2, microbatches=2, start_method="fork", timeout=60,
                                       **options)  # fmt: skip
    trainer = importlib.import_module(PACKAGES[package]).Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    environment = dict(os.environ)
    launcher._recover_results_in_main_process = spy
    try:
        trainer.fit(lit, DataLoader(script.data(), batch_size=script.BATCH))
    finally:  # the launcher sets MASTER_PORT here: leave this process as it was
        launcher._recover_results_in_main_process = recover
        os.environ.clear()
        os.environ.update(environment)
    return lit, handed


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
@pytest.mark.parametrize("gather_limit", [0, None], ids=["checkpoint", "gathered"])
def test_the_main_process_gets_the_trained_network_bit_for_bit(
    package: str, gather_limit: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the workers' too
    (tmp_path / "tmp").mkdir()
    initial = script.network().state_dict()
    lit, handed = fit_forked(package, gather_limit, tmp_path)
    trained = conveyor.load_model_state(tmp_path / "ckpt")  # the workers' own weights
    got = lit.model.state_dict()
    assert list(got) == list(initial)
    for name, value in trained.items():
        assert not torch.equal(value, initial[name]), name  # training moved every tensor
        assert torch.equal(got[name], value), name
    [path] = handed
    if gather_limit == 0:  # larger than the bound: a checkpoint directory, then removed
        assert Path(path).name.startswith("conveyor-weights-"), path
        assert not any((tmp_path / "tmp").iterdir())  # Lightning's own file removed too
    else:  # the default bound: Lightning's file of the gathered state dict
        assert Path(path).name == ".temp.ckpt", path
        assert not Path(path).exists()


def lit_lm(package: str, out: Path) -> Any:
    """A LightningModule on ``package`` with a transformers GPT-2 (tied embeddings) that
    computes its own loss, and a callback that publishes it with ``conveyor.save_pretrained``
    (a collective: on every rank) and saves the strategy's checkpoint, at the end of fit."""
    from transformers import GPT2Config, GPT2LMHeadModel

    pl = importlib.import_module(PACKAGES[package])

    class Publish(pl.Callback):  # type: ignore[name-defined,misc]
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            conveyor.save_pretrained(trainer.strategy.pipe, out / "published")
            trainer.save_checkpoint(out / "ckpt")

    class LitLM(pl.LightningModule):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT2LMHeadModel(GPT2Config(
                n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, use_cache=False,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                eos_token_id=None,
            ))  # fmt: skip

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return LitLM(), Publish()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_a_callback_publishes_what_from_pretrained_reads_bit_for_bit(
    package: str, tmp_path: Path
) -> None:
    """Two forked workers (pp=2) publish from ``on_train_end``; the main process gets the
    network back through a checkpoint (``gather_limit=0``), its tied weight too."""
    from transformers import GPT2LMHeadModel

    lit, publish = lit_lm(package, tmp_path)
    initial = {k: v.clone() for k, v in lit.model.state_dict().items()}
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (32, 16), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    strategy = strategy_module(package).PipelineStrategy(
        pp=2, microbatches=2, start_method="fork", timeout=60, gather_limit=0
    )
    trainer = importlib.import_module(PACKAGES[package]).Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[publish],
    )  # fmt: skip
    environment = dict(os.environ)
    try:
        trainer.fit(lit, DataLoader(data, batch_size=8))
    finally:  # the launcher sets MASTER_PORT here: leave this process as it was
        os.environ.clear()
        os.environ.update(environment)
    trained = conveyor.load_model_state(tmp_path / "ckpt")  # the workers' own weights
    published = GPT2LMHeadModel.from_pretrained(tmp_path / "published").state_dict()
    returned = lit.model.state_dict()
    assert set(published) == set(returned) == set(initial)
    for name, value in trained.items():
        assert not torch.equal(value, initial[name]), name
        assert torch.equal(published[name], value), name
        assert torch.equal(returned[name], value), name
    assert returned["lm_head.weight"].data_ptr() == returned["transformer.wte.weight"].data_ptr()
