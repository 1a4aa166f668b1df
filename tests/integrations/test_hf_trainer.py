"""``conveyor.integrations.transformers.PipelineTrainer`` against the plain trainer."""

from __future__ import annotations

import importlib
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

import conveyor
from conveyor.integrations._hf_data import ReplicaLoader
from conveyor.integrations._hf_model import without_cache
from conveyor.integrations.transformers import INIT_KEYS, PipelineTrainer
from conveyor.runtime.microbatch import Needs
from tests.support.helpers import reset_context
from tests.support.trainer_forked import run_forked

ROOT = Path(__file__).resolve().parents[2]


def features(n: int = 48, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Padded rows of 2 to 16 real tokens (8x apart): labels -100 and attention 0 past
    each row's length, so batches and micro-batches count very different tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (n, 16), generator=g)
    lengths = torch.randint(2, 17, (n,), generator=g)
    out = []
    for row, length in zip(ids, lengths.tolist(), strict=True):
        mask = (torch.arange(16) < length).long()
        labels = torch.where(mask.bool(), row, torch.full_like(row, -100))
        out.append({"input_ids": row * mask, "attention_mask": mask, "labels": labels})
    return out


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=None,
            eos_token_id=None,
        )
    )  # fmt: skip


def arguments(out: str, batch: int, accumulate: int = 1, eval_batch: int = 8) -> TrainingArguments:
    """AdamW with linear warm-up and clipping, 20 steps, a loss log line per step."""
    return TrainingArguments(
        output_dir=out, max_steps=20, per_device_train_batch_size=batch,
        per_device_eval_batch_size=eval_batch, gradient_accumulation_steps=accumulate,
        learning_rate=2e-3, lr_scheduler_type="linear", warmup_steps=5, weight_decay=0.01,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
        disable_tqdm=True, seed=3, use_cpu=True,
    )  # fmt: skip


def _curve(history: list[dict[str, Any]], key: str = "loss") -> list[float]:
    return [h[key] for h in history if key in h and "eval_loss" not in h]


def plain(
    tmp: str, batch: int, accumulate: int, eval_batch: int = 8
) -> tuple[Any, float, dict[str, Any]]:
    """The plain trainer in this one process: the curves (loss, grad norm), eval_loss and
    final weights."""
    trainer = Trainer(
        model=gpt2(), args=arguments(tmp, batch, accumulate, eval_batch),
        train_dataset=features(),
        eval_dataset=features(20, seed=1),
    )  # fmt: skip
    trainer.train()
    loss = trainer.evaluate()["eval_loss"]
    history = trainer.state.log_history
    return (_curve(history), _curve(history, "grad_norm")), loss, trainer.model.state_dict()


def plain_reads(tmp: str, batch: int, passes: int) -> list[list[torch.Tensor]]:
    """The ``input_ids`` of each batch the plain trainer's loader gives on one process, for
    ``passes`` passes over it (accelerate's sampler draws the next epoch's permutation on
    each pass)."""
    loader = Trainer(model=gpt2(), args=arguments(tmp, batch),
                     train_dataset=features()).get_train_dataloader()  # fmt: skip
    return [[b["input_ids"] for b in loader] for _ in range(passes)]


