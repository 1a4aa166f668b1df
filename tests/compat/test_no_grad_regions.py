"""A model with a ``torch.no_grad()`` region built on the meta device and split from its
torch.export capture: transformers 5.0-5.23's Llama rotary embedding has that shape, and
export records the region as a higher-order operation whose body is a graph of its own."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

import conveyor
from tests.support.helpers import grads_of, rel_err


class Scale(nn.Module):
    """Cosines of a buffer moved to the hidden state's device, under ``torch.no_grad()``:
    the rotary embedding's shape (``inv_freq.to(x.device)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.1, 0.8, 8))

    @torch.no_grad()
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cos(self.freq.to(h.device) * h.shape[1]).to(h.dtype)


class NoGradScale(nn.Module):
    """Token embeddings, three scaled blocks and a head; its forward branches on the
    input's rank, which fx cannot trace: captured with export."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.scale = Scale()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids if ids.dim() == 2 else ids[None])
        scale = self.scale(h)
        for block in self.blocks:
            h = torch.tanh(block(h)) * scale
        return self.head(h.mean(1))


@pytest.mark.parametrize("source", ["init_seed", "weights"])
def test_a_meta_model_with_a_no_grad_region_trains_exactly(source: str, tmp_path: Path) -> None:
    with conveyor.empty_weights():
        model = NoGradScale()
    ref = conveyor.materialize(copy.deepcopy(model), init_seed=3)
    loading: dict[str, Any] = {"init_seed": 3}
    if source == "weights":
        with torch.no_grad():  # values no initialization would draw
            for p in ref.parameters():
                p.add_(0.05 * torch.randn_like(p))
        save_file({n: p.detach().contiguous() for n, p in ref.state_dict().items()},
                  str(tmp_path / "model.safetensors"))  # fmt: skip
        loading = {"weights": tmp_path}
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 11, (6, 5), generator=g), torch.randn(6, 3, generator=g)
    conveyor.init(pp=2)
    pipe = conveyor.Pipeline(model, loss_fn=F.mse_loss, microbatches=3, **loading)
    loss = pipe.train_step(x, y)
    assert pipe.describe().method == "export"
    want = F.mse_loss(ref(x), y)
    want.backward()
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    got, expected = grads_of(pipe.named_parameters()), grads_of(ref.named_parameters())
    assert got.keys() == expected.keys()
    for name in expected:
        assert rel_err(got[name], expected[name]) < 1e-5, name
