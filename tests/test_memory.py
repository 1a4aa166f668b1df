"""Activation memory measured in a real step, beside the schedule's memory model: every
schedule of the registry, in one process and on 2 processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.schedules import Action, B, F, Schedule, execution_order
from conveyor.schedules.registry import SCHEDULE_NAMES, default_chunks, get_schedule
from tests import distributed
from tests.models import batch, mlp

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


def _model_peak(actions: list[Action], schedule: Schedule, report: Any) -> int:
    """The schedule's memory model over ``actions`` with the measured sizes: F's bytes held
    until the last of B / W; under a split backward B's change held until W."""
    held = peak = 0
    for a in actions:
        key = a.stage, a.microbatch
        if a.kind == F:
            held += report.forward[key]
        elif a.kind == B and not schedule.split_backward:
            held -= report.forward[key]
        elif a.kind == B:
            held += report.at_backward[key]
        else:
            held -= report.forward[key] + report.at_backward[key]
        peak = max(peak, held)
    return peak


def _check(report: Any, name: str, rank: int | None) -> None:
    """``rank``: this process's pipeline rank; None for the one-process world (pp=2)."""
    schedule = get_schedule(name, 2, M, dict(SCHEDULES)[name])
    actions = (
        [a for _, a in execution_order(schedule)] if rank is None else list(schedule.actions[rank])
    )
    model = _model_peak(actions, schedule, report)
    assert report.simulated_peak == model, (name, report)
    assert report.peak > 0
    assert abs(report.peak / model - 1) <= 0.10, (name, report)
    assert all(size > 0 for size in report.forward.values()), (name, report.forward)
    if name == "gpipe":  # every micro-batch's activations are held at once
        assert report.peak == pytest.approx(sum(report.forward.values()), rel=0.10)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_measured_peak_matches_the_schedule_on_two_ranks() -> None:
    results = distributed.run(_measure, 2, 2)
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
