"""Meta-device pipelines compose with the rest of conveyor as real ones do (one process):
recompute and autocast, ``conveyor.Trainer`` resuming, compiled stages, and
``PipelineTrainer`` loading a checkpoint into a model built under ``empty_weights``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import conveyor
from tests.weights.test_big_model import _mlp, llama, padded_tokens

transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------ composes with
# in the slow lane: two captures of a transformers model, about 3.5 s
@pytest.mark.slow
def test_options_run_on_a_meta_pipeline_as_on_a_real_one() -> None:
    """recompute and autocast together (one capture of each model, not one per option)."""
    options: dict[str, Any] = {"recompute": True, "autocast": torch.bfloat16}
    model = llama()
    real = conveyor.materialize(copy.deepcopy(model), init_seed=2)
    batch = padded_tokens()
    conveyor.init(pp=2)
    kw = {"loss_fn": None, "microbatches": 3, "schedule": "zb-h1", "sample": (batch, None)}
    meta_pipe = conveyor.Pipeline(model, init_seed=2, **kw, **options)
    conveyor.init(pp=2)
    real_pipe = conveyor.Pipeline(real, **kw, **options)
    loss = float(meta_pipe.train_step(batch))
    assert loss == float(real_pipe.train_step(batch))
    with torch.autocast("cpu", dtype=options.get("autocast", torch.float32),
                        enabled="autocast" in options):  # fmt: skip
        assert loss == pytest.approx(float(real(**batch).loss), rel=1e-2)
    want = dict(real_pipe.named_parameters())
    for n, p in meta_pipe.named_parameters():
        assert torch.equal(p.grad, want[n].grad), n


def _classifier() -> nn.Sequential:
    with conveyor.empty_weights():
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                             nn.Linear(16, 4))  # fmt: skip


def test_the_trainer_resumes_a_meta_pipeline_exactly(tmp_path: Path) -> None:
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(2)
    x = torch.randn(48, 8, generator=g)
    data = TensorDataset(x, x[:, :4].argmax(dim=1))

    def trainer(checkpoints: Path | None) -> conveyor.Trainer:
        pipe = conveyor.Pipeline(
            _classifier(), loss_fn=F.cross_entropy, microbatches=2, balance=[2, 3],
            context=conveyor.init(pp=2), init_seed=6,
        )  # fmt: skip
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        every = 3 if checkpoints is not None else None
        return conveyor.Trainer(pipe, opt, checkpoint_dir=checkpoints, checkpoint_every=every)

    torch.manual_seed(1)
    straight = trainer(None).fit(data, batch_size=8, max_steps=7)
    torch.manual_seed(1)
    trainer(tmp_path).fit(data, batch_size=8, max_steps=4)
    torch.manual_seed(99)
    rest = trainer(tmp_path).fit(data, batch_size=8, max_steps=7, resume=True)
    assert rest.start_step == 4 and rest.losses == straight.losses[4:]  # saved at the end


@pytest.mark.slow
def test_compiled_stages_of_a_meta_pipeline() -> None:
    model = _mlp()
    real = conveyor.materialize(copy.deepcopy(model), init_seed=8)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    kw: dict[str, Any] = {"loss_fn": F.mse_loss, "microbatches": 2, "schedule": "zb-h1",
                          "compile": True}  # fmt: skip
    meta_pipe = conveyor.Pipeline(model, context=conveyor.init(pp=2), init_seed=8, **kw)
    real_pipe = conveyor.Pipeline(real, context=conveyor.init(pp=2), **kw)
    assert float(meta_pipe.train_step(x, y)) == float(real_pipe.train_step(x, y))
    want = dict(real_pipe.named_parameters())
    for n, p in meta_pipe.named_parameters():
        assert torch.equal(p.grad, want[n].grad), n


@pytest.mark.slow
def test_the_transformers_trainer_loads_a_meta_model_from_its_checkpoint(tmp_path: Path) -> None:
    """PipelineTrainer(model built under empty_weights, pipeline_options={"weights": dir})
    trains as the same trainer on the real model loaded from that checkpoint."""
    from conveyor.integrations.transformers import PipelineTrainer
    from tests.integrations.test_hf_trainer import arguments, features, gpt2

    saved = gpt2()
    saved.save_pretrained(tmp_path / "ckpt", max_shard_size="50KB")

    def curve(model: nn.Module, options: dict[str, Any]) -> list[float]:
        trainer = PipelineTrainer(
            model, arguments(str(tmp_path / "out"), 4), train_dataset=features(),
            pipeline_options={"pp": 2, **options},
        )  # fmt: skip
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    with conveyor.empty_weights():
        meta = transformers.GPT2LMHeadModel(saved.config)
    got = curve(meta, {"weights": str(tmp_path / "ckpt")})
    want = curve(transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ckpt"), {})
    assert got == want and len(got) == 20
