"""B (input gradients) then W (weight gradients) equals one ordinary backward."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from conveyor.runtime.split_backward import backward_input


class Shared(nn.Module):
    """One Linear used twice: its weight joins the input path at two places."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class MultiheadBlock(nn.Module):
    """``nn.MultiheadAttention`` after a position parameter and a norm: its input
    projection is a weight that is not a linear layer's, used three times."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(5, 8))
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x + self.pos)
        return self.att(h, h, h)[0]


class Embed(nn.Module):
    """Integer tokens in: no input gradient at all, so W does the whole backward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(x))


CASES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), (4, 8)),
    "layernorm": (lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU()), (4, 8)),
    "conv": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), (2, 3, 6, 6)),
    "shared": (Shared, (4, 8)),
    "attention": (MultiheadBlock, (2, 5, 8)),
    "embedding": (Embed, (3, 5)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_b_then_w_equals_one_backward(name: str) -> None:
    make, shape = CASES[name]
    torch.manual_seed(0)
    model = make()
    if name == "embedding":
        x = torch.randint(0, 10, shape)
    else:
        x = torch.randn(*shape, requires_grad=True)
    params = list(model.parameters())
    out = model(x)
    g = torch.randn_like(out)
    out.backward(g)
    want = [p.grad.clone() for p in params]
    want_x = x.grad.clone() if x.grad is not None else None
    model.zero_grad()
    x.grad = None

    out = model(x)
    got_x, work = backward_input([out], [g], [x], params)
    assert all(p.grad is None for p in params)  # B leaves the weights alone
    if want_x is None:
        assert got_x == [None]
    else:
        assert got_x[0] is not None and torch.allclose(got_x[0], want_x, rtol=1e-6, atol=1e-7)
    work.run()
    for p, w in zip(params, want, strict=True):
        assert p.grad is not None and torch.allclose(p.grad, w, rtol=1e-6, atol=1e-7)


def test_saved_tensors_are_freed_once_w_is_done() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    saved: list[weakref.ref[torch.Tensor]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            clone = t.clone()  # a tensor owned by the graph alone, to watch
            saved.append(weakref.ref(clone))
            return clone
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    _, work = backward_input([out], [torch.ones_like(out)], [x], list(model.parameters()))
    del out
    gc.collect()
    assert saved and any(r() is not None for r in saved)  # W still needs them
    work.run()
    gc.collect()
    assert all(r() is None for r in saved)
