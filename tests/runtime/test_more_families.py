"""transformers families with parts the test zoo's models lack, split with no changes and
trained exactly: Gemma 3 (sliding and global layers, query scaling), DeepSeek-V3 (latent
attention, routed and shared experts after a dense layer), gpt-oss (attention sinks,
experts as batched weights, sliding layers), Falcon (attention and MLP in parallel), OPT
(positions from the attention mask, a key bias whose gradient is zero up to rounding).

Tiny random-init models from their configs (no download), pp=2 in one process, zbv (a
split backward and the V placement), two steps of padded rows (``attention_mask``, labels
-100 on the pads; the second step shorter and padded on the left) against the unsplit
model's loss over the whole batch and its gradients (within what rounding reaches)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import conveyor
from tests.support.helpers import assert_close, grads_of

pytestmark = pytest.mark.slow  # a capture of about 3 s per family
T = pytest.importorskip("transformers")

VOCAB = 97
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
             use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             attention_dropout=0.0, tie_word_embeddings=False)  # fmt: skip
FAMILIES: dict[str, dict[str, Any]] = {
    "gemma3_text": dict(sliding_window=4, query_pre_attn_scalar=8),
    "deepseek_v3": dict(head_dim=4, num_key_value_heads=4, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                        kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                        v_head_dim=8, n_group=1, topk_group=1),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, alibi=False, head_dim=None),
    "opt": dict(ffn_dim=64, word_embed_proj_dim=32, dropout=0.0),
}  # fmt: skip


def model_of(family: str) -> Any:
    """The family's tiny causal LM, in training mode, seeded."""
    settings = {**SHAPE, **FAMILIES[family]}
    settings = {k: v for k, v in settings.items() if v is not None}  # None: the config's own
    torch.manual_seed(0)
    config = T.AutoConfig.for_model(family, **settings)
    return T.AutoModelForCausalLM.from_config(config).train()


def padded(rows: int, length: int, seed: int, left: bool = False) -> dict[str, torch.Tensor]:
    """Rows of different lengths padded to ``length`` (the first one full), on the right or
    on the ``left`` (where the real tokens' keys must not see the pads)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    mask = mask.flip(1) if left else mask
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def exact(pipe: conveyor.Pipeline, reference: Any, batches: list[Any], what: str) -> None:
    """Each batch's step of ``pipe`` has the loss and gradients of ``reference``'s (the
    unsplit model, its own loss over the whole batch)."""
    for step, batch in enumerate(batches):
        reference.zero_grad(set_to_none=True)
        want = reference(**batch).loss
        want.backward()
        for p in pipe.parameters():
            p.grad = None
        got = pipe.train_step(batch, None)
        assert float(got) == pytest.approx(float(want.detach()), rel=1e-5), (what, step)
        assert_close(grads_of(pipe.named_parameters()), grads_of(reference.named_parameters()),
                     f"{what}, step {step}")  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_family_trains_exactly_on_two_stages(family: str) -> None:
    model = model_of(family)
    reference = copy.deepcopy(model)
    batches = [padded(6, 9, 0), padded(5, 7, 1, left=True)]
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=3, schedule="zbv",
                             context=conveyor.init(pp=2))  # fmt: skip
    exact(pipe, reference, batches, family)
