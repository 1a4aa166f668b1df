"""Small models and the unsplit reference used by the equivalence tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import conveyor


def mlp(layers: int = 6, width: int = 16, seed: int = 0) -> nn.Sequential:
    """``layers`` x (Linear, Tanh) then a Linear head to 4 outputs: 2*layers+1 modules."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods += [nn.Linear(8 if i == 0 else width, width), nn.Tanh()]
    mods.append(nn.Linear(width, 4))
    return nn.Sequential(*mods)


def batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def reference(
    model: nn.Module, steps: list[tuple[torch.Tensor, torch.Tensor]], lr: float = 0.1
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Losses per step, final grads and final parameters of the unsplit model under SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for i, (x, y) in enumerate(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        if i < len(steps) - 1:
            opt.step()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, grads, params


def pipelined(
    pipe: conveyor.Pipeline, steps: list[tuple[torch.Tensor, torch.Tensor]], lr: float = 0.1
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The same as :func:`reference`, through a pipeline (this rank's part)."""
    opt = torch.optim.SGD(pipe.parameters(), lr=lr)
    losses = []
    for i, (x, y) in enumerate(steps):
        opt.zero_grad()
        losses.append(pipe.train_step(x, y).item())
        if i < len(steps) - 1:
            opt.step()
    grads = {n: p.grad.detach().clone() for n, p in pipe.named_parameters() if p.grad is not None}
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    return losses, grads, params


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, tol: float = 1e-5
) -> None:
    assert set(got) == set(want), f"{what}: names {sorted(got)} != {sorted(want)}"
    for name in want:
        err = rel_err(got[name], want[name])
        assert err < tol, f"{what}: {name} relative error {err:.2e}"


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        overlap = set(out) & set(part)
        assert not overlap, f"parameters on two ranks: {overlap}"
        out.update(part)
    return out
