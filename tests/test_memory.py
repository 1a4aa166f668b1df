"""Activation memory measured in a real step, beside the schedule's memory model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.schedules.registry import get_schedule
from tests import distributed
from tests.models import batch, mlp

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2)]
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


def _check(report: Any, name: str) -> None:
    assert report.peak > 0
    assert abs(report.peak / report.simulated_peak - 1) <= 0.10, (name, report)
    assert all(size > 0 for size in report.forward.values()), (name, report.forward)
    if name == "gpipe":  # every micro-batch's activations are held at once
        assert report.peak == pytest.approx(sum(report.forward.values()), rel=0.10)


def test_measured_peak_matches_the_schedule_on_two_ranks() -> None:
    results = distributed.run(_measure, 2, 2)
    for rank, reports in enumerate(results):
        for name, report in reports.items():
            _check(report, name)
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
    for name, report in reports.items():
        _check(report, name)
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
