"""Traces of real runs: every action in schedule order, waits, and a picture."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import conveyor
import conveyor.cli.trace as trace_command
from conveyor.cli.trace import main
from conveyor.observe.pictures import draw_timeline
from conveyor.observe.trace import actions_of
from conveyor.schedules.order import instructions
from tests.support import distributed
from tests.support.models import batch, mlp


def _traced(rank: int, path: str, schedule: str, pp: int) -> None:
    ctx = conveyor.init(pp=pp)
    pipe = conveyor.Pipeline(
        mlp(), loss_fn=nn.functional.mse_loss, microbatches=4, schedule=schedule, context=ctx
    )
    x, y = batch(8)
    for _ in range(2):
        pipe.train_step(x, y)
    pipe.save_trace(path)


def _check(path: Path, schedule: str, ranks: int) -> dict[str, object]:
    trace = json.loads(path.read_text())
    info = trace["otherData"]
    assert info["schedule"] == schedule and info["ranks"] == ranks
    assert 0.0 <= info["measured_bubble"] < 1.0 and 0.0 <= info["simulated_bubble"] < 1.0
    rows = actions_of(trace)
    for rank, order in enumerate(info["order"]):
        ran = [f"{kind}{stage},{mb}" for r, kind, stage, mb, _, _ in rows if r == rank]
        # every action of the rank, in the schedule's order (its program as a table
        # writes it: a pair as F+B, and passes, which these schedules do not have)
        assert ran == [a for word in order for a in word.split("+")]
    kinds = {kind for _, kind, *_ in rows}
    assert kinds == ({"F", "B", "W"} if schedule.startswith("zb") else {"F", "B"})
    return trace


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_two_process_trace_has_every_action_in_order(tmp_path: Path, schedule: str) -> None:
    path = tmp_path / "trace.json"
    distributed.run(_traced, 2, str(path), schedule, 2, fork=True)
    trace = _check(path, schedule, 2)
    events = trace["traceEvents"]
    assert {e["tid"] for e in events if e.get("ph") == "X"} == {0, 1}
    assert any(e.get("cat") == "wait" for e in events)  # rank 0 waits for gradients


def test_one_process_trace_and_its_picture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, png = tmp_path / "trace.json", tmp_path / "trace.png"
    _traced(0, str(path), "zb-h1", 4)
    trace = _check(path, "zb-h1", 4)
    figures: list[Any] = []
    monkeypatch.setattr(
        trace_command, "draw_timeline", lambda *a, **k: figures.append(draw_timeline(*a, **k))
    )
    assert main([str(path), "--png", str(png)]) == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 800 and height >= 300
    (axes,) = figures[0].axes
    assert axes.get_xlabel() == "time (ms)"
    boxes = [e for e in trace["traceEvents"] if "dur" in e]
    step_us = max(e["ts"] + e["dur"] for e in boxes) - min(e["ts"] for e in boxes)
    assert axes.get_xlim()[1] == pytest.approx(step_us / 1e3)  # milliseconds, not seconds
    assert axes.get_title(loc="left").startswith("zb-h1: 4 ranks x 1 chunk(s), 4 micro-batches")
    legend = [t.get_text() for t in axes.get_legend().get_texts()]
    assert legend[:3] == ["F: forward", "B: backward, input gradient", "W: weight gradient"]


def test_the_trace_keeps_the_last_training_step() -> None:
    pipe = conveyor.Pipeline(
        mlp(), loss_fn=nn.functional.mse_loss, microbatches=2, context=conveyor.init(pp=2)
    )
    x, y = batch(8)
    pipe.train_step(x, y)
    kinds = sorted({t[1] for t in pipe.last_step_timings()})
    pipe.predict(x)
    pipe.eval_step(x, y)
    assert sorted({t[1] for t in pipe.last_step_timings()}) == kinds == ["B", "F"]


def test_the_trace_order_is_each_ranks_program_with_its_passes(tmp_path: Path) -> None:
    from conveyor.losses import TokenCrossEntropy
    from tests.vocab.models import TinyGPT, padded_batch

    torch.manual_seed(0)
    pipe = conveyor.Pipeline(
        TinyGPT(False), loss_fn=TokenCrossEntropy(shift=True), microbatches=2,
        context=conveyor.init(pp=2), vocab_parallel=True,
    )  # fmt: skip
    pipe.train_step(*padded_batch(4, 6, seed=0))
    path = tmp_path / "trace.json"
    pipe.save_trace(path)
    order = json.loads(path.read_text())["otherData"]["order"]
    # 1F1B on 2 ranks, 2 micro-batches, its vocabulary passes where each rank runs them
    assert pipe.schedule.vocab
    assert order == [
        [str(step) for step in instructions(pipe.schedule, rank)] for rank in range(2)
    ]
    assert [w for w in order[0] if "," not in w] == [str(v) for v in pipe.schedule.vocab]
    rows = actions_of(json.loads(path.read_text()))
    for rank in range(2):
        ran = [f"{kind}{stage},{mb}" for r, kind, stage, mb, _, _ in rows if r == rank]
        assert ran == [w for w in order[rank] if "," in w]


def test_a_tracked_step_puts_each_actions_bytes_in_the_trace(tmp_path: Path) -> None:
    """With track_memory, an F carries what it saved and a B what its micro-batch holds
    until its W: the memory report's numbers, per action."""
    pipe = conveyor.Pipeline(
        mlp(), loss_fn=nn.functional.mse_loss, microbatches=4, schedule="zb-h1",
        context=conveyor.init(pp=2), track_memory=True,
    )  # fmt: skip
    x, y = batch(8)
    for _ in range(2):
        pipe.train_step(x, y)
    pipe.save_trace(tmp_path / "trace.json")
    report = pipe.last_step_memory()
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    args = {(e["cat"], e["args"]["stage"], e["args"]["microbatch"]): e["args"]
            for e in events if e.get("cat") in ("F", "B", "W")}  # fmt: skip
    assert len(args) == 3 * 2 * 4
    for (kind, s, m), got in args.items():
        if kind == "F":
            assert got["saved_bytes"] == report.forward[s, m] > 0
        elif kind == "B":
            assert got["held_bytes"] == report.held[s, m] > 0
        else:
            assert "held_bytes" not in got and "saved_bytes" not in got
