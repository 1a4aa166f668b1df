"""Bad input gets one clear sentence that says what to do: options, shapes and sizes at
construction; an error inside a stage's work names the stage, its modules, the micro-batch
and the work; a list batch; a bad time-out; the same on two real processes."""

from __future__ import annotations

import math
import os
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import conveyor
from conveyor.errors import one_line
from conveyor.runtime.deferred_grads import LinearGrad
from tests.support import distributed
from tests.support.models import batch, mlp


def _pipe(**kw: object) -> conveyor.Pipeline:
    args: dict[str, object] = dict(loss_fn=nn.functional.mse_loss, microbatches=4)
    args.update(kw)
    ctx = conveyor.init(pp=int(args.pop("pp", 2)))  # type: ignore[call-overload]
    return conveyor.Pipeline(args.pop("model", mlp()), context=ctx, **args)  # type: ignore[arg-type]


def test_balance_not_adding_up() -> None:
    with pytest.raises(conveyor.ConfigError, match=r"adds up to 12 layers but the model has 13"):
        _pipe(balance=[6, 6])


def test_balance_wrong_length() -> None:
    with pytest.raises(conveyor.ConfigError, match=r"has 3 entries but the pipeline has 2 stages"):
        _pipe(balance=[6, 6, 1])


def test_fewer_layers_than_stages() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    with pytest.raises(conveyor.ConfigError, match=r"has 2 layers but the pipeline needs 4 stages"):
        _pipe(model=model, pp=4)


def test_batch_smaller_than_microbatches() -> None:
    pipe = _pipe()
    x, y = batch(3)
    with pytest.raises(conveyor.ConfigError, match=r"batch of 3 cannot be divided into 4"):
        pipe.train_step(x, y)


def test_unknown_schedule_name() -> None:
    with pytest.raises(conveyor.ConfigError, match=r"unknown schedule 'ifib'.*1f1b"):
        _pipe(schedule="ifib")


def test_model_fx_cannot_trace_points_at_the_layer_list_way() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
                x = -x
            return self.b(self.a(x))

    # The model is captured on the first batch: fx stops at the branch, and so does export.
    pipe = _pipe(model=Net())
    x, y = batch(8)
    with pytest.raises(
        conveyor.ConfigError,
        match=r"cannot capture Net .* at the model \(.*test_errors\.py:\d+\).* nn\.Sequential",
    ):
        pipe.train_step(x, y)


def test_loss_fn_must_return_a_scalar() -> None:
    pipe = _pipe(loss_fn=lambda out, y: (out - y) ** 2)
    x, y = batch(8)
    with pytest.raises(conveyor.PipelineError, match=r"loss_fn must return a scalar tensor"):
        pipe.train_step(x, y)


def test_bad_microbatches_and_chunks() -> None:
    with pytest.raises(conveyor.ConfigError, match=r"microbatches must be an int >= 1"):
        _pipe(microbatches=0)
    with pytest.raises(conveyor.ConfigError, match=r"chunks must be an int >= 1"):
        _pipe(chunks=0)


def _init_wrong_world(rank: int) -> str:
    try:
        conveyor.init(pp=3)
    except conveyor.ConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_world_size_not_matching_stages() -> None:
    msgs = distributed.run(_init_wrong_world, 2, fork=True)
    for msg in msgs:
        assert "world size 2 is not pp x dp x tp = 3 x 1 x 1" in msg


def test_inputs_and_targets_of_different_batch_sizes() -> None:
    pipe = conveyor.Pipeline(
        mlp(), loss_fn=nn.functional.mse_loss, microbatches=2, context=conveyor.init(pp=2)
    )
    x, _ = batch(8)
    _, y = batch(6)
    with pytest.raises(conveyor.ConfigError, match=r"inputs hold 8 samples but targets hold 6"):
        pipe.train_step(x, y)


def test_short_errors_are_cut_between_words() -> None:
    long = RuntimeError("Timed out waiting 3000ms for send operation to complete " * 10)
    text = one_line(long, 80).removeprefix("RuntimeError: ")
    assert len(text) <= 84 and text.endswith(" ...")
    assert text[:-4] == text[:-4].rstrip() and (long.args[0]).startswith(text[:-4])
    assert long.args[0][len(text) - 4] == " "  # the cut falls before a space


# --- helpers of the stage-work, list-batch and time-out errors below ----------------------


def _digits_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _digits(n: int, side: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, side, side, generator=g), torch.randint(0, 10, (n,), generator=g)


