"""Stages run copies of the user's modules (conveyor/partition/owned.py): the same
parameters and buffers, their own tables, the model's modes. The user's modules under
FSDP, tensor and expert parallelism stay as they were: tests/parallel/test_held_parameters.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.partition.owned import own_modules
from conveyor.partition.sequential import SequentialStage
from tests.support.helpers import mse


class _Scaled(nn.Module):
    """A module whose instance holds a method bound to itself (as a patched forward is)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("scale", torch.tensor(2.0))
        self.run = self.double

    def double(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)  # type: ignore[no-any-return]


def test_a_stage_holds_copies_sharing_the_tensors() -> None:
    layers = [_Scaled(), nn.Dropout(0.5), _Scaled()]
    seen: list[Any] = []
    layers[0].register_forward_hook(lambda m, i, o: seen.append(m))
    stage = SequentialStage(*layers)
    modes = own_modules([stage], nn.ModuleList(layers))
    copies = list(stage.children())
    assert all(c is not m and type(c) is type(m) for c, m in zip(copies, layers, strict=True))
    assert [p for p in stage.parameters()] == [p for m in layers for p in m.parameters()]
    assert copies[0].scale is layers[0].scale  # buffers too
    assert copies[0].lin is not layers[0].lin  # submodules copied as well
    assert copies[0].run.__self__ is copies[0]  # a method bound to the module: to the copy
    stage(torch.randn(3, 2))
    assert seen == [copies[0]]  # the user's hook, on the copy
    copies[2].register_forward_hook(lambda m, i, o: seen.append("copy"))
    layers[2](torch.randn(3, 2))
    assert seen == [copies[0]]  # a hook on the copy is not on the user's module
    copies[0].lin.weight = nn.Parameter(torch.zeros(2, 2))  # as a sharding replaces it
    assert layers[0].lin.weight is not copies[0].lin.weight
    assert len(modes.pairs) == 5  # the layers and the two Linear layers inside
    layers[1].eval()
    assert copies[1].training
    modes.follow()
    assert not copies[1].training and copies[0].training


def test_the_stages_follow_model_train_and_eval() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 4))
    pipe = conveyor.Pipeline(model, loss_fn=mse, microbatches=2, context=conveyor.init(pp=2))
    assert all(p is q for p, q in zip(pipe.parameters(), model.parameters(), strict=True))
    assert pipe.stages[0][0] is not model[0]
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    model.eval()  # the model's own switch, not pipe.eval()
    want = float(mse(model(x), y).detach())
    assert float(pipe.eval_step(x, y)) == pytest.approx(want, rel=1e-6)
    assert float(pipe.train_step(x, y)) == pytest.approx(want, rel=1e-6)  # no dropout there
    model.train()
    losses = {float(pipe.eval_step(x, y)) for _ in range(3)}
    assert len(losses) == 3  # dropout acts again


def test_adopt_points_the_model_at_the_stages_tensors_and_marks_what_is_held() -> None:
    from conveyor.partition.resplit import HELD, adopt, make_whole

    model = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(3, 3), nn.Linear(3, 3))
    model[2].weight = model[1].weight  # tied
    assert make_whole(model) is None  # no pipeline marked it yet
    weight = nn.Parameter(model[1].weight.detach().clone())  # as a sharding made it
    mean = torch.ones(3)
    adopt(model, [("1.weight", weight), ("1.bias", model[1].bias)], [("0.running_mean", mean)])
    assert model[1].weight is weight and model[2].weight is weight  # every slot of a tie
    assert model[0].running_mean is mean
    assert getattr(model, HELD) == {"1.weight", "1.bias", "2.weight"}  # each name of a tie
    before = make_whole(model)
    assert before is not None and before.names == {"1.weight", "1.bias"} and not before.whole
    assert set(before.prints) == {"0.weight", "0.bias", "1.weight", "1.bias", "2.bias"}
