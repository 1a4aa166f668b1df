"""Expert parallelism composes with the rest of the Pipeline: pp=2 x dp=2 x ep=2 (4
processes, gloo), a tiny Mixtral from its config (tests/parallel/test_experts.py).

One world (forked workers, so the 4 processes share this one's imports) runs, in order:

1. the meta-device path: the model built under ``conveyor.empty_weights()`` and loaded with
   ``weights=`` the directory ``save_pretrained`` wrote (transformers stores the experts one
   tensor per expert under older names; conveyor converts as ``from_pretrained`` does):
   each rank makes real only its own stages and its share of the experts, the rows of the
   checkpoint's experts it holds; one step exact against the unsplit model;
2. ``recompute=True`` with 1f1b, its steady state paired: exact, a recomputed forward
   running inside the paired backward (on the pair's helper thread);
3. ``compile`` (aot_eager): gradients equal the eager pipeline's of (1), compiled code ran;
4. ``autocast=torch.bfloat16``: close to the unsplit model under the same autocast;
5. ``conveyor.Trainer`` and ``PipelineTrainer`` (``pipeline_options={"ep": 2}``): a few
   steps, each step's whole batch being the same 6 rows, so the losses equal the unsplit
   model's (SGD) or its first step's and then fall (AdamW); expert parameters are shards.

The references are the unsplit model's, computed here before the workers start; so are
the captures (torch.export) of the models of (2) to (5a), which the forked workers inherit
(tests/support/captures.py) instead of exporting each model on every rank.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest
import torch

import conveyor
from conveyor.experts import is_expert_parameter
from conveyor.schedules import get_schedule, paired
from tests.parallel.test_experts import EXPERTS
from tests.parallel.test_moe_pipeline import (
    DP,
    EP,
    LR,
    MICRO,
    PP,
    batches,
    count,
    model_of,
    reference,
    shards_of,
)  # fmt: skip
from tests.support.captures import captured
from tests.support.helpers import assert_close
from tests.support.trainer_forked import run_forked

pytest.importorskip("transformers")

TRAINER_STEPS = 3
HF_LR = 1e-2
# bf16 keeps 8 significant bits: each rounding is relative 2^-9 ~ 2e-3. The pipeline and
# the unsplit model round the same products in the forward (1-row micro-batches in both),
# but the backward rounds its bf16 products at other points (the loss scaled per step, not
# per micro-batch; the experts' tokens grouped by the all-to-all) and the replicas'
# gradients are summed in another order. A gradient that is a sum of nearly cancelling
# terms (attention's q / k projections in a tiny random model) then moves by about 1e-2
# relative, which is also how far float32 is from bf16 there: the gradients are checked
# to what bf16 rounding reaches (rounding_bound: a rounding per layer and direction), the
# loss to 1e-4. That autocast really ran is told by the loss: the pipeline's is far closer
# to the bf16 reference than to the float32 one.
BF16_LOSS_TOL = 1e-4


# ------------------------------------------------------------------------------ references
def autocast_reference() -> tuple[float, dict[str, torch.Tensor]]:
    """The first step of :func:`reference` under ``torch.autocast("cpu", bfloat16)``."""
    model = model_of("mixtral", False)
    rows = batches()[0]
    n = torch.tensor(count(rows))
    total = 0.0
    for ids, labels in rows:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
        loss.backward()
        total += float(loss.detach())
    return total, {k: p.grad.clone() for k, p in model.named_parameters()}


def whole_batch_run(steps: int) -> list[float]:
    """The unsplit model's losses over ``steps`` SGD steps (``LR``) on the whole first
    batch (6 rows)."""
    model = model_of("mixtral", False)
    rows = batches()[0]
    ids, labels = torch.cat([i for i, _ in rows]), torch.cat([t for _, t in rows])
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


# ------------------------------------------------------------------------------ the world
def _grads(pipe: conveyor.Pipeline) -> dict[str, torch.Tensor]:
    """This rank's gradients, experts gathered whole."""
    return {
        n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
        for n, p in pipe.named_parameters()
        if p.grad is not None
    }


