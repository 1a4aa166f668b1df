"""A dead or stalled rank makes the others fail fast with a message naming it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import conveyor
from tests.support import distributed
from tests.support.models import batch, mlp


class Fault(nn.Module):
    """Identity, except on ``rank`` at its ``after``-th call it dies or hangs."""

    def __init__(self, rank: int, after: int, how: str) -> None:
        super().__init__()
        self.rank, self.after, self.how, self.calls = rank, after, how, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if int(os.environ["RANK"]) == self.rank and self.calls == self.after:
            if self.how == "die":
                os._exit(3)
            time.sleep(3600)
        return x


def _faulty_run(rank: int, how: str, timeout: float, dp: int = 1, culprit: int = 1) -> str:
    """A 2-stage pipeline (``dp`` replicas) where rank ``culprit`` dies or hangs in its
    third forward; returns how long this rank took to fail and its error."""
    ctx = conveyor.init(pp=2, dp=dp, timeout=timeout)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), Fault(culprit, 3, how), nn.Linear(8, 4))
    pipe = conveyor.Pipeline(
        model, loss_fn=nn.functional.mse_loss, microbatches=4, balance=[2, 2], context=ctx
    )
    x, y = batch(8)
    start = time.monotonic()
    try:
        pipe.train_step(x, y)
    except conveyor.PipelineError as exc:
        return f"{time.monotonic() - start:.1f}s {exc}"
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_dead_rank_fails_the_others_with_its_name() -> None:
    (msg,) = distributed.run(_faulty_run, 2, "die", 60.0, expect=[0], timeout=120, fork=True)
    seconds, text = msg.split("s ", 1)
    assert float(seconds) < 30, msg
    assert "rank 1" in text and "rank 0:" in text, msg
    # Rank 1 dies in the forward of micro-batch 2, so rank 0 waits on that gradient.
    assert "B(stage 0, micro-batch 2) waiting for gradients of B(stage 1, micro-batch 2)" in text, (
        msg
    )


@pytest.mark.multiprocess
@pytest.mark.slow
def test_stalled_rank_times_out_within_the_set_limit() -> None:
    (msg,) = distributed.run(_faulty_run, 2, "hang", 3.0, expect=[0], timeout=120, fork=True)
    seconds, text = msg.split("s ", 1)
    assert 2.5 <= float(seconds) < 20, msg
    assert "rank 1" in text and "3 s" in text, msg
    assert "waiting for gradients of B(stage 1, micro-batch 2)" in text, msg


@pytest.mark.multiprocess
@pytest.mark.slow
def test_stalled_rank_under_data_parallelism_fails_every_other_rank() -> None:
    # Rank 3 (pipeline rank 1 of replica 1) hangs: its pipeline peer times out on the
    # transfer, the other replica on the gradient average; nobody waits forever.
    msgs = distributed.run(
        _faulty_run, 4, "hang", 3.0, 2, 3, expect=[0, 1, 2], timeout=120, fork=True
    )
    for rank, msg in zip((0, 1, 2), msgs, strict=False):
        seconds, text = msg.split("s ", 1)
        assert 2.5 <= float(seconds) < 30, msg
        assert f"rank {rank}" in text, msg
    assert "rank 3" in msgs[2] and "B(stage 1, micro-batch 2)" in msgs[2], msgs[2]
    assert "averaging gradients" in msgs[0] + msgs[1], msgs


class Counter(nn.Module):
    """Returns its input and how often it was called: a non-tensor that varies."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        self.calls += 1
        return x, self.calls


class UseFirst(nn.Module):
    def forward(self, value: tuple[torch.Tensor, int]) -> torch.Tensor:
        return value[0]


