"""Context parallelism composed with the other parallelisms, against the unsplit model on
one process and the whole batch's token loss: the loss and every gradient (relative error
< 1e-5, ``assert_close``), two SGD steps, padded rows of different lengths and packed rows,
micro-batches of uneven rows.

- pp 2 x cp 2 x dp 2 (8 processes): plain data parallelism and FSDP over the ``dp x cp``
  ranks (``ctx.replica_mesh``); replicas of different rows and token counts (each its
  shard of the global batch, the cp ranks of a replica the same rows); replicas that start
  from other parameters (made equal over ``dp x cp``); an embedding tied to the output
  layer across the pipeline ranks; the vocabulary layers over the pipeline ranks of each
  ``(dp, cp)`` share; ``clip_grad_norm_`` counting each gradient once.
- pp 2 x cp 2 x tp 2 (8 processes): a transformers Llama and Qwen3 with ``tp_plan``
  ("auto", and written out): heads over tp, the sequence over cp.
- pp 2 x dp 2 x cp 2 with ep 2 (8 processes): a transformers Mixtral, experts routed from
  each rank's tokens, expert gradients summed over ``edp x cp``, with and without FSDP;
  its router auxiliary loss (below).
- ``vocab_parallel`` with cp in one process (every cp rank's share side by side).

The router auxiliary loss under cp. transformers' load-balancing loss of a forward is
``E * sum_e f_e * P_e``: ``f_e`` the share of the forward's tokens routed to expert ``e``,
``P_e`` their mean router probability. It is a product of two means over the forward's
tokens, so it is not a sum over tokens: the micro-batches of a step already each have
their own, and the step adds ``coef`` times their mean (docs/guide/moe.md). Under cp
each cp rank's forward sees its share of the sequence, and its loss is that share's:
exactness here means the step's loss is the whole batch's token loss plus ``coef`` times
the mean, over every micro-batch of every replica and each of its cp shares, of the
unsplit model's auxiliary loss over that share's tokens (the router logits of the whole
sequence's forward, taken at the share's positions). The test checks the pipeline
against exactly that, and that it differs from the auxiliary loss of whole micro-batches
(what a cp that gathered the router statistics would give).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.context_parallel import layout
from conveyor.losses import TokenCrossEntropy
from conveyor.vocab.shards import chunk_rows
from tests.context_parallel.test_pipeline import VOCAB, packed_batches, padded_batches
from tests.support import distributed
from tests.support.helpers import assert_close, reset_context

pytest.importorskip("transformers")

LR = 0.1
Batch = dict[str, torch.Tensor]
Steps = list[tuple[float, dict[str, torch.Tensor]]]


def llama(tied: bool = False) -> nn.Module:
    """test_pipeline's Llama (4 layers, grouped-query heads), its embedding tied or not."""
    import transformers as T

    config = T.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, use_cache=False, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return T.LlamaForCausalLM(config)


