"""Vocabulary parallelism with expert parallelism: Qwen2-MoE (a shared expert, its router
auxiliary loss on) and Mixtral (router loss off) on pp=2 x dp=2 x ep=2 (4 processes),
``loss_fn=None``, on 1f1b and on dualpipev, whose F/B pairs run interleaved on two threads
(conveyor/runtime/overlap.py): the first stage's input embedding and the last stage's
hidden states are handed over by micro-batch, so an F and a B of other micro-batches
running together each get their own. Also 1f1b with its steady state paired and every
stage recomputed: a recomputed first-stage forward runs inside a paired backward while
the pair's forward runs another micro-batch. And dualpipev under FSDP (the rows' holder one
more FSDP unit beside the stages and the experts).

Against the unsplit model (tests/parallel/test_moe_pipeline.py's reference: two steps of
padded rows with an SGD step between, each replica its own rows): every rank's loss, and
every gradient (experts and vocabulary rows gathered whole). What every rank posts (the
point-to-point transfers, the all-to-alls and the vocabulary collectives) replays
deadlock-free under NCCL's rules.
"""

from __future__ import annotations

from typing import Any

import pytest

import conveyor
from conveyor.experts import is_expert_parameter
from conveyor.schedules import get_schedule, paired
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
from tests.support.nccl_model import Record, check

pytest.importorskip("transformers")

RUNS = [
    ("qwen2_moe", True, "1f1b"),
    ("qwen2_moe", True, "dualpipev"),
    ("qwen2_moe", True, "1f1b paired recompute"),
    ("qwen2_moe", True, "dualpipev fsdp"),
    ("mixtral", False, "1f1b"),
    ("mixtral", False, "dualpipev"),
]


def _ranks(rank: int, runs: list[tuple[str, bool, str]]) -> dict[str, Any]:
    from tests.support.nccl_record import recording

    ctx = conveyor.init(pp=PP, dp=DP, ep=EP)
    out: dict[str, Any] = {}
    for kind, aux, run in runs:
        shards = shards_of(ctx.dp_rank)
        schedule = get_schedule(run.split()[0], PP, MICRO)
        with recording() as trace:
            pipe = conveyor.Pipeline(
                model_of(kind, aux), loss_fn=None, microbatches=MICRO,
                schedule=paired(schedule) if "paired" in run else schedule,
                recompute="recompute" in run, fsdp="fsdp" in run, vocab_parallel=True,
                sample=(shards[0], None),
            )  # fmt: skip
            steps = train(pipe, shards)
        experts = [n for n, p in pipe.named_parameters() if is_expert_parameter(p)]
        rows = [n for n, p in pipe.vocab_layers.named_parameters()]
        out[f"{kind} {run}"] = dict(
            steps=steps, experts=experts, rows=rows, pairs=bool(pipe.schedule.pairs),
            trace=[r.to_dict() for r in trace],
        )  # fmt: skip
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
                assert_close(grads, {n: want_grads[n] for n in grads}, what)
        names = set().union(*(set(g[key]["steps"][0][1]) for g in results))
        assert names == set(want[0][1]), key
        assert results[0][key]["pairs"] == ("1f1b" not in key or "paired" in key), key
        traces = {r: [Record.from_dict(x) for x in got[key]["trace"]] for r, got in
                  enumerate(results)}  # fmt: skip
        try:
            check(traces)
        except AssertionError as exc:
            raise AssertionError(f"{key}:\n{exc}") from None
