"""``tp_plan="auto"``'s style names (conveyor/runtime/tp_styles.py): each transformers style
the table maps becomes the torch ``ParallelStyle`` with transformers' own layouts, and
``sequence_parallel`` is refused. One process; the models that use each style train
exactly under pp 2 x tp 2 in tests/parallel/test_tp_transformers.py."""

from __future__ import annotations

from typing import Any

import pytest

import conveyor
from conveyor.runtime.tp_styles import resolve
from tests.support import tp_models as M

pytest.importorskip("transformers")

# a module of a one-layer Llama per style name
MODULES = {
    "colwise": "layers.*.self_attn.q_proj",
    "rowwise": "layers.*.self_attn.o_proj",
    "colwise_rep": "layers.*.self_attn.k_proj",
    "colwise_gather_output": "layers.*.self_attn.v_proj",
    "rowwise_rep": "layers.*.mlp.down_proj",
    "rowwise_split_input": "layers.*.mlp.gate_proj",
    "embedding_rowwise": "embed_tokens",
    "embedding_colwise": "norm",
    "replicated_with_grad_allreduce": "layers.*.input_layernorm",
}


def _described(style: Any) -> tuple[str, ...]:
    """A torch ParallelStyle as (class, input layouts, output layouts, use_local_output)."""
    if type(style).__name__ == "SequenceParallel":
        return ("SequenceParallel", str(style.sequence_sharding), "", str(style.use_local_output))
    return (type(style).__name__, str(style.input_layouts), str(style.output_layouts),
            str(style.use_local_output))  # fmt: skip


def test_each_style_name_is_the_torch_style_with_transformers_layouts() -> None:
    """As transformers registers them: ``*_rep``, ``colwise_gather_output`` and
    ``rowwise_split_input`` take and give the whole tensor; ``embedding_rowwise`` splits
    the vocabulary rows (a row-parallel lookup of replicated ids), ``embedding_colwise``
    the features (gathered after)."""
    from torch.distributed.tensor import Replicate, Shard

    r, s = (Replicate(),), (Shard(-1),)
    col = ("ColwiseParallel", str(r), str(s), "True")
    row = ("RowwiseParallel", str(s), str(r), "True")
    col_rep = ("ColwiseParallel", str(r), str(r), "True")
    row_rep = ("RowwiseParallel", str(r), str(r), "True")
    want = {
        "colwise": col,
        "rowwise": row,
        "colwise_rep": col_rep,
        "colwise_gather_output": col_rep,
        "rowwise_rep": row_rep,
        "rowwise_split_input": row_rep,
        "embedding_rowwise": row_rep,
        "embedding_colwise": col_rep,
        "replicated_with_grad_allreduce": ("SequenceParallel", str((Shard(0),)), "", "True"),
    }
    model = M.tiny("llama", layers=1)
    model.config.base_model_tp_plan = {module: style for style, module in MODULES.items()}
    plan = resolve("auto", model)
    assert plan is not None
    got = {style: _described(plan[f"model.{MODULES[style]}"]) for style in MODULES}
    assert got == want


def test_sequence_parallel_is_refused() -> None:
    """Between transformers' colwise/rowwise styles a norm's input is the whole sequence:
    torch's SequenceParallel would take it as this rank's slice and sum its gradients
    over tp (measured: twice the unsplit gradient at tp 2)."""
    model = M.tiny("llama", layers=1)
    model.config.base_model_tp_plan = {
        **model.config.base_model_tp_plan,
        "layers.*.post_attention_layernorm": "sequence_parallel",
    }
    with pytest.raises(
        conveyor.ConfigError,
        match=r"LlamaForCausalLM's plan gives 'layers\.\*\.post_attention_layernorm' the "
        r"transformers style 'sequence_parallel', .* give it 'replicated_with_grad_allreduce'"
        r" if it runs on this rank's slice of a split tensor, else leave it out$",
    ):
        resolve("auto", model)
    # a pattern that names no module of this model is skipped, as for any style
    model.config.base_model_tp_plan = {"layers.*.no_such_norm": "sequence_parallel"}
    assert resolve("auto", model) == {}