def replica_reads(
    loader: Any, passes: int, dp: int, replica: int, global_batches: list[list[torch.Tensor]]
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """What ``loader`` (replica ``replica`` of ``dp``) gives in ``passes`` passes, and its
    share of the one-process loader's ``global_batches``: the ``replica``-th of ``dp``
    contiguous chunks of each, which is what process ``replica`` of the plain trainer on
    ``dp`` processes reads (batch i of ``per_device_train_batch_size`` goes to process
    i mod dp)."""
    got = [[b["input_ids"] for b in loader] for _ in range(passes)]
    want = [[g.chunk(dp)[replica] for g in epoch] for epoch in global_batches]
    return got, want


def _same(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> bool:
    return len(got) == len(want) and all(
        len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        for a, b in zip(got, want, strict=True)
    )


def test_each_replica_reads_its_share_of_the_plain_trainers_batches_epoch_after_epoch(
    tmp_path: Path,
) -> None:
    """The loader of each of 2 replicas, iterated 3 times with no ``set_epoch``: each pass
    a new permutation (epoch 1 is not epoch 0), each replica its own contiguous half of
    the plain trainer's global batch, as the plain trainer's processes read them; after
    ``set_epoch(1)`` the next pass is epoch 1's again."""
    plain = plain_reads(str(tmp_path), 8, 3)
    assert not _same(plain[1:2], plain[:1])  # epoch 1 is shuffled otherwise
    for replica in range(2):
        loader = ReplicaLoader(features(), default_data_collator, batch_size=8, shuffle=True,
                               seed=3, drop_last=False, needs=Needs(True, True), replicas=2,
                               replica=replica, smallest=4)  # fmt: skip
        got, want = replica_reads(loader, 3, 2, replica, plain)
        assert _same(got, want), f"replica {replica}"
        loader.set_epoch(1)
        assert _same(replica_reads(loader, 1, 2, replica, plain[1:])[0], want[1:2])


def _pipelined(rank: int, tmp: str, batch: int, accumulate: int, dp: int) -> dict[str, Any]:
    trainer = PipelineTrainer(
        gpt2(), arguments(tmp, batch, accumulate), train_dataset=features(),
        eval_dataset=features(20, seed=1), pipeline_options={"dp": dp, "microbatches": 2},
    )  # fmt: skip
    # what this rank's loader gives in two passes (before train(), which makes its own)
    loader = trainer.get_train_dataloader()
    reads = [[b.get("input_ids") for b in loader] for _ in range(2)]
    trainer.train()
    loss = trainer.evaluate()["eval_loss"]
    trainer.save_model(f"{tmp}/final")
    history = trainer.state.log_history
    return {"curve": _curve(history), "norms": _curve(history, "grad_norm"), "eval": loss,
            "pp": trainer.context.pp_size, "dp rank": trainer.context.dp_rank,
            "reads": reads}  # fmt: skip


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == 20
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "dp", "batch", "accumulate"),
    [(2, 1, 8, 2), (4, 2, 4, 2)],
    ids=["pp2-accumulate2", "pp2xdp2-accumulate2"],
)
def test_the_loss_curve_equals_the_plain_trainers(
    world: int, dp: int, batch: int, accumulate: int, tmp_path: Path
) -> None:
    """Padded rows of very different lengths, gradient accumulation: the count of tokens
    spans the accumulated batches and the replicas, as the plain trainer counts it. Each
    rank's loader gives its replica's share of the plain trainer's batches, epoch 1 in
    epoch 1's order (the loss curve alone would not tell: swapping what two replicas
    read sums the same gradients)."""
    # The plain trainer on one process with the global batch: per replica x replicas.
    # Its eval batches are the replicas' together too: eval_loss is a mean of batch means.
    (curve, norms), eval_loss, weights = plain(
        str(tmp_path / "plain"), batch * dp, accumulate, 8 * dp
    )
    results = run_forked(_pipelined, world, str(tmp_path / "pipe"), batch, accumulate, dp)
    plain_batches = plain_reads(str(tmp_path / "reads"), batch * dp, 2)
    for r in results:
        assert r["pp"] == 2
        assert _same(r["reads"], [[g.chunk(dp)[r["dp rank"]] for g in e] for e in plain_batches])
        rel, norm_rel = _max_rel(r["curve"], curve), _max_rel(r["norms"], norms)
        print(f"{world} processes, dp {dp}: max relative difference {rel:.2e} (loss), "
              f"{norm_rel:.2e} (grad norm)")  # fmt: skip
        assert rel < 1e-4
        assert norm_rel < 1e-3
        assert r["eval"] == pytest.approx(eval_loss, rel=1e-5)
    assert curve[-1] < curve[0] - 0.1  # it learns
    saved = GPT2LMHeadModel.from_pretrained(tmp_path / "pipe" / "final").state_dict()
    assert saved.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.allclose(saved[name], value, rtol=1e-4, atol=1e-5), name


def _tensor_parallel(rank: int, tmp: str) -> list[float]:
    args = arguments(tmp, 8)
    args.max_steps = 2
    trainer = PipelineTrainer(
        gpt2(), args, train_dataset=features(),
        pipeline_options={"pp": 1, "tp": 2, "microbatches": 2},
    )  # fmt: skip
    assert trainer.context.tp_size == 2
    trainer.train()
    return _curve(trainer.state.log_history)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tensor_parallel_ranks_count_the_tokens_once(tmp_path: Path) -> None:
    """tp=2 (replicated weights: no tp_plan): the losses are the plain trainer's; counting
    the tokens on both tensor-parallel ranks halves them."""
    args = arguments(str(tmp_path / "plain"), 8)
    args.max_steps = 2
    trainer = Trainer(model=gpt2(), args=args, train_dataset=features())
    trainer.train()
    want = _curve(trainer.state.log_history)
    for got in run_forked(_tensor_parallel, 2, str(tmp_path / "pipe")):
        assert got == [pytest.approx(w, rel=1e-4) for w in want]


