"""Bad input gets one clear sentence that says what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import conveyor
from conveyor.errors import one_line
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
    msgs = distributed.run(_init_wrong_world, 2)
    for msg in msgs:
        assert "world size 2 is not pp x dp x tp = 3 x 1 x 1" in msg


def test_inputs_and_targets_of_different_batch_sizes() -> None:
    pipe = conveyor.Pipeline(mlp(), loss_fn=nn.functional.mse_loss, microbatches=2,
                             context=conveyor.init(pp=2))
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
