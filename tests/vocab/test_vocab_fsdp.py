"""Vocabulary parallelism with FSDP (``fsdp=True, vocab_parallel=True``) against the
unsplit model, on pp2 x dp2: the rows of each vocabulary layer split over the pipeline
ranks and further over the replicas.

Replicas pass different rows of each batch (different token counts); two accumulated
steps; the loss and every gradient (gathered whole) equal the unsplit model's over the
whole batches, for the TinyGPT tied and untied on 1F1B and ZB-H1 and a transformers Llama
with its own loss. Each rank stores about a quarter of the vocabulary rows; an SGD step
gives the unsplit model's updated weights, on which eval_step and predict are the unsplit
model's; a checkpoint loads into the unsplit model; meta weights get the unsplit model's
values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import conveyor
from conveyor.vocab.shards import chunk_rows
from tests.support import distributed
from tests.support.helpers import assert_close
from tests.vocab.models import VOCAB, TinyGPT
from tests.vocab.test_vocab_pipeline import LOSS, _steps, make, reference, rel, train

PP, DP = 2, 2
LR = 0.5
TOL = 1e-5
CASES = [
    ("gpt", "1f1b", False),
    ("gpt", "1f1b", True),
    ("gpt", "zb-h1", False),
    ("gpt", "zb-h1", True),
    ("llama", "1f1b", False),
]
SAVED = ("gpt", "zb-h1", True)  # the case whose pipeline is checkpointed
VOCAB_NAMES = {"wte.weight", "head.weight", "model.embed_tokens.weight", "lm_head.weight"}


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective over its mesh), a plain tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


def _world(rank: int, ckpt: str) -> dict[str, Any]:
    """Per case: the losses of two accumulated steps on this replica's rows, every local
    parameter's gradient and (after an SGD step) value gathered whole, and the local rows
    of the vocabulary weights against the share this rank should hold."""
    ctx = conveyor.init(pp=PP, dp=DP)
    out: dict[str, Any] = {}
    for kind, schedule, tied in CASES:
        pipe = conveyor.Pipeline(
            make(kind, tied), loss_fn=None if kind == "llama" else LOSS, microbatches=4,
            schedule=schedule, context=ctx, fsdp=True, vocab_parallel=True,
        )  # fmt: skip
        mine = [(ids[ctx.dp_rank :: DP], t[ctx.dp_rank :: DP]) for ids, t in _steps(DP)]
        losses = train(pipe, kind, mine)
        lo, hi = chunk_rows(VOCAB, PP, ctx.pp_rank)
        share = chunk_rows(hi - lo, DP, ctx.dp_rank)
        rows = {
            name: (p.to_local().shape[0], share[1] - share[0])
            for name, p in pipe.named_parameters() if name in VOCAB_NAMES
        }  # fmt: skip
        params = list(pipe.named_parameters())
        for name, p in params:
            if name in VOCAB_NAMES:  # the gradient is sharded as the parameter
                assert p.grad is not None and p.grad.to_local().shape == p.to_local().shape
        grads = {name: whole(p.grad) for name, p in params}
        torch.optim.SGD(pipe.parameters(), lr=LR).step()
        values = {name: whole(p) for name, p in params}
        key = f"{kind} {schedule} {tied}"
        out[key] = (losses, grads, values, rows)
        if (kind, schedule, tied) == SAVED:
            conveyor.save(pipe, ckpt, step=1)
            ids, targets = _steps(DP)[0]
            mine_ids = ids[ctx.dp_rank :: DP]
            evaluated = float(pipe.eval_step(mine_ids, targets[ctx.dp_rank :: DP]))
            out["eval"] = (evaluated, pipe.predict(mine_ids), ctx.dp_rank)
    with conveyor.empty_weights():
        meta = TinyGPT(tied=True)
    pipe = conveyor.Pipeline(meta, loss_fn=LOSS, microbatches=2, context=ctx, init_seed=4,
                             fsdp=True, vocab_parallel=True)  # fmt: skip
    out["meta"] = {name: whole(value) for name, value in pipe.state_dict().items()}
    return out


def _check(results: list[dict[str, Any]], ckpt: Path) -> None:
    for key in results[0]:
        if key in ("eval", "meta"):
            continue
        kind, _, tied = key.split()
        want_losses, want_grads = reference(kind, tied == "True", _steps(DP))
        model = make(kind, tied == "True")
        for name, p in model.named_parameters():
            p.grad = want_grads[name].clone()
        torch.optim.SGD(model.parameters(), lr=LR).step()
        want_values = dict(model.named_parameters())
        got_values: dict[str, torch.Tensor] = {}
        for rank, result in enumerate(results):
            losses, grads, values, rows = result[key]
            what = f"{key} rank {rank}"
            for a, b in zip(losses, want_losses, strict=True):
                assert abs(a - b) <= TOL * abs(b), f"{what}: loss {a} != {b}"
            assert_close(grads, {n: want_grads[n] for n in grads}, f"{what} gradients")
            assert_close(values, {n: want_values[n].detach() for n in values}, f"{what} updated")
            got_values.update(values)
            assert rows, f"{what}: no vocabulary weight"
            for name, (held, share) in rows.items():
                # About 1/(pp * dp) of the rows: the rank's dp-share of its pp rows.
                assert held == share <= -(-VOCAB // (PP * DP)) + 1, f"{what}: {name} {held}"
        assert set(got_values) == set(want_grads), f"{key}: {set(want_grads) ^ set(got_values)}"
        if (kind, key.split()[1], tied == "True") == SAVED:
            # Every tensor whole under its name (a tied one under both): the pipeline's.
            state = conveyor.load_model_state(ckpt)
            assert set(state) == set(model.state_dict()), key
            first = {id(p): n for n, p in model.named_parameters()}
            for name, value in model.named_parameters(remove_duplicate=False):
                assert torch.equal(state[name], got_values[first[id(value)]]), name
            # eval_step and predict on the updated weights (gathered for the step).
            ids, targets = _steps(DP)[0]
            with torch.no_grad():
                total, count = LOSS(model(ids), targets)
                want = float(total / count)
                for rank, result in enumerate(results):
                    evaluated, predicted, dp_rank = result["eval"]
                    assert abs(evaluated - want) <= TOL * want, f"rank {rank}: eval {evaluated}"
                    if predicted is not None:  # the last stage's rank
                        err = rel(predicted, model(ids[dp_rank::DP]))
                        assert err < TOL, f"rank {rank}: predict relative error {err:.2e}"
                assert sum(r["eval"][1] is not None for r in results) == DP
    # Meta weights: each rank allocates its shards and gets the unsplit model's values.
    with conveyor.empty_weights():
        meta = TinyGPT(tied=True)
    conveyor.materialize(meta, init_seed=4)
    for rank, result in enumerate(results):
        assert result["meta"], rank
        for name, value in result["meta"].items():
            assert torch.equal(value, meta.state_dict()[name]), f"rank {rank}: meta {name}"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pp2_dp2_fsdp_vocab_is_exact(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    results = distributed.run(_world, 4, str(ckpt), fork=True, timeout=400)
    _check(results, ckpt)
