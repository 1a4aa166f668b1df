"""The rest of the Pipeline contract: eval, predict, state dicts, names, inputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.schedules import from_table, to_table
from tests.support import distributed
from tests.support.helpers import mse
from tests.support.models import batch, mlp, readme_model


def _api(rank: int, pp: int) -> dict[str, Any]:
    ctx = conveyor.init(pp=pp)
    pipe = conveyor.Pipeline(mlp(), loss_fn=mse, microbatches=3, context=ctx)
    x, y = batch(10)
    return {
        "eval": pipe.eval_step(x, y).item(),
        "predict": pipe.predict(x),
        "names": [n for n, _ in pipe.named_parameters()],
        "state": pipe.state_dict(),
        "grads": [p.grad for p in pipe.parameters()],
        "stages": len(pipe.stages),
        "ctx": (ctx.rank, ctx.world_size, ctx.pp_rank, ctx.pp_size, ctx.dp_rank, ctx.dp_size),
    }


@pytest.mark.parametrize(
    "world", [1, pytest.param(2, marks=[pytest.mark.multiprocess, pytest.mark.slow])]
)
def test_eval_predict_and_state_dict(world: int) -> None:
    results = [_api(0, 2)] if world == 1 else distributed.run(_api, 2, 2, fork=True)
    model = mlp()
    x, y = batch(10)
    with torch.no_grad():
        want_out = model(x)
    want_loss = mse(want_out, y).item()
    names: list[str] = []
    for rank, r in enumerate(results):
        assert r["eval"] == pytest.approx(want_loss, rel=1e-6)
        assert all(g is None for g in r["grads"])  # eval and predict leave no gradients
        names += r["names"]
        for k, v in r["state"].items():
            assert torch.equal(v, model.state_dict()[k])
        if world == 2:
            assert r["ctx"] == (rank, 2, rank, 2, 0, 1)
    last = results[-1]["predict"]
    assert torch.allclose(last, want_out, rtol=1e-6, atol=1e-7)
    if world == 2:
        assert results[0]["predict"] is None
        assert [r["stages"] for r in results] == [1, 1]
    else:
        assert results[0]["ctx"] == (0, 1, 0, 2, 0, 1)
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())


def test_load_state_dict_takes_this_ranks_part() -> None:
    pipe = conveyor.Pipeline(mlp(seed=0), loss_fn=mse, microbatches=2, context=conveyor.init(pp=2))
    other = mlp(seed=5)
    pipe.load_state_dict(other.state_dict())
    for name, p in pipe.named_parameters():
        assert torch.equal(p, other.state_dict()[name])
    with pytest.raises(conveyor.ConfigError, match="state dict lacks"):
        pipe.load_state_dict({"0.weight": other[0].weight})


class TwoInputs(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + 2 * b


def test_tuple_and_dict_inputs_are_unpacked_like_a_model_call() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(TwoInputs(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    a, b = torch.randn(6, 8), torch.randn(6, 8)
    y = torch.randn(6, 4)
    want = mse(model[1:](model[0](a, b)), y)
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    pipe = conveyor.Pipeline(
        model, loss_fn=mse, microbatches=3, balance=[2, 2], context=conveyor.init(pp=2)
    )
    assert pipe.train_step((a, b), y).item() == pytest.approx(want.item(), rel=1e-6)
    for n, p in pipe.named_parameters():
        assert torch.allclose(p.grad, want_grads[n], rtol=1e-5, atol=1e-7)
    got = pipe.eval_step({"a": a, "b": b}, y)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


def test_a_schedule_read_back_from_its_table_drives_the_pipeline() -> None:
    ctx = conveyor.init(pp=2)
    base = conveyor.Pipeline(mlp(), loss_fn=mse, microbatches=2, schedule="gpipe", context=ctx)
    text = to_table(base.schedule)
    sched = from_table(text)
    pipe = conveyor.Pipeline(mlp(), loss_fn=mse, microbatches=2, schedule=sched, context=ctx)
    x, y = batch(4)
    assert pipe.train_step(x, y).item() == pytest.approx(base.train_step(x, y).item())
    with pytest.raises(conveyor.ConfigError, match="is for 2 ranks and 2 micro-batches"):
        conveyor.Pipeline(mlp(), loss_fn=mse, microbatches=4, schedule=sched, context=ctx)


def _auto(rank: int) -> tuple[str, float, dict[str, torch.Tensor]]:
    ctx = conveyor.init()
    x, y = batch(12)
    pipe = conveyor.Pipeline(
        mlp(), loss_fn=mse, microbatches=3, schedule="auto", sample=(x, y), context=ctx
    )
    assert pipe.plan is not None and pipe.schedule.name == pipe.plan.schedule
    loss = pipe.train_step(x, y).item()
    return pipe.schedule.name, loss, {n: p.grad for n, p in pipe.named_parameters()}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_auto_schedule_plans_and_stays_exact() -> None:
    results = distributed.run(_auto, 2, fork=True)
    model = mlp()
    x, y = batch(12)
    want = mse(model(x), y)
    want.backward()
    assert results[0][0] == results[1][0]  # every rank runs the same plan
    grads: dict[str, torch.Tensor] = {}
    for _, loss, part in results:
        assert loss == pytest.approx(want.item(), rel=1e-5)
        grads.update(part)
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-5, atol=1e-7), name


def test_auto_schedule_needs_a_sample() -> None:
    with pytest.raises(conveyor.ConfigError, match=r"pass sample=\(inputs, targets\)"):
        conveyor.Pipeline(
            mlp(), loss_fn=mse, microbatches=2, schedule="auto", context=conveyor.init(pp=2)
        )


def test_chunks_default_to_the_schedules_own_count() -> None:
    """chunks=None (the default) takes the schedule's count; an explicit 1 on an
    interleaved schedule is still refused (it would silently be plain 1F1B)."""
    ctx = conveyor.init(pp=2)
    for name, chunks in (("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2), ("v-min", 2)):
        pipe = conveyor.Pipeline(mlp(), loss_fn=mse, microbatches=4, schedule=name, context=ctx)
        assert pipe.schedule.chunks == chunks and len(pipe.stages) == 2 * chunks, name
    with pytest.raises(conveyor.ConfigError, match="interleaves several chunks per rank"):
        conveyor.Pipeline(mlp(), loss_fn=mse, microbatches=4, schedule="interleaved-1f1b",
                          chunks=1, context=ctx)  # fmt: skip


def test_one_process_runs_as_many_ranks_as_balance_or_annotations_say() -> None:
    ctx = conveyor.init()  # no torchrun, no pp: a world of one process
    model = readme_model()
    pipe = conveyor.Pipeline(
        model, loss_fn=nn.functional.cross_entropy, microbatches=4, balance=[3, 3], context=ctx
    )
    assert pipe.schedule.ranks == 2 and len(pipe.stages) == 2
    x, y = torch.randn(8, 8, 8), torch.randint(0, 10, (8,))
    loss = pipe.train_step(x, y)
    want = nn.functional.cross_entropy(readme_model()(x), y)
    assert float(loss) == pytest.approx(want.item(), rel=1e-6)
    annotated = readme_model()
    annotated[3].pipeline_stage = 1  # type: ignore[assignment]
    annotated[5].pipeline_stage = 2  # type: ignore[assignment]
    pipe = conveyor.Pipeline(
        annotated, loss_fn=nn.functional.cross_entropy, microbatches=3, context=ctx
    )
    assert pipe.schedule.ranks == 3
    # init(pp=...) is a promise: a balance that does not fit it is still an error
    with pytest.raises(conveyor.ConfigError, match=r"has 2 entries but the pipeline has 4"):
        conveyor.Pipeline(
            readme_model(),
            loss_fn=nn.functional.cross_entropy,
            microbatches=4,
            balance=[3, 3],
            context=conveyor.init(pp=4),
        )


def test_every_rank_gets_parameters() -> None:
    # 10 layers, 5 with parameters, on 4 ranks x 2 chunks: 8 stages, so some stage has
    # none, but every rank must hold one that has (here rank 0 used to get only Flatten
    # and a ReLU).
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Flatten()]
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    layers.append(nn.Linear(16, 4))
    model = nn.Sequential(*layers)
    ctx = conveyor.init(pp=4)
    pipe = conveyor.Pipeline(
        model,
        loss_fn=nn.functional.mse_loss,
        microbatches=4,
        schedule="interleaved-1f1b",
        chunks=2,
        context=ctx,
    )
    sched = pipe.schedule
    for rank in range(4):
        held = sched.stages_of(rank)
        assert any(p.numel() for s in held for p in pipe.stages[s].parameters()), rank
    # too few layers with parameters for the ranks: said at construction
    few = nn.Sequential(
        nn.Flatten(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Tanh(),
        nn.ReLU(),
        nn.Linear(16, 4),
        nn.Tanh(),
        nn.ReLU(),
    )
    with pytest.raises(
        conveyor.ConfigError,
        match=r"leaves pipeline rank \d .* without "
        r"parameters.*fewer ranks",
    ):
        conveyor.Pipeline(few, loss_fn=nn.functional.mse_loss, microbatches=4, context=ctx)
