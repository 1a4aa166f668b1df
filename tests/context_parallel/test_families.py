"""transformers families under context parallelism, in one process (every cp rank's share
side by side): Gemma 3, DeepSeek-V3 and OPT trained exactly (rows padded on the right,
then on the left, the unsplit
model's loss over the whole batch and its gradients, two steps). A model whose attention
cp cannot take is refused when the pipeline is built, in one sentence, instead of training
each rank on its share's attention only: Falcon, which calls
``scaled_dot_product_attention`` itself (with ``sdpa``) or computes its scores by hand
(``eager``); a Llama's graph holds conveyor's operator, one per layer."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import conveyor
from conveyor.errors import ConfigError
from tests.runtime.test_more_families import exact, model_of, padded

T = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
             use_cache=False)  # fmt: skip


def falcon(implementation: str) -> Any:
    torch.manual_seed(0)
    config = T.FalconConfig(new_decoder_architecture=True, num_kv_heads=2, alibi=False,
                            attn_implementation=implementation, **SHAPE)  # fmt: skip
    return T.FalconForCausalLM(config)


def pipeline(model: Any, vocab: int = 64) -> conveyor.Pipeline:
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    return conveyor.Pipeline(model, loss_fn=None, microbatches=2, sample=({"input_ids": ids,
                             "labels": ids}, None), context=conveyor.init(pp=2, cp=2))  # fmt: skip


@pytest.mark.parametrize(
    ("implementation", "says"),
    [("sdpa", "calls aten.scaled_dot_product_attention"),
     ("eager", "computes its attention without transformers' attention interface")],
)  # fmt: skip
def test_falcon_is_refused_under_cp(implementation: str, says: str) -> None:
    with pytest.raises(
        ConfigError, match=f"FalconForCausalLM .*{says}.*train this model with cp=1"
    ):
        pipeline(falcon(implementation))


def test_a_llama_reaches_conveyors_attention() -> None:
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(intermediate_size=64, num_key_value_heads=2,
                                             **SHAPE))  # fmt: skip
    pipe = pipeline(model)
    calls = [str(n.target) for s in pipe.stages for n in s.graph.nodes if n.op == "call_function"]
    assert sum("cp_attention" in c for c in calls) == 2  # one per layer


@pytest.mark.slow  # a capture of about 3 s each
@pytest.mark.parametrize("family", ["gemma3_text", "deepseek_v3", "opt"])
def test_the_family_trains_exactly_with_its_sequence_cut(family: str) -> None:
    model = model_of(family)
    reference = copy.deepcopy(model)
    batches = [padded(6, 8, 0), padded(5, 12, 1, left=True)]  # lengths a multiple of 2 * cp
    if family == "opt":  # it numbers tokens from the mask: position_ids as it numbers them
        for batch in batches:
            mask = batch["attention_mask"]
            batch["position_ids"] = mask.cumsum(1) * mask - 1
    pipe = conveyor.Pipeline(model, loss_fn=None, microbatches=3,
                             context=conveyor.init(pp=2, cp=2))  # fmt: skip
    exact(pipe, reference, batches, f"{family} under cp 2")


def test_gpt_oss_is_refused_for_its_sinks_in_one_sentence() -> None:
    """The refusal its attention raises while the model is captured is the error, not
    wrapped in what stopped the capture (whose ways out would not help)."""
    with pytest.raises(ConfigError) as raised:
        pipeline(model_of("gpt_oss"), vocab=97)
    assert str(raised.value) == (
        "GptOssAttention passes s_aux to its attention, which context parallelism does not "
        "compute; train this model with cp=1"
    )