def unsplit(model: nn.Module, batches: list[Batch]) -> tuple[Steps, list[float]]:
    """Per step the whole batch's loss and gradients (SGD between steps), and the norm of
    each step's gradient."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out, norms = [], []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        once = [p.grad.double().norm() for p in model.parameters()]
        norms.append(float(torch.stack(once).norm()))
        # a tied weight under each of its names (the pipeline names its copies so)
        grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        out.append((float(loss.detach()), grads))
        opt.step()
        opt.zero_grad()
    return out, norms


def whole(t: torch.Tensor) -> torch.Tensor:
    """A gradient gathered whole (FSDP's shards), or as it is."""
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach().clone()


def check(got: Steps, want: Steps, what: str) -> None:
    for step, ((loss, grads), (ref_loss, ref)) in enumerate(zip(got, want, strict=True)):
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"{what} step {step}: {loss} {ref_loss}"
        assert_close(grads, {n: ref[n] for n in grads}, f"{what} step {step}")


# ------------------------------------------------------------------ pp 2 x cp 2 x dp 2
SHARDS = (0, 3, 5)
"""Replica r trains on rows SHARDS[r]:SHARDS[r + 1] of each global batch of 5: other rows,
other token counts, and 3 rows over 2 micro-batches (uneven)."""


def shard(batch: Batch, replica: int) -> Batch:
    return {k: v[SHARDS[replica] : SHARDS[replica + 1]] for k, v in batch.items()}


def vocab_batches() -> list[Batch]:
    """tests/vocab's padded rows (5 of 8 tokens), as a transformers model takes them."""
    from tests.vocab.models import padded_batch

    out = []
    for seed in range(2):
        ids, targets = padded_batch(rows=5, length=8, seed=seed)
        out.append({"input_ids": ids, "labels": targets})
    return out


DP_CASES: dict[str, dict[str, Any]] = {
    "dp ring padded tied 1f1b": dict(data="padded", cp_attention="ring", tied=True),
    "fsdp all-gather packed zb-h1": dict(
        data="packed", cp_attention="all-gather", fsdp=True, schedule="zb-h1"
    ),
    "fsdp ring padded tied interleaved": dict(
        data="padded", fsdp=True, tied=True, schedule="interleaved-1f1b", chunks=2
    ),
    "vocab dp tied": dict(data="vocab", vocab_parallel=True, tied=True),
}


def dp_model(case: dict[str, Any]) -> nn.Module:
    if case["data"] == "vocab":
        from tests.vocab.models import tiny_llama

        return tiny_llama(case.get("tied", False))
    return llama(case.get("tied", False))


def dp_batches(case: dict[str, Any]) -> list[Batch]:
    return {"padded": padded_batches, "packed": packed_batches, "vocab": vocab_batches}[
        case["data"]
    ]()


def _grads(pipe: conveyor.Pipeline, ctx: conveyor.Context) -> dict[str, torch.Tensor]:
    """Every gradient whole: FSDP's gathered; the vocabulary layers' rows of this
    pipeline rank (a DTensor over the pipeline ranks) as ``name@lo``."""
    out = {}
    for name, p in pipe.named_parameters():
        g = p.grad
        names = getattr(getattr(g, "device_mesh", None), "mesh_dim_names", None) or ()
        if "pp" in names:
            lo, _ = chunk_rows(p.shape[0], ctx.pp_size, ctx.pp_rank)
            out[f"{name}@{lo}"] = g.to_local().detach().clone()
        else:
            out[name] = whole(g)
    return out


def _dp_world(rank: int, cases: list[str]) -> dict[str, Any]:
    ctx = conveyor.init(pp=2, dp=2, cp=2, timeout=300)
    assert (ctx.dp_rank, ctx.pp_rank, ctx.cp_rank) == (rank // 4, rank // 2 % 2, rank % 2)
    out: dict[str, Any] = {}
    for name in cases:
        case = DP_CASES[name]
        options = {k: v for k, v in case.items() if k not in ("data", "tied")}
        model = dp_model(case)
        if ctx.replica_rank:  # replicas start elsewhere: the pipeline copies replica 0's
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5 + ctx.replica_rank)
        batches = [shard(b, ctx.dp_rank) for b in dp_batches(case)]
        # Split at construction, so that the optimizer gets FSDP's parameters.
        pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=2, context=ctx,
                                 sample=(batches[0], None), **options)  # fmt: skip
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        steps, norms = [], []
        for batch in batches:
            loss = pipe.train_step(batch)
            steps.append((float(loss), _grads(pipe, ctx)))
            norms.append(float(pipe.clip_grad_norm_(1e9)))  # the norm; nothing clipped
            opt.step()
            opt.zero_grad()
        out[name] = dict(steps=steps, norms=norms, text=str(pipe))
    return out