def _step(pipe: conveyor.Pipeline, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    loss = pipe.train_step(batch, None)
    return dict(loss=float(loss), grads=_grads(pipe))


def _meta_path(ctx: Any, batch: dict[str, torch.Tensor], ckpt: str) -> dict[str, Any]:
    """(1) Built on the meta device, loaded from the transformers checkpoint."""
    with conveyor.empty_weights():
        model = model_of("mixtral", False)
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=MICRO, weights=ckpt,
                             sample=(batch, None))  # fmt: skip
    held = dict(pipe.named_parameters())
    experts = {}
    for name, p in held.items():
        if is_expert_parameter(p):
            local = p.to_local()
            experts[name] = dict(
                shape=tuple(local.shape), full=tuple(p.shape), meta=local.is_meta,
                bytes=local.untyped_storage().nbytes(),
                want_bytes=local.numel() * local.element_size(), value=local.detach().clone(),
            )  # fmt: skip
    out = dict(
        held=sorted(held),
        meta_held=sorted(n for n, p in held.items() if p.is_meta),
        # the model's own parameters: those of other ranks' stages stay on the meta device
        real_in_model=sorted(n for n, p in model.named_parameters() if not p.is_meta),
        experts=experts,
        ep_rank=ctx.ep_rank,
        pp_rank=ctx.pp_rank,
    )
    out.update(_step(pipe, batch))
    return out


def _recompute(batch: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, Any]:
    """(2) recompute=True, 1f1b: counts where the expert forwards ran."""
    from conveyor.experts import shard

    calls: list[tuple[str, bool]] = []  # (thread, inside autograd's backward)
    routed = shard.routed_forward

    def counting(*args: Any) -> torch.Tensor:
        in_backward = torch._C._current_graph_task_id() != -1
        calls.append((threading.current_thread().name, in_backward))
        return routed(*args)

    # 1F1B with its steady state's forwards and backwards paired (marked here, whether or
    # not the generator marks them itself)
    schedule = paired(get_schedule("1f1b", PP, MICRO))
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=MICRO,
                             schedule=schedule, recompute=True, sample=(batch, None))  # fmt: skip
    # The threads the step starts: an interleaved pair runs its second action on a helper
    # thread of its own ("conveyor-pair").
    started: list[str] = []
    start = threading.Thread.start

    def recording(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)

    shard.routed_forward = counting  # type: ignore[assignment]
    threading.Thread.start = recording  # type: ignore[method-assign]
    try:
        out = _step(pipe, batch)
    finally:
        shard.routed_forward = routed  # type: ignore[assignment]
        threading.Thread.start = start  # type: ignore[method-assign]
    out["calls"] = calls
    out["pairs"] = len(pipe.schedule.pairs)
    out["paired"] = "conveyor-pair" in started  # the engine ran pairs interleaved
    out["own_pairs"] = len(pipe.schedule.pairs[pipe.context.pp_rank])  # this rank's
    return out


def _compiled(batch: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, Any]:
    """(3) compile (aot_eager)."""
    from conveyor.runtime.compiled import frames_compiled

    frames = frames_compiled()
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=MICRO,
                             compile={"backend": "aot_eager"}, sample=(batch, None))  # fmt: skip
    out = _step(pipe, batch)
    out["frames"] = frames_compiled() - frames
    out["stats"] = pipe.compile_stats is not None
    return out


def _autocast(batch: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, Any]:
    """(4) autocast=torch.bfloat16."""
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=MICRO,
                             autocast=torch.bfloat16, sample=(batch, None))  # fmt: skip
    out = _step(pipe, batch)
    out["dtypes"] = sorted({str(p.dtype) for p in pipe.parameters()})
    return out


class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The first batch's 6 rows as feature dicts (labels inside, -100 where padded)."""

    def __init__(self) -> None:
        self.rows = [(i[0], t[0]) for i, t in batches()[0]]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = self.rows[i]
        return {"input_ids": ids, "labels": labels}


