"""Expert parallelism inside the pipeline: ``Pipeline`` on pp=2 x dp=2 x ep=2 (4 processes)
exact against the unsplit model.

Tiny Mixtral, Qwen2-MoE (shared experts) and OLMoE from configs (tests/parallel/
test_experts.py), ``loss_fn=None`` with labels padded by -100, two steps of other sequence
lengths with an SGD step between them. The reference is the unsplit model under gradient
accumulation over the same micro-batches (each called with the whole batch's token count):
without router losses that is the whole batch's loss, and with ``output_router_logits`` the
router's auxiliary loss is per forward, so per micro-batch: the step adds ``coef`` times
their mean (docs/guide/moe.md). The schedules 1f1b, zb-h1,
interleaved-1f1b and dualpipev each run with and without FSDP (experts over the replicas
holding the same experts). Each rank's expert parameters are its share.

Each run's model is built and captured (torch.export) in the test process, and the forked
ranks split that capture (tests/support/captures.py) instead of each exporting the model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import conveyor
from conveyor.experts import is_expert_parameter
from tests.parallel.test_experts import EXPERTS, tiny_moe
from tests.support import distributed
from tests.support.captures import captured
from tests.support.helpers import assert_close

transformers = pytest.importorskip("transformers")

PP, DP, EP = 2, 2, 2
MICRO = 3  # micro-batches per replica (dualpipev on 2 ranks needs 3)
LR = 0.1


def model_of(kind: str, aux: bool, layers: int = 2) -> torch.nn.Module:
    model = tiny_moe(kind, layers)
    model.config.use_cache = False
    if aux:
        model.config.output_router_logits = True
        model.config.router_aux_loss_coef = 0.5
        model.router_aux_loss_coef = 0.5  # read at construction
    return model


def batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Two steps (lengths 7 and 5), each of DP replicas x MICRO micro-batches of one row."""
    g = torch.Generator().manual_seed(5)
    steps = []
    for length in (7, 5):
        rows = []
        for r in range(DP * MICRO):
            ids = torch.randint(0, 37, (1, length), generator=g)
            labels = ids.clone()
            labels[0, length - r % 4 :] = -100  # row r: r % 4 padded positions
            rows.append((ids, labels))
        steps.append(rows)
    return steps