class _FailOnCall(nn.Module):
    """Identity, except that its ``at``-th call raises ValueError."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise ValueError(f"call {self.calls} fails")
        return x


class _NoGradient(torch.autograd.Function):
    """Identity whose backward raises (on a weight: only W runs it, B does not)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("no gradient for this weight")


class _WeightWithoutGradient(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ _NoGradient.apply(self.weight)


class _SizeBranch(nn.Module):
    """A branch on a size: fx cannot trace it, so it is captured on the first batch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.shape[0] > 1:
            h = h + extra
        return self.b(h)


def _one_process(model: nn.Module, **kw: Any) -> conveyor.Pipeline:
    kw.setdefault("loss_fn", nn.functional.mse_loss)
    kw.setdefault("microbatches", 2)
    return conveyor.Pipeline(model, context=conveyor.init(pp=2), **kw)


def _raised(pipe: conveyor.Pipeline, x: Any, y: Any) -> conveyor.PipelineError:
    with pytest.raises(conveyor.PipelineError) as info:
        pipe.train_step(x, y)
    assert "\n" not in str(info.value)
    return info.value


# --- an error inside a stage's work names the stage, its modules, micro-batch, work ----


def test_a_wrong_input_on_a_later_step_names_stage_modules_and_microbatch() -> None:
    pipe = _one_process(_digits_model(), loss_fn=nn.functional.cross_entropy, balance=[2, 2])
    pipe.train_step(*_digits(8))
    error = _raised(pipe, *_digits(8, side=7))
    assert str(error) == (
        "the forward of stage 0 (modules 0-1) on micro-batch 0 raised RuntimeError: mat1 and "
        "mat2 shapes cannot be multiplied (4x49 and 64x32); its traceback, above this one, "
        "shows the failing line"
    )
    assert "stage 0 on rank 0: 0-1;" in str(pipe)  # the modules as print(pipe) names them
    assert isinstance(error.__cause__, RuntimeError)  # chained, with its own traceback


def test_a_failing_loss_fn_is_named_with_the_last_stage() -> None:
    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise KeyError("labels")

    error = _raised(_one_process(mlp(), loss_fn=loss_fn), *batch(4))
    assert re.match(
        r"the forward \(with the loss\) of stage 1 \(modules \d+-12\) on "
        r"micro-batch 0 raised KeyError: 'labels';",
        str(error),
    ), str(error)


def test_conveyors_own_errors_are_not_wrapped_again() -> None:
    pipe = _one_process(mlp(), loss_fn=lambda out, y: (out - y) ** 2)
    assert str(_raised(pipe, *batch(4))).startswith("loss_fn must return a scalar tensor")


@pytest.mark.parametrize(
    ("schedule", "work"),
    [
        ("1f1b", "backward"),
        ("zb-h1", "input-gradient backward \\(B\\)"),  # B computes every other gradient
        ("zb-h1", "weight-gradient backward \\(W\\)"),  # a deferred GEMM of W fails
    ],
)
def test_a_failing_backward_or_weight_gradient_is_named(
    schedule: str, work: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    last: nn.Module = _WeightWithoutGradient()
    if work.startswith("weight"):
        last = nn.Linear(16, 4)

        def fails(entry: object) -> None:
            raise ValueError("no gradient for this weight")

        monkeypatch.setattr(LinearGrad, "add", fails)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), last)
    pipe = _one_process(model, schedule=schedule, balance=[2, 1])
    error = _raised(pipe, torch.randn(4, 8), torch.randn(4, 4))
    pattern = rf"the {work} of stage 1 \(modules 2\) on micro-batch(es)? [\d, ]+ raised ValueError"
    assert re.match(pattern, str(error)), str(error)
    assert isinstance(error.__cause__, ValueError)


def test_a_failing_recompute_is_named_as_one() -> None:
    # gpipe runs both forwards of stage 0 first; the third call is a recompute at B.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _FailOnCall(3), nn.Tanh(), nn.Linear(8, 4))
    pipe = _one_process(model, schedule="gpipe", balance=[2, 2], recompute=[0])
    error = _raised(pipe, *batch(4))
    assert re.match(
        r"the recomputed forward \(at its backward\) of stage 0 \(modules 0-1\) on "
        r"micro-batch \d raised ValueError: call 3 fails;",
        str(error),
    ), str(error)


# --- a list batch -----------------------------------------------------------------------


def test_a_list_batch_says_tensor_tuple_or_dict() -> None:
    pipe = _one_process(_digits_model(), loss_fn=nn.functional.cross_entropy, balance=[2, 2])
    x, y = _digits(8)
    for args, what in (([[x], y]), "inputs"), (([x, [y]]), "targets"):
        with pytest.raises(
            conveyor.ConfigError,
            match=rf"^{what} is a list; pass a tensor, a "
            rf"tuple or a dict of tensors .* e\.g\. tuple\({what}\)$",
        ):
            pipe.train_step(*args)
    with pytest.raises(conveyor.ConfigError, match=r"^inputs is a list"):
        pipe.predict([x])
    assert pipe.predict((x,)).shape == (8, 10)  # the tuple it asks for works


# --- a bad time-out ---------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [-5, 0, math.nan, math.inf, "30", True])
def test_a_bad_timeout_is_refused(timeout: Any) -> None:
    with pytest.raises(
        conveyor.ConfigError,
        match=r"^timeout must be a finite number of "
        r"seconds > 0, got timeout=.*; pass e\.g\. conveyor\.init\(timeout=300\)$",
    ):
        conveyor.init(timeout=timeout)


@pytest.mark.parametrize("text", ["-1", "0", "abc", "nan", ""])
def test_a_bad_conveyor_timeout_is_refused(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_TIMEOUT", text)
    with pytest.raises(conveyor.ConfigError, match=r"^\$CONVEYOR_TIMEOUT must be a finite"):
        conveyor.init()
    monkeypatch.setenv("CONVEYOR_TIMEOUT", "2.5")
    assert conveyor.init().timeout == 2.5


# --- the same under a launch: two real processes ------------------------------------------


def _launched(rank: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, timeout, env in (("argument", -5.0, None), ("variable", None, "abc")):
        if env is not None:
            os.environ["CONVEYOR_TIMEOUT"] = env
        try:
            conveyor.init(timeout=timeout)
        except conveyor.ConfigError as e:
            out[key] = f"{e} (group made: {dist.is_initialized()})"
        os.environ.pop("CONVEYOR_TIMEOUT", None)
    ctx = conveyor.init(timeout=3)
    try:
        conveyor.Pipeline(
            mlp(), loss_fn=nn.functional.mse_loss, microbatches=2, balance=[4, 4, 5], context=ctx
        )
    except conveyor.ConfigError as e:
        out["balance"] = str(e)
    # A batch only the rank holding stage 0 passes (the others pass None) is bad: the
    # model is captured on it, so every rank gets its error, none waits for the batch.
    pipe = conveyor.Pipeline(_SizeBranch(), loss_fn=None, microbatches=2, context=ctx)
    bad = {"x": torch.randn(4, 8), "extra": torch.randn(3, 8)} if rank == 0 else None
    try:
        pipe.predict(bad)
    except conveyor.ConveyorError as e:
        out["sample"] = f"{type(e).__name__}: {e}"
    pipe = conveyor.Pipeline(
        _digits_model(),
        loss_fn=nn.functional.cross_entropy,
        microbatches=2,
        balance=[2, 2],
        context=ctx,
    )
    pipe.train_step(*_digits(4))
    try:
        pipe.train_step(*_digits(4, side=7))
    except conveyor.PipelineError as e:
        out["step"] = str(e)
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_launch_edges_on_two_processes() -> None:
    results = distributed.run(_launched, 2, timeout=120, fork=True)
    for rank, got in enumerate(results):
        assert got["argument"] == (
            "timeout must be a finite number of seconds > 0, got timeout=-5.0; pass e.g. "
            "conveyor.init(timeout=300) (group made: False)"
        ), got
        assert got["variable"].startswith("$CONVEYOR_TIMEOUT must be a finite number"), got
        assert got["variable"].endswith("(group made: False)"), got
        assert got["balance"] == (
            "balance [4, 4, 5] describes 3 stages, but this run has 2 pipeline ranks x 1 "
            "chunk(s) = 2 stages; launch 3 processes for 3 pipeline ranks (conveyor launch "
            "--nproc-per-node 3 script.py), or give balance 2 entries"
        ), rank
    assert (
        results[0]["sample"]
        == results[1]["sample"]
        == (
            "ConfigError: inputs tensors must share their first (batch) dimension, got sizes [3, 4]"
        )
    ), results
    # The failing rank names its work; the other one stops at once, naming it and its error.
    assert results[0]["step"].startswith(
        "rank 0: the forward of stage 0 (modules 0-1) on micro-batch 0 raised RuntimeError: "
        "mat1 and mat2 shapes cannot be multiplied (2x49 and 64x32);"
    ), results[0]
    assert results[1]["step"].startswith(
        "rank 0 failed: PipelineError: rank 0: the forward of stage 0 (modules 0-1) on "
        "micro-batch 0 raised RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    ), results[1]
