"""Vocabulary parallelism with expert parallelism: Qwen2-MoE (a shared expert, its router
auxiliary loss on) and Mixtral (router loss off) on pp=2 x dp=2 x ep=2 (4 processes),
``loss_fn=None``, on 1f1b and on dualpipev, whose F/B pairs run interleaved on two threads
(conveyor/runtime/overlap.py): the first stage's input embedding and the last stage's
hidden states are handed over by micro-batch, so an F and a B of other micro-batches
running together each get their own.

Against the unsplit model (tests/parallel/test_moe_pipeline.py's reference: two steps of
padded rows with an SGD step between, each replica its own rows): every rank's loss, and
every gradient (experts and vocabulary rows gathered whole).
"""

from __future__ import annotations

from typing import Any

import pytest

import conveyor
from conveyor.experts import is_expert_parameter
from tests.parallel.test_moe_pipeline import (
    DP,
    EP,
    MICRO,
    PP,
    model_of,
    reference,
    shards_of,
    train,
)
from tests.support import distributed
from tests.support.helpers import assert_close

pytest.importorskip("transformers")

RUNS = [
    ("qwen2_moe", True, "1f1b"),
    ("qwen2_moe", True, "dualpipev"),
    ("mixtral", False, "1f1b"),
    ("mixtral", False, "dualpipev"),
]


def _ranks(rank: int, runs: list[tuple[str, bool, str]]) -> dict[str, Any]:
    ctx = conveyor.init(pp=PP, dp=DP, ep=EP)
    out: dict[str, Any] = {}
    for kind, aux, schedule in runs:
        shards = shards_of(ctx.dp_rank)
        pipe = conveyor.Pipeline(
            model_of(kind, aux), loss_fn=None, microbatches=MICRO, schedule=schedule,
            vocab_parallel=True, sample=(shards[0], None),
        )  # fmt: skip
        experts = [n for n, p in pipe.named_parameters() if is_expert_parameter(p)]
        rows = [n for n, p in pipe.vocab_layers.named_parameters()]
        out[f"{kind} {schedule}"] = dict(steps=train(pipe, shards), experts=experts, rows=rows)
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_qwen2_moe_and_mixtral_with_experts_and_rows_split_are_exact() -> None:
    results = distributed.run(_ranks, PP * DP, RUNS, timeout=600, fork=True)
    wants = {(kind, aux): reference(kind, aux) for kind, aux, _ in RUNS}
    for kind, aux, schedule in RUNS:
        key = f"{kind} {schedule}"
        want = wants[kind, aux]
        for rank, got in enumerate(results):
            run = got[key]
            assert run["experts"] and run["rows"], key  # both really split here
            for step, ((loss, grads), (want_loss, want_grads)) in enumerate(
                zip(run["steps"], want, strict=True)
            ):
                what = f"{key} rank {rank} step {step}"
                assert loss == pytest.approx(want_loss, rel=1e-5), (what, loss, want_loss)
                assert_close(grads, {n: want_grads[n] for n in grads}, what, tol=1e-5)
        names = set().union(*(set(g[key]["steps"][0][1]) for g in results))
        assert names == set(want[0][1]), key