def _shares(named: Any) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.to_local().shape) for n, p in named if is_expert_parameter(p)}


def _trainer(ctx: Any, model: torch.nn.Module) -> dict[str, Any]:
    """(5a) conveyor.Trainer: SGD on the global batch of all 6 rows (shuffled per epoch,
    which changes no whole-batch token mean)."""
    rows = Rows()
    sample = {"input_ids": rows[0]["input_ids"][None], "labels": rows[0]["labels"][None]}
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=MICRO,
                             context=ctx, sample=(sample, None))  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    history = conveyor.Trainer(pipe, opt).fit(rows, batch_size=DP * MICRO,
                                             max_steps=TRAINER_STEPS)  # fmt: skip
    return dict(losses=list(history.losses), shares=_shares(pipe.named_parameters()))


def _pipeline_trainer(tmp: str) -> dict[str, Any]:
    """(5b) PipelineTrainer with ``pipeline_options`` ``ep=2``: AdamW, 3 rows per replica."""
    from transformers import TrainingArguments

    from conveyor.integrations.transformers import PipelineTrainer

    args = TrainingArguments(
        output_dir=tmp, max_steps=TRAINER_STEPS, per_device_train_batch_size=MICRO,
        learning_rate=HF_LR, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=3, use_cpu=True,
    )  # fmt: skip
    trainer = PipelineTrainer(
        model_of("mixtral", False), args, train_dataset=Rows(),
        pipeline_options={"pp": PP, "dp": DP, "ep": EP, "microbatches": MICRO},
    )  # fmt: skip
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return dict(
        losses=losses, shares=_shares(trainer.pipe.named_parameters()),
        ep=(trainer.context.ep_size, trainer.context.ep_rank),
    )  # fmt: skip


# The checks whose model is built (and captured) in the test process before the workers
# fork (tests/support/captures.py): their ranks split it without exporting it again.
CAPTURED = ("recompute", "compiled", "autocast", "trainer")


def captured_models() -> dict[str, torch.nn.Module]:
    """The model of each of :data:`CAPTURED`, captured on the first micro-batch of replica
    0's batch (the trainer's sample is its first row: the same first micro-batch)."""
    return {name: captured(model_of("mixtral", False), shards_of(0)[0], MICRO)
            for name in CAPTURED}  # fmt: skip


def world(rank: int, ckpt: str, tmp: str, models: dict[str, torch.nn.Module]) -> dict[str, Any]:
    ctx = conveyor.init(pp=PP, dp=DP, ep=EP)
    rows = batches()[0][ctx.dp_rank * MICRO : (ctx.dp_rank + 1) * MICRO]
    batch = {"input_ids": torch.cat([i for i, _ in rows]),
             "labels": torch.cat([t for _, t in rows])}  # fmt: skip
    checks: dict[str, Any] = {
        "meta": lambda: _meta_path(ctx, batch, ckpt),
        "recompute": lambda: _recompute(batch, models["recompute"]),
        "compiled": lambda: _compiled(batch, models["compiled"]),
        "autocast": lambda: _autocast(batch, models["autocast"]),
        "trainer": lambda: _trainer(ctx, models["trainer"]),
        "hf": lambda: _pipeline_trainer(tmp),
    }
    out: dict[str, Any] = {"seconds": {}}
    for name, check in checks.items():
        start = time.perf_counter()
        out[name] = check()
        out["seconds"][name] = round(time.perf_counter() - start, 1)
    return out


# ------------------------------------------------------------------------------ the tests
@pytest.fixture(scope="module")
def results(tmp_path_factory: Any) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("compose")
    ckpt = tmp / "mixtral"
    model_of("mixtral", False).save_pretrained(ckpt)  # the layout transformers writes
    want = dict(
        step=reference("mixtral", False)[0],
        autocast=autocast_reference(),
        sgd=whole_batch_run(TRAINER_STEPS),
    )
    models = captured_models()
    torch._dynamo.reset()
    got = run_forked(world, PP * DP, str(ckpt), str(tmp / "hf"), models, timeout=400)
    print("seconds per check, rank 0:", got[0]["seconds"])
    return dict(want=want, got=got, ckpt=ckpt)


