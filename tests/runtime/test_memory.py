"""Activation memory measured in a real step, beside the schedule's memory model: every
schedule of the registry, in one process and on 2 processes; and what recompute keeps, on
the schedules where a forward runs right before its own backward (then it keeps its
activations instead of recomputing them) and where it does not."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.schedules import Action, B, F, execution_order
from conveyor.schedules.registry import SCHEDULE_NAMES, default_chunks, get_schedule
from tests.support import distributed
from tests.support.helpers import memory_model_peak
from tests.support.models import batch, mlp
from tests.support.trainer_forked import run_forked

# Every schedule of the registry at its own chunk count; both measuring tests check that a
# report came back for each name.
SCHEDULES = [(name, default_chunks(name)) for name in SCHEDULE_NAMES]
M = 4


def _measure(rank: int, pp: int) -> dict[str, Any]:
    ctx = conveyor.init(pp=pp)
    x, y = batch(32)
    out = {}
    for name, chunks in SCHEDULES:
        pipe = conveyor.Pipeline(
            mlp(layers=8, width=64),
            loss_fn=nn.functional.mse_loss,
            microbatches=M,
            schedule=name,
            chunks=chunks,
            context=ctx,
            track_memory=True,
        )
        for _ in range(2):  # the second step has .grad already, like training
            pipe.train_step(x, y)
        out[name] = pipe.last_step_memory()
    return out


def _check(report: Any, name: str, rank: int | None) -> None:
    """``rank``: this process's pipeline rank; None for the one-process world (pp=2)."""
    schedule = get_schedule(name, 2, M, dict(SCHEDULES)[name])
    actions = (
        [a for _, a in execution_order(schedule)] if rank is None else list(schedule.actions[rank])
    )
    model = memory_model_peak(actions, schedule.split_backward, report)
    assert report.simulated_peak == model, (name, report)
    assert report.peak > 0
    assert abs(report.peak / model - 1) <= 0.10, (name, report)
    assert all(size > 0 for size in report.forward.values()), (name, report.forward)
    if name == "gpipe":  # every micro-batch's activations are held at once
        assert report.peak == pytest.approx(sum(report.forward.values()), rel=0.10)


# Recompute: the fused and split backward, one and two chunks; 4 stages' worth of ranks.
RECOMPUTED = [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)]
ROWS = 8  # per micro-batch: a batch of 64 in 8


def _recompute(rank: int, pp: int) -> dict[tuple[str, bool], Any]:
    """Each schedule's memory report without and with recompute (8 micro-batches)."""
    ctx = conveyor.init(pp=pp, timeout=45)
    x, y = batch(8 * ROWS)
    out = {}
    for name, chunks in RECOMPUTED:
        for recompute in (False, True):
            pipe = conveyor.Pipeline(
                mlp(layers=8, width=64), loss_fn=nn.functional.mse_loss, microbatches=8,
                schedule=name, chunks=chunks, context=ctx, recompute=recompute,
                track_memory=True,
            )  # fmt: skip
            for _ in range(2):
                pipe.train_step(x, y)
            out[name, recompute] = pipe.last_step_memory()
    return out


def _adjacent(actions: list[Action]) -> set[tuple[int, int]]:
    """The (stage, micro-batch)s whose F runs right before their own B."""
    return {
        (a.stage, a.microbatch)
        for a, b in itertools.pairwise(actions)
        if a.kind == F and b.kind == B and (a.stage, a.microbatch) == (b.stage, b.microbatch)
    }