def _rows_of(want: Steps) -> Steps:
    """The reference's gradients also under ``name@lo`` for every row range a pipeline
    rank holds of the vocabulary layers (2 pipeline ranks)."""
    out = []
    for loss, grads in want:
        more = dict(grads)
        for name, g in grads.items():
            for r in range(2):
                lo, hi = chunk_rows(g.shape[0], 2, r)
                more[f"{name}@{lo}"] = g[lo:hi]
        out.append((loss, more))
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_cp2_dp2_data_parallel_fsdp_ties_and_vocabulary() -> None:
    cases = list(DP_CASES)
    results = distributed.run(_dp_world, 8, cases, fork=True, timeout=1500)
    for name in cases:
        case = DP_CASES[name]
        batches = dp_batches(case)
        want, norms = unsplit(dp_model(case), batches)
        want = _rows_of(want)
        for rank, got in enumerate(results):
            check(got[name]["steps"], want, f"{name} rank {rank}")
            assert got[name]["norms"] == pytest.approx(norms, rel=1e-5), (name, rank)
        text = results[0][name]["text"]
        assert "context parallel: cp 2 (dp 2 x cp 2 replicas" in text, text


# ------------------------------------------------------------------ pp 2 x cp 2 x tp 2
def tp_batches() -> list[Batch]:
    """tests/support/tp_models' rows (5, labels padded by r % 4 + r // 4), at lengths
    that cut into 4 chunks."""
    from tests.support import tp_models as M

    g = torch.Generator().manual_seed(3)
    out = []
    for length in (12, 8):
        ids = torch.randint(1, M.VOCAB, (M.ROWS, length), generator=g)
        labels = ids.clone()
        for r in range(M.ROWS):
            labels[r, length - (r % 4) - r // 4 :] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


TP_CASES = {
    "llama auto ring": ("llama", "auto", "ring"),
    "qwen3 auto all-gather": ("qwen3", "auto", "all-gather"),
    "llama hand ring": ("llama", "hand", "ring"),
}


def _tp_plan(plan: str) -> Any:
    if plan == "auto":
        return "auto"
    from tests.parallel.test_tp_transformers import hand_plan

    return hand_plan()


def _tp_models(cases: list[str]) -> dict[str, nn.Module]:
    """Each case's model built and captured here, as its ranks' Pipeline captures it
    (tests/support/captures.py: the 8 forked ranks split that graph instead of each
    exporting it again)."""
    from tests.support import tp_models as M

    return {name: M.captured(M.tiny(TP_CASES[name][0]), _tp_plan(TP_CASES[name][1]), 2)
            for name in cases}  # fmt: skip


def _tp_world(rank: int, cases: list[str], models: dict[str, nn.Module]) -> dict[str, Any]:
    from tests.support import tp_models as M

    ctx = conveyor.init(pp=2, cp=2, tp=2, timeout=300)
    assert (ctx.pp_rank, ctx.cp_rank, ctx.tp_rank) == (rank // 4, rank // 2 % 2, rank % 2)
    out: dict[str, Any] = {"ranks": {"tp": ctx.tp_rank, "pp": ctx.pp_rank}}
    batches = tp_batches()
    for name in cases:
        _, plan, strategy = TP_CASES[name]
        pipe = conveyor.Pipeline(
            models[name], loss_fn=None, microbatches=3, tp_plan=_tp_plan(plan),
            cp_attention=strategy, sample=(batches[0], None),
        )  # fmt: skip
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        steps, norms = [], []
        for batch in batches:
            loss = pipe.train_step(batch)
            steps.append((float(loss), M.shards(pipe.named_parameters())))
            norms.append(float(pipe.clip_grad_norm_(1e9)))
            opt.step()
            opt.zero_grad()
        out[name] = dict(steps=steps, norms=norms)
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pp2_cp2_tp2_transformers_with_tp_plan() -> None:
    from tests.support import tp_models as M

    cases = list(TP_CASES)
    results = distributed.run(_tp_world, 8, cases, _tp_models(cases), fork=True, timeout=1500)
    for name in cases:
        want, norms = unsplit(M.tiny(TP_CASES[name][0]), tp_batches())
        held: set[str] = set()
        for rank, got in enumerate(results):
            what = f"{name} rank {rank}"
            held |= M.check(got[name]["steps"], want, got["ranks"], {"tp": 2, "pp": 2}, what)
            assert got[name]["norms"] == pytest.approx(norms, rel=1e-5), what
        assert held == set(want[0][1]), name
        # the attention is really sharded: each tp rank holds half the heads
        local, placement = results[0][name]["steps"][0][1]["model.layers.0.self_attn.k_proj.weight"]
        assert placement == "tp:S(0)" and local.shape[0] == 16, (name, placement, local.shape)


# ------------------------------------------------------------------ Mixtral with ep
MOE_MICRO = 3


def moe_model(aux: bool) -> nn.Module:
    from tests.parallel.test_moe_pipeline import model_of

    return model_of("mixtral", aux)


def moe_batches() -> list[Batch]:
    """Two steps (lengths 8 and 12) of 2 replicas x 3 one-row micro-batches, labels padded."""
    g = torch.Generator().manual_seed(5)
    out = []
    for length in (8, 12):
        ids = torch.randint(0, 37, (2 * MOE_MICRO, length), generator=g)
        labels = ids.clone()
        for r in range(2 * MOE_MICRO):
            labels[r, length - r % 4 :] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def moe_reference(aux: bool, cp: int = 2) -> tuple[Steps, list[tuple[float, float]]]:
    """Per step the unsplit model's loss and gradients (module doc: the router term is
    ``coef`` times the mean of each one-row micro-batch's cp shares' auxiliary losses), and
    per step (that mean, the mean of whole micro-batches' auxiliary losses)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = moe_model(aux)
    coef = model.router_aux_loss_coef
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out, terms = [], []
    for batch in moe_batches():
        n = torch.tensor(int((batch["labels"][:, 1:] != -100).sum()))
        rows, length = batch["input_ids"].shape
        total = torch.zeros(())
        shares = wholes = 0.0
        for r in range(rows):
            o = model(input_ids=batch["input_ids"][r : r + 1],
                      labels=batch["labels"][r : r + 1], num_items_in_batch=n)  # fmt: skip
            loss = o.loss
            if aux:
                loss = loss - coef * o.aux_loss  # the model added its whole row's
                for c in range(cp):
                    index = layout.held_index(length, cp, c)
                    logits = tuple(layer[index] for layer in o.router_logits)
                    share = load_balancing_loss_func(logits, model.num_experts,
                                                     model.num_experts_per_tok)  # fmt: skip
                    loss = loss + coef * share / (rows * cp)
                    shares += float(share) / (rows * cp)
                wholes += float(o.aux_loss) / rows
            total = total + loss
        total.backward()
        out.append((float(total), {k: p.grad.clone() for k, p in model.named_parameters()}))
        terms.append((shares, wholes))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out, terms


MOE_CASES = {
    "aux ring": (True, False, "ring"),
    "fsdp all-gather": (False, True, "all-gather"),
}


def _moe_world(rank: int, cases: list[str]) -> dict[str, Any]:
    from conveyor.experts import is_expert_parameter

    ctx = conveyor.init(pp=2, dp=2, cp=2, ep=2, timeout=300)
    out: dict[str, Any] = {}
    for name in cases:
        aux, fsdp, strategy = MOE_CASES[name]
        mine = [{k: v[ctx.dp_rank * MOE_MICRO : (ctx.dp_rank + 1) * MOE_MICRO]
                 for k, v in b.items()} for b in moe_batches()]  # fmt: skip
        pipe = conveyor.Pipeline(
            moe_model(aux), loss_fn=None, microbatches=MOE_MICRO, fsdp=fsdp,
            cp_attention=strategy, sample=(mine[0], None),
        )  # fmt: skip
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        steps = []
        for batch in mine:
            loss = pipe.train_step(batch)
            steps.append((float(loss), {n: whole(p.grad) for n, p in pipe.named_parameters()}))
            opt.step()
            opt.zero_grad(set_to_none=True)
        experts = [n for n, p in pipe.named_parameters() if is_expert_parameter(p)]
        out[name] = dict(steps=steps, experts=experts)
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_mixtral_with_ep_and_its_router_loss() -> None:
    cases = list(MOE_CASES)
    results = distributed.run(_moe_world, 8, cases, fork=True, timeout=1500)
    for name in cases:
        aux = MOE_CASES[name][0]
        want, terms = moe_reference(aux)
        if aux:  # what a router loss over whole micro-batches would give is another value
            assert all(abs(s - w) > 1e-3 * abs(w) for s, w in terms), terms
        for rank, got in enumerate(results):
            check(got[name]["steps"], want, f"{name} rank {rank}")
        # the experts are really spread over ep (unless FSDP shards them further)
        assert any(got[name]["experts"] for got in results), name


# ------------------------------------------------------------------ vocab_parallel, one process
@pytest.mark.parametrize("cp", [2, 4])
def test_vocab_parallel_with_a_next_token_loss_in_one_process(cp: int) -> None:
    """tests/vocab's GPT (no attention: only the label shift at a cut tells the shares
    apart) with its vocabulary layers over the pipeline ranks, tied."""
    from tests.vocab.models import TinyGPT, padded_batch

    loss_fn = TokenCrossEntropy(shift=True)
    batches = [padded_batch(rows=5, length=8, seed=s) for s in range(2)]
    torch.manual_seed(0)
    model = TinyGPT(tied=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    want, norms = [], []
    for ids, targets in batches:
        total, count = loss_fn(model(ids), targets)
        (total / count).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        want.append((float((total / count).detach()), grads))
        norms.append(float(torch.stack([g.norm() for g in grads.values()]).norm()))
        opt.step()
        opt.zero_grad()
    reset_context()
    conveyor.init(pp=2, cp=cp)
    torch.manual_seed(0)
    pipe = conveyor.Pipeline(TinyGPT(tied=True), loss_fn=loss_fn, microbatches=2,
                             vocab_parallel=True, schedule="zb-h1")  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    got, got_norms = [], []
    for ids, targets in batches:
        loss = pipe.train_step(ids, targets)
        got.append((float(loss), {n: p.grad.clone() for n, p in pipe.named_parameters()}))
        got_norms.append(float(pipe.clip_grad_norm_(1e9)))  # every share's gradient, once
        opt.step()
        opt.zero_grad()
    check(got, want, f"vocab gpt cp {cp}")
    assert got_norms == pytest.approx(norms, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_vocab_parallel_llama_and_predict_in_one_process(tied: bool) -> None:
    """A transformers Llama with its own loss (``shift_labels``, shifted before the cut,
    read as given), and predict's logits joined into whole sequences."""
    from tests.vocab.models import tiny_llama

    batches = vocab_batches()
    want, _ = unsplit(tiny_llama(tied), batches)
    reset_context()
    conveyor.init(pp=2, cp=2)
    pipe = conveyor.Pipeline(tiny_llama(tied), loss_fn=None, microbatches=2, vocab_parallel=True,
                             sample=(batches[0], None))  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    got = []
    for batch in batches:
        loss = pipe.train_step(batch)
        got.append((float(loss), {n: p.grad.clone() for n, p in pipe.named_parameters()}))
        opt.step()
        opt.zero_grad()
    check(got, want, f"vocab llama tied={tied}")
    ids = batches[0]["input_ids"]
    pipe = conveyor.Pipeline(tiny_llama(tied), loss_fn=None, microbatches=2, vocab_parallel=True)
    logits = pipe.predict({"input_ids": ids})
    assert_close({"logits": logits}, {"logits": tiny_llama(tied)(input_ids=ids).logits.detach()},
                 "predict")  # fmt: skip