def count(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(int((labels[:, 1:] != -100).sum()) for _, labels in rows)


def reference(
    kind: str, aux: bool, layers: int = 2
) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Per step: the unsplit model's loss and gradients, accumulated over the micro-batches."""
    model = model_of(kind, aux, layers)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for rows in batches():
        n = torch.tensor(count(rows))
        total = 0.0
        for ids, labels in rows:
            output = model(input_ids=ids, labels=labels, num_items_in_batch=n)
            loss = output.loss
            if aux:  # the mean of the micro-batches' auxiliary losses (docs/guide/moe.md)
                loss = loss + model.router_aux_loss_coef * output.aux_loss * (1 / len(rows) - 1)
            loss.backward()
            total += float(loss.detach())
        out.append((total, {k: p.grad.clone() for k, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def train(
    pipe: conveyor.Pipeline, shards: list[dict[str, torch.Tensor]], seed: int | None = None
) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """One SGD step per batch of ``shards``: each step's loss and gradients (experts
    whole); ``seed``: seed the generators first (dropout)."""
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    if seed is not None:
        torch.manual_seed(seed)
    steps = []
    for batch in shards:
        loss = pipe.train_step(batch, None)
        grads = {
            n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
            for n, p in pipe.named_parameters()
            if p.grad is not None
        }
        steps.append((float(loss), grads))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps


def shards_of(dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """Replica ``dp_rank``'s batch of each step, as one dict of ``input_ids`` and ``labels``."""
    mine = [rows[dp_rank * MICRO : (dp_rank + 1) * MICRO] for rows in batches()]
    return [
        {"input_ids": torch.cat([i for i, _ in m]), "labels": torch.cat([t for _, t in m])}
        for m in mine
    ]


def models_for(kind: str, aux: bool, runs: list[Any]) -> list[torch.nn.Module]:
    """One model per run, captured here on the first step's batch as each rank's Pipeline
    captures it (tests/support/captures.py): the forked ranks split it without exporting."""
    return [captured(model_of(kind, aux), shards_of(0)[0], MICRO) for _ in runs]


def ranks(
    rank: int,
    kind: str,
    aux: bool,
    runs: list[tuple[str, bool]],
    models: list[torch.nn.Module] | None = None,
) -> dict[str, Any]:
    """Per (schedule, fsdp): this rank's losses, gradients (experts whole) and expert shards.
    ``models``: each run's model (else built here)."""
    ctx = conveyor.init(pp=PP, dp=DP, ep=EP)
    out: dict[str, Any] = {}
    for i, (schedule, fsdp) in enumerate(runs):
        model = model_of(kind, aux) if models is None else models[i]
        whole = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
        shards = shards_of(ctx.dp_rank)
        # Split at construction (export on the sample), so the optimizer gets the sharded
        # parameters.
        pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=MICRO, schedule=schedule,
                                 fsdp=fsdp, sample=(shards[0], None))  # fmt: skip
        steps = train(pipe, shards)
        shares = {
            n: (tuple(p.to_local().shape), whole[n].shape)
            for n, p in pipe.named_parameters()
            if is_expert_parameter(p) and not fsdp
        }
        out[f"{schedule}/{fsdp}"] = dict(steps=steps, shares=shares)
    return out


def check(kind: str, aux: bool, runs: list[tuple[str, bool]]) -> None:
    want = reference(kind, aux)
    models = models_for(kind, aux, runs)
    results = distributed.run(ranks, PP * DP, kind, aux, runs, models, timeout=400, fork=True)
    for key in (f"{s}/{f}" for s, f in runs):
        for rank, got in enumerate(results):
            run = got[key]
            for step, ((loss, grads), (want_loss, want_grads)) in enumerate(
                zip(run["steps"], want, strict=True)
            ):
                what = f"{kind} {key} rank {rank} step {step}"
                assert loss == pytest.approx(want_loss, rel=1e-5), (what, loss, want_loss)
                assert_close(grads, {n: want_grads[n] for n in grads}, what)
            for name, (local, full) in run["shares"].items():
                assert local == (EXPERTS // EP, *full[1:]), (key, name)
        # every parameter has its gradient on some rank
        names = set().union(*(set(g[key]["steps"][0][1]) for g in results))
        assert names == set(want[0][1]), key
        if not key.endswith("True"):
            assert any(g[key]["shares"] for g in results), key


@pytest.mark.slow
@pytest.mark.multiprocess
def test_mixtral_1f1b_and_interleaved() -> None:
    """Mixtral: 1f1b, and interleaved-1f1b (2 chunks, its pairs overlapped) with and
    without FSDP."""
    runs = [("1f1b", False), ("interleaved-1f1b", True), ("interleaved-1f1b", False)]
    check("mixtral", False, runs)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_qwen2_moe_shared_experts_zb_h1_fsdp_and_dualpipev() -> None:
    """Qwen2-MoE (a shared expert, replicated): zb-h1 (also under FSDP: W differentiates
    for the expert units' gathered tensors too) and dualpipev, with and without FSDP."""
    runs = [("zb-h1", False), ("zb-h1", True), ("dualpipev", False), ("dualpipev", True)]
    check("qwen2_moe", False, runs)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_olmoe_1f1b() -> None:
    """OLMoE: 1f1b, with and without FSDP; and without router losses the accumulated
    reference is the whole batch's loss."""
    model = model_of("olmoe", False)
    rows = batches()[0]
    ids, labels = torch.cat([i for i, _ in rows]), torch.cat([t for _, t in rows])
    whole = float(model(input_ids=ids, labels=labels).loss)
    assert whole == pytest.approx(reference("olmoe", False)[0][0], rel=1e-5)
    check("olmoe", False, [("1f1b", False), ("1f1b", True)])


def test_router_aux_loss_one_process() -> None:
    """output_router_logits with loss_fn=None on pp=2 (one process): the whole batch's token
    loss plus coef times the mean of the micro-batches' auxiliary losses, as the unsplit
    model accumulating over the same micro-batches."""
    rows = batches()[0][:MICRO]
    model = model_of("mixtral", True)
    n = torch.tensor(count(rows))
    want_loss = 0.0
    for ids, labels in rows:
        output = model(input_ids=ids, labels=labels, num_items_in_batch=n)
        loss = output.loss + model.router_aux_loss_coef * output.aux_loss * (1 / MICRO - 1)
        loss.backward()
        want_loss += float(loss.detach())
    want = {k: p.grad for k, p in model.named_parameters()}
    conveyor.init(pp=2)
    ids, labels = (torch.cat([row[i] for row in rows]) for i in (0, 1))
    batch = {"input_ids": ids, "labels": labels}
    pipe = conveyor.Pipeline(model_of("mixtral", True), loss_fn=None, microbatches=MICRO)
    got = float(pipe.train_step(batch, None))
    assert got == pytest.approx(want_loss, rel=1e-6)
    grads = {n: p.grad for n, p in pipe.named_parameters() if p.grad is not None}
    assert set(grads) == set(want)
    assert_close(grads, want, "router aux")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_mixtral_router_aux_loss() -> None:
    """Mixtral with output_router_logits, 1f1b: the auxiliary term averages over every
    replica's micro-batches."""
    check("mixtral", True, [("1f1b", False)])


def _train_and_save(rank: int, path: str, model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """pp2 x dp2 x ep2: one SGD step of Mixtral (``model``, captured by the test process),
    then save; returns this rank's expert parameters' local shapes."""
    ctx = conveyor.init(pp=PP, dp=DP, ep=EP)
    batch = shards_of(ctx.dp_rank)[0]
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=MICRO,
                             sample=(batch, None))  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    pipe.train_step(batch, None)
    opt.step()
    conveyor.checkpoint.save(pipe, path, opt, step=1)
    return {n: tuple(p.to_local().shape) for n, p in pipe.named_parameters()
            if is_expert_parameter(p)}  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiprocess
def test_checkpoint_of_pp2_dp2_ep2_loads_into_pp2_and_the_unsplit_model(tmp_path: Any) -> None:
    """A checkpoint saved by pp2 x dp2 x ep2 (world 4) holds whole experts under the
    original names: it loads into pp=2 without ep (one process) and into the unsplit
    model, equal to the unsplit model after the same step."""
    from conveyor.checkpoint import load, load_model_state

    path = str(tmp_path / "ckpt")
    model = models_for("mixtral", False, [None])[0]
    shares = distributed.run(_train_and_save, PP * DP, path, model, timeout=400, fork=True)
    assert any(shares), "no rank held experts"
    for local in shares:
        for name, shape in local.items():
            assert shape[0] == EXPERTS // EP, (name, shape)
    # the reference: the unsplit model after one step over the whole batch
    want_model = model_of("mixtral", False)
    rows = batches()[0]
    n = torch.tensor(count(rows))
    for ids, labels in rows:
        want_model(input_ids=ids, labels=labels, num_items_in_batch=n).loss.backward()
    torch.optim.SGD(want_model.parameters(), lr=LR).step()
    want = want_model.state_dict()

    state = load_model_state(path)
    assert list(state) == list(want)
    assert_close(state, want, "load_model_state")
    unsplit = model_of("mixtral", False)
    assert load(unsplit, path) == 1
    assert_close(unsplit.state_dict(), want, "unsplit")

    conveyor.init(pp=2)
    ids, labels = (torch.cat([row[i] for row in rows[:MICRO]]) for i in (0, 1))
    batch = {"input_ids": ids, "labels": labels}
    pipe = conveyor.Pipeline(model_of("mixtral", False), loss_fn=None, microbatches=MICRO,
                             sample=(batch, None))  # fmt: skip
    assert load(pipe, path) == 1
    assert_close(pipe.state_dict(), want, "pp2")
