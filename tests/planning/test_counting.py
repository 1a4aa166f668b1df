"""conveyor.planning.counting: the parts told apart by torch's ModuleTracker, and nothing
of torch or transformers patched, during the count or after it."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
import torch
from transformers import LlamaConfig, masking_utils
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from conveyor.planning.counting import count_model
from conveyor.planning.model_count import ATTENTION, MATMUL, OTHER, Op


def llama(layers: int = 3, h: int = 128) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=h,
        intermediate_size=4 * h,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )


def test_counting_patches_nothing_of_torch_or_transformers() -> None:
    autocast = torch.is_autocast_enabled
    packed = masking_utils.find_packed_sequence_indices
    attentions = sorted(ALL_ATTENTION_FUNCTIONS)
    seen: list[bool] = []

    def look(module: torch.nn.Module, args: object) -> None:
        seen.append(
            torch.is_autocast_enabled is autocast
            and masking_utils.find_packed_sequence_indices is packed
        )

    hook = torch.nn.modules.module.register_module_forward_pre_hook(look)
    try:
        count_model(llama(), 96)  # a sequence length no other test counts: not cached
    finally:
        hook.remove()
    assert seen and all(seen)
    assert torch.is_autocast_enabled is autocast
    assert masking_utils.find_packed_sequence_indices is packed
    assert sorted(ALL_ATTENTION_FUNCTIONS) == attentions


def test_each_layers_work_is_its_own() -> None:
    """h = 128, s = 64, 4 heads of 32 with 2 key/value heads, MLP 512: a layer's forward
    multiplies are 2s(h*h + 2*h*64 + h*h) + 2s*3*h*512, its attention 4*s*s*h (causal);
    the embeddings multiply nothing and the head's is 2*s*h*512."""
    h, s = 128, 64
    counted = count_model(llama(h=h), s)
    layer_mm = 2 * s * (h * h + 2 * h * 64 + h * h) + 2 * s * 3 * h * 512
    for layer in counted.layers:
        assert sum(o.flops * o.count for o in layer.forward if o.kind == MATMUL) == layer_mm
        attention = [o for o in layer.forward if o.kind == ATTENTION]
        assert [(o.flops, o.causal, o.count) for o in attention] == [(4 * s * s * h, True, 1)]
        assert sum(o.flops * o.count for o in layer.weight if o.kind == MATMUL) == layer_mm
    pre, post = counted.parts[0], counted.parts[-1]
    assert not any(o.kind == MATMUL for o in pre.forward + pre.backward + pre.weight)
    assert sum(o.flops * o.count for o in post.forward if o.kind == MATMUL) == 2 * s * h * 512
    assert sum(o.flops * o.count for o in post.backward if o.kind == MATMUL) == 2 * s * h * 512
    assert counted.heads == 4 and counted.kv_heads == 2
    # B and W of the first and second layers are alike; the embedding's backward, which
    # runs after the first layer's, is pre's W alone: it reads the [s, h] gradient and
    # the s token ids (int64) and writes the [512, h] weight gradient, in bf16
    first, second = counted.layers[:2]
    assert sorted(map(repr, first.backward)) == sorted(map(repr, second.backward))
    assert sorted(map(repr, first.weight)) == sorted(map(repr, second.weight))
    assert pre.backward == ()
    weight_grad = 512 * h * 2
    assert pre.weight == (
        Op(OTHER, 0.0, s * h * 2 + s * 8 + weight_grad, 0, False, 1, out=weight_grad),
    )