def _check_recompute(reports: dict[tuple[str, bool], Any], pp: int, rank: int | None) -> None:
    """With recompute, F keeps only the stage input (8 features into stage 0, 64 into the
    others, float32), except where its B follows at once: there it keeps what autograd
    saved, as without recompute; and the peak is the schedule's with those sizes (``rank``:
    this process's pipeline rank; None for the one-process world)."""
    for name, chunks in RECOMPUTED:
        schedule = get_schedule(name, pp, 8, chunks)
        order = [a for _, a in execution_order(schedule)]
        actions = order if rank is None else list(schedule.actions[rank])
        adjacent = _adjacent(actions)
        plain, kept = reports[name, False], reports[name, True]
        assert set(kept.forward) == set(plain.forward), name
        for key, full in plain.forward.items():
            stage_input = ROWS * (8 if key[0] == 0 else 64) * 4
            if key in adjacent:
                assert kept.forward[key] >= full, (name, key, kept.forward, sorted(adjacent))
            else:
                assert kept.forward[key] == stage_input, (name, key, kept.forward)
        model = memory_model_peak(actions, schedule.split_backward, kept)
        assert kept.simulated_peak == model, name
        # Measured: the model's peak, plus (across processes, where one rank's model peak
        # is small) one micro-batch's activations recomputed at a B, never above no recompute.
        one = max(plain.forward.values())
        assert kept.simulated_peak <= kept.peak <= kept.simulated_peak * 1.1 + 1.5 * one, name
        assert kept.peak <= plain.peak, (name, kept.peak, plain.peak)
        if rank is None:  # all stages in one process: the transient is a small share
            assert abs(kept.peak / kept.simulated_peak - 1) <= 0.10, (name, kept)
            assert kept.peak < plain.peak, (name, kept.peak, plain.peak)


def test_recompute_keeps_only_stage_inputs_but_where_backward_follows_at_once() -> None:
    reports = _recompute(0, 4)
    _check_recompute(reports, 4, None)
    # In one process the last stage's F runs right before its B on 1f1b: kept, not recomputed.
    assert _adjacent([a for _, a in execution_order(get_schedule("1f1b", 4, 8, 1))]) == {
        (3, m) for m in range(8)
    }


@pytest.mark.multiprocess
@pytest.mark.slow
def test_measured_peak_matches_the_schedule_on_two_ranks() -> None:
    results = distributed.run(_measure, 2, 2, fork=True)
    for rank, reports in enumerate(results):
        assert set(reports) == set(SCHEDULE_NAMES)
        for name, report in reports.items():
            _check(report, name, rank)
            held = get_schedule(name, 2, M, dict(SCHEDULES)[name]).stages_of(rank)
            assert {s for s, _ in report.forward} == set(held)
    # 1F1B: rank 0 holds 2 micro-batches at its peak, the last rank 1.
    one = [reports["1f1b"] for reports in results]
    per_mb = [max(r.forward.values()) for r in one]
    assert one[0].peak == pytest.approx(2 * per_mb[0], rel=0.10)
    assert one[1].peak == pytest.approx(per_mb[1], rel=0.10)
    assert one[0].peak < results[0]["gpipe"].peak


@pytest.mark.multiprocess
@pytest.mark.slow
def test_recompute_memory_on_four_ranks() -> None:
    """Each rank's own order decides what is adjacent: on 1f1b the last rank's every F."""
    results = run_forked(_recompute, 4, 4, timeout=90)  # forked: no 4 fresh imports of torch
    for rank, reports in enumerate(results):
        _check_recompute(reports, 4, rank)
    last = results[3]["1f1b", True].forward
    assert all(last[3, m] > ROWS * 64 * 4 for m in range(8))  # kept whole, not recomputed


def test_one_process_world_and_errors() -> None:
    reports = _measure(0, 2)
    assert set(reports) == set(SCHEDULE_NAMES)
    for name, report in reports.items():
        _check(report, name, None)
    pipe = conveyor.Pipeline(
        mlp(), loss_fn=nn.functional.mse_loss, microbatches=2, context=conveyor.init(pp=2)
    )
    with pytest.raises(conveyor.ConfigError, match="track_memory=True"):
        pipe.last_step_memory()
    tracked = conveyor.Pipeline(
        mlp(),
        loss_fn=nn.functional.mse_loss,
        microbatches=2,
        context=conveyor.init(pp=2),
        track_memory=True,
    )
    with pytest.raises(conveyor.ConfigError, match="no training step"):
        tracked.last_step_memory()
    x, y = batch(8)
    with torch.no_grad():
        tracked.eval_step(x, y)  # evaluation holds nothing for a backward
    with pytest.raises(conveyor.ConfigError, match="no training step"):
        tracked.last_step_memory()
