"""What giving a meta model its values must keep besides the values (one process):

- a parameter frozen (``requires_grad=False``) before the model gets its values stays
  frozen, under ``conveyor.materialize``, ``Pipeline(init_seed=)`` and ``weights=``
  (frozen embeddings, LoRA base weights): no gradient, no change after a step, and the
  trainable parameters' gradients are the unsplit model's, frozen alike;
- a transformers MoE checkpoint with many experts (Qwen2-MoE's 60) loads each expert's
  own weights: the stored per-expert tensors are stacked in numeric order (10 after 9,
  not after 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

import conveyor
from tests.support.helpers import assert_close, grads_of

VOCAB, WIDTH = 11, 8


class LoRALinear(nn.Module):
    """A linear layer with a low-rank adapter: ``base(x) + up(down(x))``."""

    def __init__(self, width: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))  # type: ignore[no-any-return]


FROZEN = ("0.weight", "1.base.weight", "1.base.bias", "3.base.weight", "3.base.bias")
"""The embedding and the adapted layers' base weights."""


def frozen_model() -> nn.Sequential:
    """An embedding and two adapted layers, built on the meta device, frozen where LoRA
    fine-tuning freezes them (:data:`FROZEN`)."""
    with conveyor.empty_weights():
        model = nn.Sequential(
            nn.Embedding(VOCAB, WIDTH), LoRALinear(WIDTH), nn.Tanh(), LoRALinear(WIDTH),
            nn.Linear(WIDTH, 3),
        )  # fmt: skip
    for name, p in model.named_parameters():
        p.requires_grad_(name not in FROZEN)
    return model


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (6,), generator=g), torch.randn(6, 3, generator=g)


def check_frozen(named: dict[str, nn.Parameter], before: dict[str, torch.Tensor]) -> None:
    """The frozen parameters of ``named`` still frozen, without gradient and unchanged."""
    for name, p in named.items():
        assert p.requires_grad == (name not in FROZEN), f"{name}: requires_grad {p.requires_grad}"
        if name in FROZEN:
            assert p.grad is None, f"{name} got a gradient"
            assert torch.equal(p.detach(), before[name]), f"{name} changed"


@pytest.mark.parametrize("source", ["init_seed", "weights"])
def test_a_parameter_frozen_before_it_gets_values_stays_frozen(source: str, tmp_path: Path) -> None:
    ref = conveyor.materialize(frozen_model(), init_seed=3)
    assert [n for n, p in ref.named_parameters() if not p.requires_grad] == list(FROZEN)
    weights = None
    if source == "weights":  # values no initialization draws
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.1)
        save_file({k: v.clone() for k, v in ref.state_dict().items()},
                  str(tmp_path / "model.safetensors"))  # fmt: skip
        weights = tmp_path
        loaded = conveyor.materialize(frozen_model(), weights=weights)
        check_frozen(dict(loaded.named_parameters()), dict(loaded.state_dict()))
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    x, y = data()
    F.mse_loss(ref(x), y).backward()
    want = grads_of(ref.named_parameters())
    pipe = conveyor.Pipeline(frozen_model(), loss_fn=F.mse_loss, microbatches=2, balance=[2, 3],
                             context=conveyor.init(pp=2), init_seed=3, weights=weights)  # fmt: skip
    trainable = [p for p in pipe.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.5)
    pipe.train_step(x, y)
    named = dict(pipe.named_parameters())
    got = grads_of(named.items())
    assert_close(got, want, "trainable gradients", reduction=x.numel() + WIDTH)
    opt.step()
    check_frozen(named, before)


def test_materialize_keeps_a_frozen_parameter_frozen() -> None:
    model = conveyor.materialize(frozen_model(), init_seed=1)
    check_frozen(dict(model.named_parameters()), dict(model.state_dict()))
    assert all(not p.is_meta for p in model.parameters())


# ------------------------------------------------------------------ many experts
def qwen2_moe(experts: int) -> nn.Module:
    """A tiny Qwen2-MoE with the published model's expert count, on the meta device."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2MoeConfig(
        vocab_size=16, hidden_size=4, intermediate_size=4, moe_intermediate_size=2,
        shared_expert_intermediate_size=2, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_experts=experts, num_experts_per_tok=2,
        max_position_embeddings=8, decoder_sparse_step=1, use_cache=False,
    )  # fmt: skip
    with conveyor.empty_weights():
        return transformers.Qwen2MoeForCausalLM(config)


def test_a_checkpoint_of_60_experts_loads_each_experts_own_weights(tmp_path: Path) -> None:
    saved = conveyor.materialize(qwen2_moe(60), init_seed=4)
    saved.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        stored = [k for k in f.keys() if ".experts.59." in k]  # noqa: SIM118
    assert stored, "expected one stored tensor per expert (the published layout)"
    got = conveyor.materialize(qwen2_moe(60), weights=tmp_path)
    want = saved.state_dict()
    for name, value in got.state_dict().items():
        assert torch.equal(value, want[name]), f"{name} differs from the saved model's"
    down = dict(got.named_parameters())["model.layers.0.mlp.experts.down_proj"].detach()
    assert not torch.equal(down[2], down[10]), "two experts hold the same values"
