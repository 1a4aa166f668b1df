"""The overlap DualPipeV exists for: a paired forward and backward interleaved at their
expert all-to-alls, on pp=2 x dp=2 x ep=2 (4 processes), a tiny 4-layer Mixtral from its
config.

One world runs dualpipev as generated (its pairs marked), 1f1b with its steady state's
pairs marked (``paired``) and dualpipev without pairs, two training steps each of other
sequence lengths, recording everything each rank posts (``tests/support/nccl_record.py``). Checked:

- the paired runs' losses and gradients equal the unpaired run's and the unsplit model's;
- in a paired tick the all-to-alls of its F and of its B are in flight at the same time
  (each posted while the other's waits), and without pairs no two all-to-alls ever are;
- the saved trace shows the all-to-alls of both pipeline ranks;
- with dropout on, the paired run with recompute equals the paired and the unpaired run
  without it (each action of a pair keeps its own random-number stream);
- the posts replay deadlock-free under NCCL's rules (``tests/support/nccl_model.py``), and
  the two ranks of each ep group post their all-to-alls in the same order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import conveyor
from conveyor.schedules import get_schedule, paired, unpaired
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
from tests.support.captures import captured
from tests.support.helpers import assert_close
from tests.support.nccl_model import Record, check

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

RUNS = ("dualpipev", "dualpipev unpaired", "1f1b")
# Dropout on: the paired 1f1b with recompute (its B replays the forward's masks while the
# paired F draws its own) must equal the run without recompute and the unpaired run.
DROPOUT_RUNS = ("1f1b dropout", "1f1b dropout recompute", "1f1b dropout unpaired")
LAYERS = 4  # a MoE layer in each of dualpipev's 4 stages


def _overlapping(spans: list[tuple[str, float, float]]) -> set[tuple[str, str]]:
    """Pairs of actions (by name) with all-to-alls in flight at the same time."""
    found = set()
    ordered = sorted(spans, key=lambda s: s[1])
    for i, (a, _, hi) in enumerate(ordered):
        for b, lo2, _ in ordered[i + 1 :]:
            if lo2 >= hi:
                break
            if a != b:
                found.add((a, b))
    return found


def _model(run: str) -> torch.nn.Module:
    model = model_of("mixtral", aux=False, layers=LAYERS)
    if "dropout" in run:
        model.config.attention_dropout = 0.3
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.3
    return model


def ranks(
    rank: int, trace_file: str, models: dict[str, torch.nn.Module] | None = None
) -> dict[str, Any]:
    """Every run on this rank; ``models``: each run's model (else built here)."""
    from tests.support.nccl_record import recording

    ctx = conveyor.init(pp=PP, dp=DP, ep=EP, timeout=120)
    out: dict[str, Any] = {"pp": ctx.pp_rank}
    for run in RUNS + DROPOUT_RUNS:
        name = run.split()[0]
        schedule = get_schedule(name, PP, MICRO)
        # 1f1b is generated unpaired (its pairs cost more than they hide, with one stage a
        # rank), but its pairs are the non-split backward's case: pair it here.
        schedule = unpaired(schedule) if run.endswith("unpaired") else paired(schedule)
        model = _model(run) if models is None else models[run]
        shards = shards_of(ctx.dp_rank)
        with recording() as trace:
            pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=MICRO, schedule=schedule,
                                     sample=(shards[0], None),
                                     recompute="recompute" in run)  # fmt: skip
            steps = train(pipe, shards, seed=10 + rank)  # the same masks in every dropout run
        if run == "dualpipev":
            pipe.save_trace(trace_file)
        spans = [
            (f"{w.stage},{w.microbatch}", w.start, w.end)
            for w in pipe.last_step_waits()
            if w.kind == "A"
        ]
        out[run] = dict(
            steps=steps,
            spans=spans,
            pairs=sum(len(p) for p in pipe.schedule.pairs),
            trace=[r.to_dict() for r in trace],
        )
    return out


def test_paired_steps_overlap_all_to_alls_exactly_and_replay_under_nccl_rules(
    tmp_path: Path,
) -> None:
    want = reference("mixtral", aux=False, layers=LAYERS)
    trace_file = tmp_path / "trace.json"
    # Each run's model captured here, as every rank's Pipeline captures it: the forked
    # ranks split it without exporting it again (tests/support/captures.py).
    models = {run: captured(_model(run), shards_of(0)[0], MICRO) for run in RUNS + DROPOUT_RUNS}
    results = distributed.run(ranks, PP * DP, str(trace_file), models, timeout=600, fork=True)
    for rank, got in enumerate(results):
        base = got["1f1b dropout"]["steps"]
        for run in DROPOUT_RUNS[1:]:
            for step, ((loss, grads), (want_loss, want_grads)) in enumerate(
                zip(got[run]["steps"], base, strict=True)
            ):
                what = f"{run} rank {rank} step {step}"
                assert loss == pytest.approx(want_loss, rel=1e-5), (what, loss, want_loss)
                assert_close(grads, want_grads, what)
        assert got["1f1b dropout"]["steps"][0][0] != got["1f1b"]["steps"][0][0]  # dropout on
    # The trace shows each pipeline rank's all-to-alls beside its actions.
    events = json.loads(trace_file.read_text())["traceEvents"]
    spans = [e for e in events if e.get("cat") == "all-to-all"]
    assert {e["tid"] for e in spans} == {0, 1}, spans[:3]
    assert all(e["dur"] > 0 and e["name"].startswith("all-to-all ") for e in spans)
    for run in RUNS:
        for rank, got in enumerate(results):
            for step, ((loss, grads), (want_loss, want_grads)) in enumerate(
                zip(got[run]["steps"], want, strict=True)
            ):
                what = f"{run} rank {rank} step {step}"
                assert loss == pytest.approx(want_loss, rel=1e-5), (what, loss, want_loss)
                assert_close(grads, {n: want_grads[n] for n in grads}, what)
        traces = {
            rank: [Record.from_dict(r) for r in got[run]["trace"]]
            for rank, got in enumerate(results)
        }
        try:
            check(traces)
        except AssertionError as exc:
            raise AssertionError(f"{run}:\n{exc}") from None
        # The ranks of one ep group (same pipeline rank) post the same all-to-alls in order.
        for pp in range(PP):
            group = [r for r, got in enumerate(results) if got["pp"] == pp]
            posted = [sum(r.name == "all_to_all_single" for r in traces[g]) for g in group]
            assert posted[0] > 0 and len(set(posted)) == 1, (run, pp, posted)
    # dualpipev: on pipeline rank 1 both actions of each pair have all-to-alls (rank 0's
    # pairs F3+B0 have none in B0: stage 0's input is token ids, so its backward is all W);
    # 1f1b: rank 0's F0+B0 pairs. Without pairs no two all-to-alls are ever in flight.
    for rank, got in enumerate(results):
        assert got["dualpipev"]["pairs"] > 0 and got["dualpipev unpaired"]["pairs"] == 0
        if got["pp"] == 1:
            assert _overlapping(got["dualpipev"]["spans"]), (rank, got["dualpipev"]["spans"])
        else:
            assert _overlapping(got["1f1b"]["spans"]), (rank, got["1f1b"]["spans"])
        assert not _overlapping(got["dualpipev unpaired"]["spans"]), rank