def test_unknown_pipeline_options_are_one_sentence(tmp_path: Path) -> None:
    reset_context()
    unknown = r"^unknown pipeline_options \['micro'\]; use"
    with pytest.raises(conveyor.ConfigError, match=unknown) as e:
        PipelineTrainer(gpt2(), arguments(str(tmp_path), 4), train_dataset=features(),
                        pipeline_options={"micro": 2})  # fmt: skip
    # Pipeline's own keywords, read from its signature (compile included), less those the
    # trainer sets itself.
    assert str(e.value).endswith(
        "or conveyor.Pipeline's ['microbatches', 'schedule', 'chunks', 'balance', 'fsdp', "
        "'tp_plan', 'memory_limit', 'recompute', 'track_memory', 'compile', 'weights', "
        "'init_seed', 'ep_plan', 'vocab_parallel', 'cp_attention']"
    )


def test_init_keywords_are_conveyor_inits_own() -> None:
    """The trainer's list of init keywords is init's signature: backend included."""
    unknown = r"^unknown pipeline_options \['micro'\]; use conveyor.init's \['pp', 'dp', 'tp', "
    assert INIT_KEYS == ("pp", "dp", "tp", "ep", "backend", "timeout", "cp")
    with pytest.raises(conveyor.ConfigError, match=unknown + r"'ep', 'backend', 'timeout', 'cp'\]"):
        PipelineTrainer(gpt2(), None, pipeline_options={"micro": 2})


def test_without_cache_turns_the_key_value_cache_off() -> None:
    model = gpt2()
    model.config.use_cache = True
    without_cache(model)
    assert model.config.use_cache is False
    without_cache(torch.nn.Linear(2, 2))  # a model without a config is left as it is


@pytest.mark.slow  # near 2 s: the fast lane stays under 90 s
def test_one_process_runs_both_stages_and_saves_a_whole_model(tmp_path: Path) -> None:
    reset_context()
    trainer = PipelineTrainer(
        gpt2(), arguments(str(tmp_path), 8), train_dataset=features(),
        eval_dataset=features(20, seed=1), pipeline_options={"pp": 2, "microbatches": 2},
    )  # fmt: skip
    assert str(trainer.pipe).startswith("Pipeline(1f1b, 2 ranks x 1 chunks = 2 stages")
    assert trainer.pipe.context.pp_size == 2 and not trainer.pipe.context.distributed
    trainer.args.max_steps = 4
    out = trainer.train()
    assert out.global_step == 4 and len(_curve(trainer.state.log_history)) == 4
    assert math.isfinite(trainer.evaluate()["eval_loss"])
    trainer.save_model(str(tmp_path / "final"))
    saved = GPT2LMHeadModel.from_pretrained(tmp_path / "final").state_dict()
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(saved[name], value), name


@pytest.mark.slow  # over 2 s: the fast lane stays under 90 s
def test_evaluate_turns_dropout_off(tmp_path: Path) -> None:
    """Dropout 0.3 everywhere: ``evaluate()`` is deterministic and equals the plain
    trainer's (a model captured as a graph reads its modes from the original model)."""

    def dropping() -> GPT2LMHeadModel:
        model = gpt2()
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.3
        return model

    reset_context()
    want = Trainer(
        model=dropping(), args=arguments(str(tmp_path / "plain"), 8),
        eval_dataset=features(20, seed=1),
    ).evaluate()["eval_loss"]  # fmt: skip
    trainer = PipelineTrainer(
        dropping(), arguments(str(tmp_path / "pipe"), 8), train_dataset=features(),
        eval_dataset=features(20, seed=1), pipeline_options={"pp": 2, "microbatches": 2},
    )  # fmt: skip
    got = [trainer.evaluate()["eval_loss"] for _ in range(2)]
    assert got == [pytest.approx(want, rel=1e-5)] * 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_example_runs_in_one_process(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    reset_context()
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.delenv("RANK", raising=False)
    example = importlib.import_module("hf_trainer")
    tiny = ["--steps", "30", "--layers", "2", "--width", "32", "--length", "16",
            "--batch-size", "8", "--microbatches", "2", "--output", str(tmp_path)]  # fmt: skip
    assert example.main(tiny) == 0
    out = capsys.readouterr().out
    assert "GPT2LMHeadModel in 2 stages" in out
    found = re.search(r"first logged loss ([\d.]+), last ([\d.]+)", out)
    assert found is not None, out
    first, last = float(found.group(1)), float(found.group(2))
    assert last < first - 0.3  # the counting language is learnt
    assert "eval_loss " in out and f"from_pretrained({tmp_path}/final): its own loss" in out
