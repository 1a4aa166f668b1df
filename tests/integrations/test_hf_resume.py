"""``PipelineTrainer`` checkpoints: ``train(resume_from_checkpoint=...)`` goes on exactly as
an uninterrupted run, and ``load_best_model_at_end`` / ``save_total_limit`` do what
transformers documents.

A tiny Llama with attention dropout (so each rank's random state matters), padded rows
(labels -100: the token-averaged loss counts tokens across the accumulated batches and
the replicas), AdamW with a linear warm-up, gradient accumulation 2, 8 steps of 3 per
epoch: stopping at step 4 stops mid-epoch, so resuming skips the batches already trained
on, in the next epoch's order.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow

from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import conveyor.integrations.transformers as T  # noqa: E402
from conveyor.errors import CheckpointError  # noqa: E402
from conveyor.integrations.transformers import PipelineTrainer  # noqa: E402
from tests.integrations.test_hf_trainer import features  # noqa: E402
from tests.support.helpers import reset_context  # noqa: E402
from tests.support.trainer_forked import run_forked  # noqa: E402

STEPS = 8
STOP = 4
LOGGED = ("loss", "grad_norm", "learning_rate")


def llama() -> LlamaForCausalLM:
    """4 layers (2 per pipeline rank), attention dropout 0.1, the same weights each call."""
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        attention_dropout=0.1, use_cache=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def arguments(out: str, batch: int, **extra: Any) -> TrainingArguments:
    """AdamW with linear warm-up and clipping, accumulation 2, a checkpoint every 4 steps."""
    options: dict[str, Any] = dict(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch, gradient_accumulation_steps=2, learning_rate=3e-3,
        lr_scheduler_type="linear", warmup_steps=3, weight_decay=0.01, max_grad_norm=1.0,
        logging_steps=1, save_strategy="steps", save_steps=STOP, report_to=[],
        disable_tqdm=True, seed=3, use_cpu=True,
    )  # fmt: skip
    options.update(extra)
    return TrainingArguments(**options)


class StopAt(TrainerCallback):  # type: ignore[misc]
    """Stops training after step ``step`` (its checkpoint is saved first)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def _trainer(tmp: str, batch: int, options: dict[str, Any], **kwargs: Any) -> PipelineTrainer:
    return PipelineTrainer(
        llama(), arguments(tmp, batch), train_dataset=features(),
        pipeline_options={"microbatches": 2, **options}, **kwargs,
    )  # fmt: skip


def _logged(trainer: PipelineTrainer) -> dict[int, dict[str, float]]:
    """The logged values of each step after the stop."""
    return {
        h["step"]: {k: h[k] for k in LOGGED}
        for h in trainer.state.log_history
        if "loss" in h and h["step"] > STOP
    }


def _weights(trainer: PipelineTrainer) -> dict[str, torch.Tensor]:
    """This rank's tensors (its shards, under FSDP)."""
    state = trainer.pipe.state_dict().items()
    return {k: getattr(v, "to_local", lambda v=v: v)().detach().clone() for k, v in state}


def _resume(
    rank: int, tmp: str, batch: int, options: dict[str, Any], latest: bool
) -> dict[str, Any]:
    whole = _trainer(f"{tmp}/whole", batch, options)
    whole.train()
    stopped = _trainer(f"{tmp}/run", batch, options, callbacks=[StopAt(STOP)])
    stopped.train()
    assert stopped.state.global_step == STOP
    assert sorted(os.listdir(f"{tmp}/run")) == [f"checkpoint-{STOP}"]
    resumed = _trainer(f"{tmp}/run", batch, options)
    where: Any = True if latest else f"{tmp}/run/checkpoint-{STOP}"
    out = resumed.train(resume_from_checkpoint=where)
    assert out.global_step == resumed.state.global_step == STEPS
    want, got = _weights(whole), _weights(resumed)
    assert want.keys() == got.keys()
    return {
        "want": _logged(whole),
        "got": _logged(resumed),
        "weights": max((got[k] - want[k]).abs().max().item() for k in want),
        "seen": resumed.state.num_input_tokens_seen,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("world", "options", "batch", "latest"),
    [(2, {}, 8, False), (4, {"dp": 2}, 4, True), (4, {"dp": 2, "fsdp": True}, 4, False)],
    ids=["pp2", "pp2xdp2-latest", "pp2xdp2-fsdp"],
)
def test_a_resumed_run_equals_the_uninterrupted_one(
    world: int, options: dict[str, Any], batch: int, latest: bool, tmp_path: Path
) -> None:
    """Loss, gradient norm and learning rate of every step after the resume, and the final
    weights, equal the uninterrupted run's within 1e-6."""
    for r in run_forked(_resume, world, str(tmp_path), batch, options, latest, timeout=600):
        assert sorted(r["got"]) == list(range(STOP + 1, STEPS + 1))
        assert r["got"].keys() == r["want"].keys()
        worst = max(abs(r["got"][s][k] - v) for s, d in r["want"].items() for k, v in d.items())
        print(f"{options}: largest difference {worst:.1e} (logged values), "
              f"{r['weights']:.1e} (weights)")  # fmt: skip
        for step, values in r["want"].items():
            for key, value in values.items():
                assert abs(r["got"][step][key] - value) <= 1e-6 * max(1.0, abs(value)), (
                    step, key, r["got"][step][key], value,
                )  # fmt: skip
        assert r["weights"] <= 1e-6
    # The losses after the resume do differ between steps (dropout and data move on).
    losses = [v["loss"] for v in r["want"].values()]
    assert len(set(losses)) == len(losses)


