"""A dead or stalled rank makes the others fail fast with a message naming it."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

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


# --- an error on one rank reaches every other rank at once ------------------------------


class Raises(nn.Module):
    """Identity, except on global rank ``rank`` at its ``after``-th call: raises."""

    def __init__(self, rank: int, after: int) -> None:
        super().__init__()
        self.rank, self.after, self.calls = rank, after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if int(os.environ["RANK"]) == self.rank and self.calls == self.after:
            raise RuntimeError("the layer broke")
        return x


def _one_rank_fails(
    rank: int, layout: tuple[int, int, int], culprit: int, how: str, catch: str = ""
) -> dict[str, Any]:
    """One good step, then rank ``culprit`` fails the next one (``how``: ``targets``, no
    targets on a last-stage rank; ``sizes``, targets one row short; ``forward``, a layer
    raises in its third call; ``loss``, ``loss_fn`` raises at its third micro-batch;
    ``die``: the process ends in its third forward). Returns this rank's error and
    when (wall clock) the failing step began and ended. The culprit lets the error
    propagate, or with ``catch="return"`` returns it as the others do, or with
    ``catch="stay"`` stays 10 s before that (its process, and its connections, alive: the
    others learn of the failure from the board alone)."""
    pp, dp, tp = layout
    ctx = conveyor.init(pp=pp, dp=dp, tp=tp)
    torch.manual_seed(0)
    width = 16
    layers: list[nn.Module] = [nn.Linear(width, width) for _ in range(2 * pp)]
    balance = [2] * pp
    if how in ("forward", "die"):  # in the culprit's stage, at the next step's 3rd call
        where = (culprit // tp) % pp
        fault = Fault(culprit, 4 + 3, "die") if how == "die" else Raises(culprit, 4 + 3)
        layers.insert(2 * where + 1, fault)
        balance[where] += 1
    losses = {"calls": 0}

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        losses["calls"] += 1
        if how == "loss" and rank == culprit and losses["calls"] == 4 + 3:
            raise ValueError("the loss broke")
        return nn.functional.mse_loss(out, target)

    options: dict[str, Any] = {}
    if tp > 1:  # each stage's two layers: columns, then rows
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        options["tp_plan"] = {"[02]": ColwiseParallel(), "[13]": RowwiseParallel()}
    model = nn.Sequential(*layers)
    pipe = conveyor.Pipeline(
        model, loss_fn=loss_fn, microbatches=4, balance=balance, context=ctx, **options
    )
    g = torch.Generator().manual_seed(ctx.dp_rank)
    x, y = torch.randn(8, width, generator=g), torch.randn(8, width, generator=g)
    pipe.train_step(x, y)
    if rank == culprit and how == "targets":
        y = None  # type: ignore[assignment]
    elif rank == culprit and how == "sizes":
        y = y[:7]
    began = time.time()
    try:
        pipe.train_step(x, y)
    except Exception as exc:
        if rank == culprit and not catch:
            raise
        ended = time.time()
        if rank == culprit and catch == "stay":
            time.sleep(10)
        return {"error": f"{type(exc).__name__}: {exc}", "began": began, "ended": ended}
    return {"error": None, "began": began, "ended": time.time()}


RUNS = {
    # name: processes, (pp, dp, tp), culprit, how, catch
    "pp2-last-rank-no-targets": (2, (2, 1, 1), 1, "targets", ""),
    "pp2-last-rank-no-targets-caught": (2, (2, 1, 1), 1, "targets", "return"),
    "pp2-last-rank-no-targets-caught-alive": (2, (2, 1, 1), 1, "targets", "stay"),
    "pp2-first-rank-short-targets-alive": (2, (2, 1, 1), 0, "sizes", "stay"),
    "pp2-loss-fn-raises": (2, (2, 1, 1), 1, "loss", ""),
    "pp2xdp2-replica-no-targets": (4, (2, 2, 1), 3, "targets", ""),
    "pp2xdp2-replica-layer-raises-alive": (4, (2, 2, 1), 2, "forward", "stay"),
    "pp4xdp2-middle-rank-short-targets": (8, (4, 2, 1), 1, "sizes", ""),
    "pp2xdp2xtp2-tp-rank-no-targets-caught-alive": (8, (2, 2, 2), 3, "targets", "stay"),
}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS), ids=list(RUNS))
def test_an_error_on_one_rank_stops_every_other_rank_at_once(run: str) -> None:
    # With a time-out of 60 s, every other rank raises within seconds a PipelineError that
    # names the failed rank and its error, and every process ends: before, they waited
    # for the time-out. A culprit that stays alive (its connections open) proves the
    # board alone tells them.
    world, layout, culprit, how, catch = RUNS[run]
    results = _run_failing(world, layout, culprit, how, catch)
    text = results[culprit]
    first = {
        "targets": "ConfigError: this rank holds a stage that needs targets, but got targets=None",
        "sizes": "ConfigError: inputs hold 8 samples but targets hold 7",
        "loss": f"PipelineError: rank {culprit}: the forward (with the loss) of stage 1",
        "forward": f"PipelineError: rank {culprit}: the forward of stage 0 (modules 0-2)",
    }[how]
    assert text.startswith(first), text
    quick = 8 if catch == "stay" else 15  # the culprit stays 10 s
    for rank, got in enumerate(results):
        if rank == culprit:
            continue
        error, seconds = got
        assert error.startswith(f"PipelineError: rank {culprit} failed: {first}"), (rank, error)
        assert f"; rank {rank} stopped " in error, (rank, error)
        assert seconds < quick, (rank, seconds, error)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_rank_dying_mid_step_is_named_to_every_other_rank() -> None:
    # Rank 1 (pipeline rank 1 of replica 0) ends in its forward: its pipeline peer names
    # it, the other replica learns it from the board, none waits for the time-out.
    results = _run_failing(4, (2, 2, 1), 1, "die")
    for rank, got in enumerate(results):
        if rank == 1:
            continue
        error, seconds = got
        assert error.startswith("PipelineError: "), (rank, error)
        assert re.search(r"rank 1\b|among \[1, 3\]", error), (rank, error)
        assert "may have died" in error, (rank, error)
        assert seconds < 15, (rank, seconds, error)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_error_on_one_rank_reaches_stream_ordered_waits() -> None:
    # The CUDA path (waits without a time-out, a watchdog), run on gloo: the culprit stays
    # alive, so only the failure board can stop rank 0.
    env = {"CONVEYOR_STREAM_WAITS": "1"}
    results = _run_failing(2, (2, 1, 1), 1, "targets", "stay", env)
    error, seconds = results[0]
    assert error.startswith(
        "PipelineError: rank 1 failed: ConfigError: this rank holds a stage that needs targets"
    ), error
    assert "; rank 0 stopped " in error and seconds < 8, (seconds, error)


def _run_failing(
    world: int,
    layout: tuple[int, int, int],
    culprit: int,
    how: str,
    catch: str = "",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run :func:`_one_rank_fails` with a time-out of 60 s: every process must end within
    15 s of the last answer. Returns by rank: the culprit's error text (``died``), the
    others' ``(error, seconds their failing step took)``."""
    expect = [r for r in range(world) if r != culprit or how != "die"]
    results = distributed.run(
        _one_rank_fails, world, layout, culprit, how, catch,
        env={"CONVEYOR_TIMEOUT": "60", **(env or {})}, allow_errors=True, timeout=150,
        fork=True, exit_within=15, expect=expect,
    )  # fmt: skip
    if how == "die":
        results.insert(culprit, "died")
    out: list[Any] = []
    for rank, got in enumerate(results):
        if rank == culprit:  # its error propagated (a traceback) or was returned
            out.append(got["error"] if isinstance(got, dict) else got)
        else:
            assert isinstance(got, dict) and got["error"] is not None, (rank, got)
            out.append((got["error"], got["ended"] - got["began"]))
    return out