def _exact(got: dict[str, Any], want: tuple[float, dict[str, torch.Tensor]], what: str) -> None:
    want_loss, want_grads = want
    assert got["loss"] == pytest.approx(want_loss, rel=1e-5), (what, got["loss"], want_loss)
    assert got["grads"], what
    assert_close(got["grads"], {n: want_grads[n] for n in got["grads"]}, what)


def _every_gradient(results: dict[str, Any], key: str) -> None:
    names = set().union(*(set(r[key]["grads"]) for r in results["got"]))
    assert names == set(results["want"]["step"][1]), key


@pytest.mark.slow
@pytest.mark.multiprocess
def test_checkpoint_is_stored_per_expert(results: dict[str, Any]) -> None:
    """The premise of (1): save_pretrained writes the experts one tensor per expert, under
    names the model does not have, so loading it needs the conversion."""
    from safetensors import safe_open

    with safe_open(str(results["ckpt"] / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    assert f"model.layers.1.block_sparse_moe.experts.{EXPERTS - 1}.w3.weight" in names


@pytest.mark.slow
@pytest.mark.multiprocess
def test_meta_device_and_transformers_checkpoint(results: dict[str, Any]) -> None:
    """Each rank makes real only its own stages and its share of the experts, the
    checkpoint's rows of those experts; one step equals the unsplit model's."""
    whole = model_of("mixtral", False)
    params = dict(whole.named_parameters())
    n = EXPERTS // EP
    for rank, got in enumerate(results["got"]):
        run = got["meta"]
        assert run["meta_held"] == [], rank
        assert set(run["real_in_model"]) <= set(run["held"]), rank  # nothing of others'
        assert len(run["held"]) < len(params), rank
        assert run["experts"], f"rank {rank} holds no experts"
        for name, e in run["experts"].items():
            assert e["shape"] == (n, *params[name].shape[1:]) and e["full"] == params[name].shape
            assert not e["meta"] and e["bytes"] == e["want_bytes"], (rank, name, e["bytes"])
            lo = run["ep_rank"] * n
            assert torch.equal(e["value"], params[name].detach()[lo : lo + n]), (rank, name)
        _exact(run, results["want"]["step"], f"meta rank {rank}")
    _every_gradient(results, "meta")
    # both ep ranks of each pipeline rank hold experts, and differ
    for pp in range(PP):
        ep_ranks = {g["meta"]["ep_rank"] for g in results["got"] if g["meta"]["pp_rank"] == pp}
        assert ep_ranks == set(range(EP)), pp


@pytest.mark.slow
@pytest.mark.multiprocess
def test_recompute_with_1f1b(results: dict[str, Any]) -> None:
    """recompute=True with 1f1b, its steady state paired: exact, and stage 0's forwards
    are really recomputed, some inside a paired backward (the pair's helper thread, before
    autograd's backward: runtime/overlap.Pair tells it from the pair's own forward)."""
    for rank, got in enumerate(results["got"]):
        run = got["recompute"]
        _exact(run, results["want"]["step"], f"recompute rank {rank}")
        assert run["pairs"] > 0
        forwards = [thread for thread, in_backward in run["calls"] if not in_backward]
        if got["meta"]["pp_rank"] == 0:
            # one forward per micro-batch (its MoE layer), and again at each backward that
            # does not follow its forward directly
            assert len(forwards) > MICRO, (rank, run["calls"])
        in_pair = [t for t in forwards if t == "conveyor-pair"]
        # the engine runs the pairs interleaved, on the ranks whose programs hold some
        assert run["paired"] == (run["own_pairs"] > 0), (rank, run["own_pairs"])
        if got["meta"]["pp_rank"] == 0:
            assert in_pair, (rank, run["calls"])
    _every_gradient(results, "recompute")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_compiled_equals_eager(results: dict[str, Any]) -> None:
    """compile (aot_eager): the eager pipeline's loss and gradients (as the compiled
    experts test: the compiler reorders nothing in aot_eager)."""
    for rank, got in enumerate(results["got"]):
        run, eager = got["compiled"], got["meta"]
        assert run["stats"] and run["frames"] > 0, rank
        assert run["loss"] == pytest.approx(eager["loss"], rel=1e-6)
        assert_close(run["grads"], eager["grads"], f"compiled rank {rank}")
    _every_gradient(results, "compiled")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_autocast_bf16(results: dict[str, Any]) -> None:
    """autocast=torch.bfloat16: close to the unsplit model under the same autocast (see
    BF16_LOSS_TOL and rounding_bound), parameters stay float32, and the loss far from the
    float32 model's."""
    want_loss, want = results["want"]["autocast"]
    fp32_loss = results["want"]["step"][0]
    for rank, got in enumerate(results["got"]):
        run = got["autocast"]
        assert run["dtypes"] == ["torch.float32"], rank
        assert run["loss"] == pytest.approx(want_loss, rel=BF16_LOSS_TOL), (run["loss"], want_loss)
        assert_close(run["grads"], {n: want[n] for n in run["grads"]}, f"bf16 rank {rank}",
                     reduction=4, dtype=torch.bfloat16)  # fmt: skip
        # autocast really ran: the float32 loss is over 10 times farther (bf16 rounds the
        # logits of a tiny model by about 2e-6 of the loss; the pipeline is 1e-8 away)
        assert abs(run["loss"] - want_loss) * 10 < abs(run["loss"] - fp32_loss), (
            run["loss"], want_loss, fp32_loss,
        )  # fmt: skip
    _every_gradient(results, "autocast")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_conveyor_trainer(results: dict[str, Any]) -> None:
    """conveyor.Trainer on the ep pipeline: every step's loss is the unsplit model's (SGD
    on the same whole batch), and it falls; its expert parameters are shards."""
    want = results["want"]["sgd"]
    assert want[-1] < want[0]
    for rank, got in enumerate(results["got"]):
        run = got["trainer"]
        assert len(run["losses"]) == TRAINER_STEPS and all(map(math.isfinite, run["losses"]))
        assert run["losses"] == pytest.approx(want, rel=1e-4), (rank, run["losses"], want)
        assert run["shares"] and all(s[0] == EXPERTS // EP for s in run["shares"].values())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pipeline_trainer_takes_ep(results: dict[str, Any]) -> None:
    """PipelineTrainer(pipeline_options={"ep": 2}): its first logged loss is the unsplit
    model's on the whole batch, then the loss falls (AdamW); expert parameters are shards."""
    first = results["want"]["sgd"][0]
    for rank, got in enumerate(results["got"]):
        run = got["hf"]
        assert run["ep"] == (EP, (rank // PP) % EP), rank
        losses = run["losses"]
        assert len(losses) == TRAINER_STEPS and all(map(math.isfinite, losses)), losses
        assert losses[0] == pytest.approx(first, rel=1e-4), (rank, losses, first)
        assert losses[-1] < losses[0], losses
        assert run["shares"] and all(s[0] == EXPERTS // EP for s in run["shares"].values())


@pytest.mark.parametrize("kind", ["qwen2_moe", "olmoe"])
def test_transformers_checkpoints_of_other_moe_models_load(kind: str, tmp_path: Any) -> None:
    """The conversion (1) relies on, for the two other MoE families: a meta model loaded
    from what save_pretrained wrote (experts one tensor per expert) equals the model."""
    model = model_of(kind, False)
    model.save_pretrained(tmp_path)
    with conveyor.empty_weights():
        empty = model_of(kind, False)
    conveyor.materialize(empty, weights=tmp_path)
    got, want = dict(empty.named_parameters()), dict(model.named_parameters())
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name