class ToMeta(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to("meta")


def _bad_output_run(rank: int, kind: str) -> str:
    ctx = conveyor.init(timeout=5)
    torch.manual_seed(0)
    middle: list[nn.Module] = [Counter(), UseFirst()] if kind == "varying" else [ToMeta()]
    model = nn.Sequential(nn.Linear(8, 8), *middle, nn.Linear(8, 4))
    balance = [2, 2] if kind == "varying" else [2, 1]
    pipe = conveyor.Pipeline(
        model, loss_fn=nn.functional.mse_loss, microbatches=2, balance=balance, context=ctx
    )
    x, y = batch(4)
    try:
        for _ in range(3):
            pipe.train_step(x, y)
    except conveyor.PipelineError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_varying_non_tensor_output_is_reported_with_stage_and_value() -> None:
    (msg,) = distributed.run(_bad_output_run, 2, "varying", expect=[0], timeout=120, fork=True)
    want = "stage 0 (micro-batch 0) output changed (output value 1 was 1, now 3)"
    assert msg.startswith(want), msg


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_tensor_on_the_wrong_device_is_reported_with_stage_and_value() -> None:
    (msg,) = distributed.run(_bad_output_run, 2, "device", expect=[0], timeout=120, fork=True)
    assert msg.startswith("stage 0 (micro-batch 0) returned tensor 0 of its output on meta"), msg


@pytest.mark.multiprocess
@pytest.mark.slow
def test_stalled_rank_is_named_when_waits_are_stream_ordered() -> None:
    # The CUDA path (waits without a time-out, a watchdog naming what is late), run on
    # gloo: the other rank still fails within the time-out, naming the rank and action.
    env = {"CONVEYOR_STREAM_WAITS": "1"}
    (msg,) = distributed.run(
        _faulty_run, 2, "hang", 3.0, expect=[0], timeout=120, env=env, fork=True
    )
    seconds, text = msg.split("s ", 1)
    assert 2.5 <= float(seconds) < 20, msg
    assert "rank 1" in text and "rank 0:" in text, msg
    assert "waiting for gradients of B(stage 1, micro-batch 2)" in text, msg


class _Never:
    """A work that never completes."""

    def is_completed(self) -> bool:
        return False


class _Done:
    def is_completed(self) -> bool:
        return True


def test_watchdog_names_the_late_work_and_aborts() -> None:
    from conveyor.runtime.watchdog import Watchdog

    aborted: list[float] = []
    dog = Watchdog(0.3, on_expire=lambda: aborted.append(time.monotonic()), poll=0.02)
    start = time.monotonic()
    dog.watch(_Done(), "rank 0: F(stage 1, micro-batch 0) waiting ... from rank 1", "rank 1")  # type: ignore[arg-type]
    dog.watch(_Never(), "rank 0: B(stage 0, micro-batch 2) waiting ... from rank 1", "rank 1")  # type: ignore[arg-type]
    while not aborted and time.monotonic() - start < 5:
        time.sleep(0.01)
    assert aborted and 0.3 <= aborted[0] - start < 1.0
    try:
        dog.check()
    except conveyor.PipelineError as exc:
        text = str(exc)
    else:
        raise AssertionError("the watchdog did not fail")
    assert text.startswith("rank 0: B(stage 0, micro-batch 2) waiting"), text
    assert "did not finish within 0.3 s; rank 1 may have died or stalled" in text


def test_watchdog_stays_quiet_while_works_finish() -> None:
    from conveyor.runtime.watchdog import Watchdog

    aborted: list[int] = []
    dog = Watchdog(0.2, on_expire=lambda: aborted.append(1), poll=0.02)
    for _ in range(20):
        dog.watch(_Done(), "done", "nobody")  # type: ignore[arg-type]
        time.sleep(0.02)
    time.sleep(0.3)
    dog.check()
    assert not aborted


def _between_steps(rank: int, what: str, folder: str) -> str:
    """Rank 1 leaves after the first step (or skips a collective); rank 0 goes on."""
    ctx = conveyor.init(pp=2, timeout=3.0)
    pipe = conveyor.Pipeline(mlp(), loss_fn=nn.functional.mse_loss, microbatches=2, context=ctx)
    x, y = batch(8)
    pipe.train_step(x, y)
    if rank == 1:
        if what == "dies":
            os._exit(0)
        time.sleep(5)  # alive, but never calls the collective
        return "rank 1 skipped it"
    start = time.monotonic()
    try:
        if what == "save":
            conveyor.save(pipe, os.path.join(folder, "never-committed"))
        else:
            pipe.train_step(x, y)
    except conveyor.PipelineError as e:
        return f"{time.monotonic() - start:.1f}s {e}"
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("what", ["dies", "save"])
def test_a_rank_missing_between_steps_is_named(what: str, tmp_path: Path) -> None:
    results = distributed.run(
        _between_steps, 2, what, str(tmp_path), expect=[0], timeout=120, fork=True
    )
    seconds, text = results[0].split("s ", 1)
    assert float(seconds) < 20, results[0]
    if what == "save":
        assert "rank 0: agreeing on the checkpoint" in text, text
        assert "every rank must call conveyor.save" in text, text
    else:  # rank 0 starts without waiting for rank 1; its first wait on rank 1 fails
        assert "rank 0: B(stage 0, micro-batch 0) waiting for gradients" in text, text
        assert "rank 1 may have died or stalled" in text, text