# --- the failure board in one process (two boards on one store play two ranks) -----------


@pytest.fixture
def fast_board(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Short slices, so that a board reads within a tenth of a second."""
    import conveyor._failure as failure

    monkeypatch.setattr(failure, "SLICE", 0.05)
    monkeypatch.setattr(failure, "TICK", 0.01)
    return failure


def _boards(failure: Any, n: int = 2) -> tuple[Any, list[Any]]:
    import torch.distributed as dist

    store = dist.PrefixStore("conveyor/failure/0/", dist.HashStore())  # type: ignore[attr-defined]
    return store, [failure.Board(store, r, list) for r in range(n)]


def _until(condition: Any, seconds: float = 3.0) -> bool:
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return bool(condition())


def test_a_posted_failure_stops_a_rank_blocked_in_its_step(fast_board: Any) -> None:
    failure = fast_board
    store, (zero, one) = _boards(failure)
    try:
        with zero:  # rank 0 is in its step, waiting
            assert one.post(conveyor.ConfigError("bad targets")) is None  # first: posted
            assert _until(lambda: zero.broken)
            error = zero.stopped(RuntimeError("closed"), "rank 0: B(0) waiting for rank 1")
        assert error is not None and failure.is_notice(error)
        assert str(error) == (
            "rank 1 failed: ConfigError: bad targets; rank 0 stopped (B(0) waiting for rank 1)"
        )
        token = store.get("notice").decode().split("\n")[1]
        assert store.add(f"read/{token}", 0) == 1  # read once, by rank 0
        assert not one.broken and one.unresolved and zero.unresolved
    finally:
        zero.close(leaving=False), one.close(leaving=False)


def test_a_rank_outside_a_step_or_in_a_short_one_reads_nothing(fast_board: Any) -> None:
    failure = fast_board
    _, (zero, one) = _boards(failure)
    try:
        one.post(ValueError("broke"))
        time.sleep(0.1)  # rank 0 is not in a step: nothing is read
        assert not zero.broken and zero.seen == ""
        with zero:  # a step shorter than the slice
            time.sleep(0.02)
        time.sleep(0.1)
        assert not zero.broken and zero.seen == ""
    finally:
        zero.close(leaving=False), one.close(leaving=False)


def test_an_error_every_rank_raises_alike_is_posted_once_and_the_job_goes_on(
    fast_board: Any,
) -> None:
    failure = fast_board
    _, (zero, one) = _boards(failure)
    try:
        assert zero.post(conveyor.ConfigError("bad batch")) is None
        other = one.post(conveyor.ConfigError("bad batch"))
        assert other is not None and str(other).startswith("rank 0 failed: ConfigError: bad")
        assert zero.seen == one.seen  # acknowledged by both
        with zero, one:  # a long step later: the old notice is not news
            time.sleep(0.15)
        assert not zero.broken and not one.broken
    finally:
        zero.close(leaving=False), one.close(leaving=False)


def test_a_notice_read_as_the_rank_leaves_its_step_does_not_break_it(
    fast_board: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Read a tick before acting: a rank about to raise the same error itself (it left the
    # step meanwhile) is not broken for it.
    failure = fast_board
    monkeypatch.setattr(failure, "TICK", 0.1)
    _, (zero, one) = _boards(failure)
    try:
        with zero:
            time.sleep(0.12)  # past the slice: the first tick reads
            one.post(ValueError("broke"))
            read = zero._last_read
            assert _until(lambda: zero._last_read != read)  # read, not yet acted on
        time.sleep(0.15)
        assert not zero.broken
    finally:
        zero.close(leaving=False), one.close(leaving=False)


def test_a_step_posts_its_own_error_and_replaces_a_consequence(
    fast_board: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    failure = fast_board
    store, (zero, one) = _boards(failure)
    try:
        monkeypatch.setattr(failure, "_board", one)
        with pytest.raises(conveyor.ConfigError, match="bad targets"), failure.Step():
            raise conveyor.ConfigError("bad targets")
        assert store.get("notice").decode().endswith("\nConfigError: bad targets")
        monkeypatch.setattr(failure, "_board", zero)
        # Rank 0's own wait failed because rank 1 left: it raises rank 1's error.
        with pytest.raises(conveyor.PipelineError) as caught, failure.Step():
            raise RuntimeError("Connection closed by peer")
        assert str(caught.value) == (
            "rank 1 failed: ConfigError: bad targets; rank 0 stopped its step"
        )
        assert isinstance(caught.value.__cause__, RuntimeError)
        with failure.Step():  # a step that finishes resolves the failure
            pass
        assert not zero.unresolved
    finally:
        zero.close(leaving=False), one.close(leaving=False)


class _Fails:
    """A work whose wait raises, as gloo's does when the peer's connection closes."""

    def wait(self, timeout: Any = None) -> bool:
        raise RuntimeError("Connection closed by peer")


def test_a_failed_wait_names_the_posted_failure(
    fast_board: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conveyor.runtime.transport import guarded, wait_bounded

    failure = fast_board
    _, (zero, one) = _boards(failure)
    try:
        monkeypatch.setattr(failure, "_board", zero)
        with pytest.raises(conveyor.PipelineError, match="rank 1 may have died or stalled"):
            wait_bounded(_Fails(), 5.0, "rank 0: F(1) waiting for rank 1", "rank 1")  # type: ignore[arg-type]
        one.post(ValueError("the loss broke"))
        with pytest.raises(conveyor.PipelineError) as caught:
            wait_bounded(_Fails(), 5.0, "rank 0: F(1) waiting for rank 1", "rank 1")  # type: ignore[arg-type]
        assert str(caught.value) == (
            "rank 1 failed: ValueError: the loss broke; rank 0 stopped (F(1) waiting for rank 1)"
        )
        with pytest.raises(conveyor.PipelineError, match=r"^rank 1 failed: ValueError"):
            guarded(_Fails().wait, "rank 0: agreeing", "rank 1")
    finally:
        zero.close(leaving=False), one.close(leaving=False)


def test_watchdog_stops_for_a_posted_failure(fast_board: Any) -> None:
    from conveyor.runtime.watchdog import Watchdog

    aborted: list[float] = []
    asked: list[str] = []

    def notices(doing: str) -> conveyor.PipelineError | None:
        asked.append(doing)
        return conveyor.PipelineError(f"rank 1 failed: X; rank 0 stopped ({doing})")

    dog = Watchdog(60, on_expire=lambda: aborted.append(time.monotonic()), poll=0.02,
                   notices=notices)  # fmt: skip
    start = time.monotonic()
    dog.watch(_Never(), "rank 0: B(0) waiting for rank 1", "rank 1")  # type: ignore[arg-type]
    assert _until(lambda: bool(aborted), 5.0)
    assert 0.05 <= aborted[0] - start < 1.0  # a slice after the work was posted
    assert asked == ["rank 0: B(0) waiting for rank 1"]
    with pytest.raises(conveyor.PipelineError, match=r"^rank 1 failed: X; rank 0 stopped"):
        dog.check()
