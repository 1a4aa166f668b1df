"""Optimizers built before a split step what replaced their parameters
(conveyor/partition/replaced.py), in one process: the registry and the optimizer step hook
on their own, and a model built on the meta device and captured by torch.export whose parameters
keep their objects when they get their values. The layouts that replace parameters
(FSDP, TP, EP, vocabulary rows) run in tests/parallel/test_held_parameters.py."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import conveyor
from conveyor.partition import replaced


def _replace(model: nn.Module, name: str) -> nn.Parameter:
    """Put a new parameter object (the same value) under ``name``, as a sharding would."""
    prefix, _, field = name.rpartition(".")
    owner = model.get_submodule(prefix)
    new = nn.Parameter(getattr(owner, field).detach().clone())
    setattr(owner, field, new)
    return new


def _step(opt: torch.optim.Optimizer, model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad()


def test_an_optimizer_built_before_steps_the_replacement() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    old = model[0].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = replaced.snapshot(model)
    new = _replace(model, "0.weight")
    assert replaced.record(before, model) == 1  # the other three kept their objects
    start = old.detach().clone()
    _step(opt, model, torch.randn(4, 3))
    held = [p for g in opt.param_groups for p in g["params"]]
    assert any(p is new for p in held) and not any(p is old for p in held)
    assert not torch.equal(new.detach(), start)  # trained
    assert torch.equal(old.detach(), start)  # the old object: left alone
    assert replaced.record(replaced.snapshot(model), model) == 0  # nothing new


def test_an_optimizer_with_state_for_a_replaced_parameter_is_refused() -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(opt, model, torch.randn(4, 3))  # state for the old objects
    before = replaced.snapshot(model)
    new = _replace(model, "weight")
    replaced.record(before, model)
    model(torch.randn(4, 3)).sum().backward()
    value = new.detach().clone()
    with pytest.raises(conveyor.ConfigError) as error:
        opt.step()
    assert str(error.value).count("; ") == 1
    assert "has state for 1 parameters" in str(error.value)
    assert "model.weight" in str(error.value) and "pipe.parameters()" in str(error.value)
    assert torch.equal(new.detach(), value)  # nothing stepped


def test_a_parameter_held_with_its_replacement_is_stepped_once() -> None:
    model = nn.Linear(3, 1, bias=False)
    old = model.weight
    before = replaced.snapshot(model)
    new = _replace(model, "weight")
    replaced.record(before, model)
    opt = torch.optim.SGD([{"params": [old]}, {"params": [new]}], lr=1.0)
    new.grad = torch.ones_like(new)
    value = new.detach().clone()
    opt.step()
    assert torch.equal(new.detach(), value - 1)  # once, not twice
    assert [len(g["params"]) for g in opt.param_groups] == [0, 1]


def test_a_replacement_replaced_again_is_followed() -> None:
    model = nn.Linear(3, 1, bias=False)
    old = model.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built first, never stepped
    before = replaced.snapshot(model)
    _replace(model, "weight")  # an earlier split's
    replaced.record(before, model)
    before = replaced.snapshot(model)
    newest = _replace(model, "weight")  # a new split of the trained model
    replaced.record(before, model)
    del before
    gc.collect()  # the middle object lives on in the mark of the first
    _step(opt, model, torch.randn(4, 3))
    assert opt.param_groups[0]["params"] == [newest]
    assert getattr(old, replaced.REPLACED_BY)[0] == "weight"


def test_a_meta_model_captured_by_export_keeps_its_parameter_objects() -> None:
    """The issue's case in one process: built under empty_weights, captured on the first
    batch (fx cannot trace it); an optimizer over pipe.parameters() built before the
    first step holds the very parameters the stages train."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            if x.size(0) > 1000:  # fx cannot trace a branch on a size
                h = h * 2
            return self.b(h)  # type: ignore[no-any-return]

    with conveyor.empty_weights():
        model = Branchy()
    pipe = conveyor.Pipeline(model, loss_fn=nn.functional.mse_loss, microbatches=2,
                             context=conveyor.init(pp=2), weights=None)  # fmt: skip
    held = list(pipe.parameters())
    opt = torch.optim.SGD(held, lr=0.1)
    pipe.train_step(torch.randn(4, 4), torch.randn(4, 4))
    assert pipe.describe().method == "export"
    trained = list(pipe.parameters())
    assert len(trained) == 4 and all(p is q for p, q in zip(held, trained, strict=True))
    value = [p.detach().clone() for p in trained]
    opt.step()
    assert all(not torch.equal(p.detach(), v) for p, v in zip(trained, value, strict=True))


def test_a_meta_parameter_that_cannot_change_in_place_is_followed() -> None:
    """A weak reference to a meta parameter (held by another library) stops
    ``swap_tensors``: the parameter becomes a new object, and an optimizer built over the
    old one before the split steps the new one."""
    with conveyor.empty_weights():
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    old = model[0].weight
    watcher = weakref.ref(old)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pipe = conveyor.Pipeline(model, loss_fn=nn.functional.mse_loss, microbatches=2,
                             context=conveyor.init(pp=2), weights=None)  # fmt: skip
    assert model[0].weight is not old and watcher() is old  # replaced, not changed in place
    pipe.train_step(torch.randn(4, 4), torch.randn(4, 4))
    value = [p.detach().clone() for p in pipe.parameters()]
    opt.step()
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) in held for p in pipe.parameters())
    trained = zip(pipe.parameters(), value, strict=True)
    assert all(not torch.equal(p.detach(), v) for p, v in trained)
