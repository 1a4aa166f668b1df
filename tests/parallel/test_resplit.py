"""Re-splitting a trained model: a model a pipeline has trained (its experts, vocabulary
rows or tensor-parallel / FSDP shards left as DTensors on the user's modules) given to a
new ``Pipeline`` of the same or another layout, or saved and loaded, trains on exactly
from the trained values (conveyor/partition/resplit.py).

Each check trains step 1 on one pipeline, then step 2 (and 3) on a second pipeline over
the same model object, and compares every step's whole-batch loss and every gradient with
the unsplit model trained the same way (SGD between the steps); 4 processes, gloo:

- a tiny Mixtral on pp 2 x dp 2 x ep 2 (padded rows of other lengths per step, its own
  token loss): again at ep 2; at ep 1; from ep 2 under FSDP to ep 2 without; through
  ``conveyor.save`` / ``conveyor.load`` into a pipeline at ep 1, whose own save then holds
  the unsplit model's trained values, as does ``conveyor.save`` of the user's model (each
  rank writing what it trained); and experts frozen before ep shards them stay
  frozen (issue 45: no gradient, no change after an optimizer step, also in the second
  pipeline);
- the fx-traced TinyGPT on pp 2 x dp 2 with its vocabulary rows split (vocab_parallel),
  then again with and without vocab_parallel;
- the GPT example (fx, tied embedding, token loss over padded rows) on pp 2 x dp 2 under
  ``fsdp="reshard"`` (its blocks FSDP units), then ``fsdp=True``, then without FSDP; and on
  pp 2 x tp 2 with its tp_plan, then on pp 2 without tensor parallelism; between them,
  pp 2 x dp 2, which would give two processes a stage they did not train, is refused on
  every rank, and leaves the model as it was.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import conveyor
from conveyor.experts import is_expert_parameter
from conveyor.losses import TokenCrossEntropy
from tests.parallel.test_moe_pipeline import (
    DP,
    EP,
    LR,
    MICRO,
    PP,
    model_of,
    reference,
    shards_of,
    train,
)  # fmt: skip
from tests.support import distributed
from tests.support.captures import captured
from tests.support.helpers import assert_close, sgd_trace, tied_names
from tests.vocab.models import TinyGPT, padded_batch

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import gpt  # noqa: E402  (examples/gpt.py: the GPT example and its tensor-parallel plan)

TOL = 1e-5
FROZEN = "model.layers.0.mlp.experts."  # the expert collection frozen in the frozen run


# ------------------------------------------------------------------------------ experts
def _pipe(model: torch.nn.Module, sample: Any, **options: Any) -> conveyor.Pipeline:
    return conveyor.Pipeline(model, loss_fn=None, microbatches=MICRO, sample=(sample, None),
                             **options)  # fmt: skip


def _experts_world(rank: int, path: str, models: list[torch.nn.Module]) -> dict[str, Any]:
    ctx = conveyor.init(pp=PP, dp=DP, ep=EP)
    shards = shards_of(ctx.dp_rank)
    out: dict[str, Any] = {}
    again, to_ep1, from_fsdp, saved, frozen = models
    # ep 2, then ep 2 again over the same model
    out["again"] = train(_pipe(again, shards[0]), shards[:1])
    out["again"] += train(_pipe(again, shards[0]), shards[1:])
    conveyor.save(again, f"{path}/model")  # the user's model: each rank what it trained
    # ep 2 under FSDP, then ep 2 without
    out["fsdp"] = train(_pipe(from_fsdp, shards[0], fsdp=True), shards[:1])
    out["fsdp"] += train(_pipe(from_fsdp, shards[0]), shards[1:])
    # ep 2, then ep 1 (a new context over the same processes: the same pipeline ranks)
    out["ep1"] = train(_pipe(to_ep1, shards[0]), shards[:1])
    first = _pipe(saved, shards[0])
    out["saved"] = train(first, shards[:1])
    conveyor.save(first, f"{path}/ep2", step=1)
    one = conveyor.init(pp=PP, dp=DP)
    second = _pipe(to_ep1, shards[0], context=one)
    out["ep1 experts whole"] = all(not is_expert_parameter(p) for p in second.parameters())
    out["ep1"] += train(second, shards[1:])
    # the checkpoint ep 2 saved, loaded into a fresh model's pipeline at ep 1
    loaded = _pipe(model_of("mixtral", False), shards[0], context=one)
    out["loaded step"] = conveyor.load(loaded, f"{path}/ep2")
    out["saved"] += train(loaded, shards[1:])
    conveyor.save(loaded, f"{path}/ep1", step=2)
    # experts frozen before ep shards them: no gradient, no change, in both pipelines
    for name, p in frozen.named_parameters():
        if name.startswith(FROZEN):
            p.requires_grad_(False)
    out["frozen"] = []
    for context in (ctx, ctx, one):
        pipe = _pipe(frozen, shards[0], context=context)
        held = {n: p for n, p in pipe.named_parameters() if n.startswith(FROZEN)}
        before = {n: _whole(p) for n, p in held.items()}
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
        pipe.train_step(shards[0], None)
        opt.step()
        out["frozen"].append({
            n: (p.requires_grad, p.grad is None, torch.equal(_whole(p), before[n]))
            for n, p in held.items()
        })  # fmt: skip
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach().clone()


def test_a_model_ep_trained_is_split_again_exactly(tmp_path: Path) -> None:
    """Mixtral, pp 2 x dp 2 x ep 2 for step 1; step 2 on a second pipeline: ep 2 again,
    ep 1, from FSDP, or through a checkpoint; frozen experts stay frozen."""
    want = reference("mixtral", False)
    batch = shards_of(0)[0]
    models = [captured(model_of("mixtral", False), batch, MICRO) for _ in range(5)]
    results = distributed.run(_experts_world, PP * DP, str(tmp_path), models, fork=True,
                              timeout=500)  # fmt: skip
    for rank, got in enumerate(results):
        for run in ("again", "ep1", "fsdp", "saved"):
            for step, ((loss, grads), (want_loss, want_grads)) in enumerate(
                zip(got[run], want, strict=True)
            ):
                what = f"{run} rank {rank} step {step}"
                assert loss == pytest.approx(want_loss, rel=TOL), (what, loss, want_loss)
                assert_close(grads, {n: want_grads[n] for n in grads}, what)
        assert got["ep1 experts whole"], rank
        assert got["loaded step"] == 1
        for i, frozen in enumerate(got["frozen"]):
            assert frozen or rank % 2, (rank, i)  # pipeline rank 0 holds layer 0
            for name, (trainable, no_grad, same) in frozen.items():
                assert (trainable, no_grad, same) == (False, True, True), (rank, i, name)
    # The pipeline at ep 1, and the user's model after the pipelines at ep 2, saved the
    # unsplit model's values after step 2.
    model = model_of("mixtral", False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _, grads in want:
        for n, p in model.named_parameters():
            p.grad = grads[n]
        opt.step()
    for saved in ("ep1", "model"):
        trained = conveyor.load_model_state(tmp_path / saved)
        assert_close(trained, dict(model.state_dict()), f"saved {saved}")


# ------------------------------------------------------------------ vocabulary rows, tp
VOCAB_LOSS = TokenCrossEntropy(shift=True)


def _vocab_steps() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [padded_batch(7, 9, seed=0), padded_batch(5, 6, seed=1), padded_batch(6, 7, seed=2)]


def _vocab_reference() -> list[tuple[float, dict[str, torch.Tensor]]]:
    """The unsplit TinyGPT's loss and gradients per step, SGD between them."""
    torch.manual_seed(0)
    model = TinyGPT(False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for ids, targets in _vocab_steps():
        total, count = VOCAB_LOSS(model(ids), targets)
        loss = total / count
        loss.backward()
        out.append((float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


def _vocab_train(pipe: conveyor.Pipeline, steps: list[Any]) -> list[tuple[float, dict[str, Any]]]:
    ctx = pipe.context
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    out = []
    for ids, targets in steps:
        mine = slice(ctx.dp_rank, None, ctx.dp_size)
        loss = float(pipe.train_step(ids[mine], targets[mine]))
        out.append((loss, {n: _whole(p.grad) for n, p in pipe.named_parameters()}))
        opt.step()
        opt.zero_grad()
    return out


def _gpt_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = gpt.GPT(vocab=11, context=8, width=16, depth=4, heads=4)
    gpt.annotate(model, 2)
    return model


def _gpt_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 11, (8, 9), generator=g)
    targets = ids[:, 1:].clone()
    for row, real in enumerate([8, 1, 5, 2, 8, 3, 1, 6]):  # padded rows
        targets[row, real:] = -100
    return ids[:, :-1], targets


def _gpt_trace(pipe: conveyor.Pipeline, steps: range) -> Any:
    """SGD steps of the GPT example, each replica on its rows (round-robin) of the batch."""
    ctx = pipe.context
    mine = slice(ctx.dp_rank, None, ctx.dp_size)
    data = [(x[mine], y[mine]) for x, y in (_gpt_data(s) for s in steps)]
    return sgd_trace(pipe.named_parameters(), pipe.train_step, data, LR, _whole)


def _rows_world(rank: int) -> dict[str, Any]:
    ctx = conveyor.init(pp=2, dp=2)
    steps = _vocab_steps()
    out: dict[str, Any] = {}
    for second in (True, False):
        torch.manual_seed(0)
        model = TinyGPT(False)
        first = conveyor.Pipeline(model, loss_fn=VOCAB_LOSS, microbatches=2, context=ctx,
                                  vocab_parallel=True)  # fmt: skip
        got = _vocab_train(first, steps[:1])
        pipe = conveyor.Pipeline(model, loss_fn=VOCAB_LOSS, microbatches=2, context=ctx,
                                 vocab_parallel=second)  # fmt: skip
        out[f"vocab then vocab={second}"] = got + _vocab_train(pipe, steps[1:])
    # FSDP with a unit per block (the user's blocks become FSDP modules), then one per
    # stage, then none
    model = _gpt_model()
    out["fsdp"] = []
    for step, fsdp in enumerate(("reshard", True, False)):
        pipe = conveyor.Pipeline(model, loss_fn=TokenCrossEntropy(), microbatches=2,
                                 context=ctx, fsdp=fsdp)  # fmt: skip
        out["fsdp"] += _gpt_trace(pipe, range(step, step + 1))
    tp = conveyor.init(pp=2, tp=2)
    model = _gpt_model()
    first = conveyor.Pipeline(model, loss_fn=TokenCrossEntropy(), microbatches=2, context=tp,
                              tp_plan=gpt.tp_plan())  # fmt: skip
    out["tp"] = _gpt_trace(first, range(1))
    # pp 2 x dp 2 gives ranks 1 and 2 the other pipeline rank's stage, which they did not
    # train: refused on every rank (a save and load moves it); the model is left as it was
    try:
        conveyor.Pipeline(model, loss_fn=TokenCrossEntropy(), microbatches=2,
                          context=conveyor.init(pp=2, dp=2))  # fmt: skip
        out["moved"] = None
    except conveyor.ConfigError as error:
        out["moved"] = str(error)
    second = conveyor.Pipeline(model, loss_fn=TokenCrossEntropy(), microbatches=2, context=tp)
    out["tp"] += _gpt_trace(second, range(1, 3))
    return out


def _gpt_reference() -> Any:
    model = _gpt_model()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total, count = TokenCrossEntropy()(model(x), y)
        loss = total / count
        loss.backward()
        return loss.detach()

    return sgd_trace(model.named_parameters(), step, [_gpt_data(s) for s in range(3)], LR)


def test_rows_and_tensor_parallel_shards_are_split_again_exactly() -> None:
    """TinyGPT's vocabulary rows over pp 2 x dp 2, then a second pipeline with and without
    vocab_parallel; the GPT example under tp_plan on pp 2 x tp 2, then without it."""
    results = distributed.run(_rows_world, 4, fork=True, timeout=400)
    want = _vocab_reference()
    for rank, got in enumerate(results):
        for run in ("vocab then vocab=True", "vocab then vocab=False"):
            for step, ((loss, grads), (want_loss, want_grads)) in enumerate(
                zip(got[run], want, strict=True)
            ):
                what = f"{run} rank {rank} step {step}"
                assert loss == pytest.approx(want_loss, rel=TOL), (what, loss, want_loss)
                assert_close(grads, {n: want_grads[n] for n in grads}, what)
    for rank, got in enumerate(results):
        assert got["moved"] is not None, rank
        assert "differs from the one the rank that held it has" in got["moved"]
        # rank 1 trained stage 0 under tp and would get stage 1: 34 parameters (2 blocks of
        # 16, the final norm's 2; the head is the embedding it held), of which all but
        # the key biases (no gradient: softmax ignores them) changed in training; the
        # tensor-parallel ones (DTensors, gathered whole before the new split) counted too
        assert "gives rank 1 model." in got["moved"] and "(and 31 more)" in got["moved"]
        assert got["moved"] == results[0]["moved"]  # the same sentence on every rank
    trace = _gpt_reference()
    aliases = tied_names(_gpt_model())  # the GPT example ties its embedding and head
    for rank, got in enumerate(results):
        for run, step in ((r, s) for r in ("tp", "fsdp") for s in range(len(trace))):
            loss, grads, params = trace[step]
            got_loss, got_grads, got_params = got[run][step]
            what = f"{run} then others, rank {rank} step {step}"
            assert got_loss == pytest.approx(loss, rel=TOL), what
            for table, ref in ((got_grads, grads), (got_params, params)):
                assert_close(table, {n: ref[aliases[n]] for n in table}, what)