class Processor:
    """A processing class that says which rank saved it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def save_pretrained(self, path: str) -> None:
        Path(path, f"processor-{self.rank}").touch()


def _no_gather(*args: Any) -> Any:
    raise AssertionError("save_model gathered the whole model")


def _best(rank: int, tmp: str, only_model: bool) -> dict[str, Any]:
    T.gather_state_dict = _no_gather  # a forked worker: patched for this run only
    args = arguments(tmp, 8, save_only_model=only_model, **BEST)
    trainer = PipelineTrainer(
        llama(), args, train_dataset=features(),
        eval_dataset=features(16, seed=1), pipeline_options={"microbatches": 2},
        processing_class=Processor(rank),
    )  # fmt: skip
    trainer.train()
    weights = {}
    for name, value in trainer.pipe.state_dict().items():
        weights[name] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return {"best": trainer.state.best_model_checkpoint, "weights": weights}


# The highest eval_loss counts as best: the first evaluation's (the loss falls), so the
# weights loaded at the end are not the last step's.
BEST = dict(
    eval_strategy="steps", eval_steps=2, save_steps=2, save_total_limit=1,
    load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True,
)  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize("only_model", [False, True], ids=["whole", "save_only_model"])
def test_the_best_checkpoint_is_kept_and_loaded_at_the_end(
    only_model: bool, tmp_path: Path
) -> None:
    """pp=2: ``save_total_limit=1`` keeps the best checkpoint (and the newest while
    training), as the plain trainer does; every rank's weights after ``train()`` are the
    best checkpoint's (step 2's, not the last step's). The checkpoints are written
    without gathering the model; rank 0 alone adds the processing class and the training
    arguments. With ``save_only_model`` the best weights come from the safetensors."""
    args = arguments(str(tmp_path / "plain"), 8, save_only_model=only_model, **BEST)
    plain = Trainer(
        model=llama(), args=args,
        train_dataset=features(), eval_dataset=features(16, seed=1),
    )  # fmt: skip
    plain.train()
    kept = sorted(os.listdir(tmp_path / "plain"))
    assert kept == ["checkpoint-2"]  # the last one too is removed at the end
    assert plain.state.best_model_checkpoint == str(tmp_path / "plain" / "checkpoint-2")
    results = run_forked(_best, 2, str(tmp_path / "pipe"), only_model, timeout=600)
    assert sorted(os.listdir(tmp_path / "pipe")) == kept
    files = set(os.listdir(tmp_path / "pipe" / "checkpoint-2"))
    assert {"processor-0", "training_args.bin", "config.json"} <= files
    assert "processor-1" not in files
    assert ("pipeline" in files) is not only_model
    best = LlamaForCausalLM.from_pretrained(tmp_path / "pipe" / "checkpoint-2").state_dict()
    for r in results:
        assert r["best"] == str(tmp_path / "pipe" / "checkpoint-2")
        assert r["weights"]
        for name, value in r["weights"].items():
            assert torch.equal(value, best[name]), name


def test_a_checkpoint_without_pipeline_state_is_refused(tmp_path: Path) -> None:
    """One process: a checkpoint of the weights alone (another trainer's, or
    save_only_model's) cannot be resumed, in one sentence."""
    reset_context()
    weights_only = tmp_path / "checkpoint-4"
    weights_only.mkdir()
    trainer = PipelineTrainer(
        llama(), arguments(str(tmp_path), 8), train_dataset=features(),
        pipeline_options={"pp": 2, "microbatches": 2},
    )  # fmt: skip
    with pytest.raises(CheckpointError, match=r"^cannot resume from .*checkpoint-4: it has no "):
        trainer.train(resume_from_checkpoint=True)
