"""Modules kept whole in a torch.export capture (conveyor/partition/kept.py): the
tp_plan's projections and the expert collections become ``call_module`` nodes recorded
with one tensor-parallel rank's output; ``tp_plan="auto"`` from the model's own plan
(conveyor/runtime/tp_styles.py); and the errors. One process, no tensor parallelism run
(tests/parallel/test_tp_transformers.py runs it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import conveyor
from conveyor.partition.capture import capture
from conveyor.runtime import microbatch
from conveyor.runtime.tp_export import check_export_plan, kept_for_tp
from conveyor.runtime.tp_styles import resolve
from tests.support import tp_models as M

pytest.importorskip("transformers")


def _calls(model: nn.Module, tp_plan: Any) -> dict[str, tuple[int, ...]]:
    kept = kept_for_tp(model, resolve(tp_plan, model), 2)
    cap = capture(model, microbatch.first(M.batches()[0], M.MICRO), kept)
    return {
        str(n.target): tuple(n.meta["val"].shape[2:])
        for n in cap.graph.nodes
        if n.op == "call_module"
    }


def test_auto_plan_of_a_llama_is_torch_styles_under_the_full_names() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = resolve("auto", M.tiny("llama", layers=1))
    assert plan is not None
    assert set(plan) == {f"model.layers.*.{m}" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}  # fmt: skip
    assert type(plan["model.layers.*.self_attn.q_proj"]) is ColwiseParallel
    assert type(plan["model.layers.*.mlp.down_proj"]) is RowwiseParallel


def test_auto_plan_leaves_experts_to_ep() -> None:
    plan = resolve("auto", M.tiny("mixtral", layers=1))
    assert plan is not None
    assert sorted(plan) == sorted(
        f"model.layers.*.self_attn.{p}_proj" for p in ("q", "k", "v", "o")
    )


def test_auto_plan_errors() -> None:
    with pytest.raises(conveyor.ConfigError, match=r"base_model_tp_plan, which Sequential"):
        resolve("auto", nn.Sequential(nn.Linear(2, 2)))
    model = M.tiny("llama", layers=1)
    model.config.base_model_tp_plan = {"layers.*.mlp.gate_proj": "mla_kv_a_proj"}
    with pytest.raises(conveyor.ConfigError, match=r"'mla_kv_a_proj', which has no torch"):
        resolve("auto", model)


@pytest.mark.slow  # over 2 s: the fast lane stays under 90 s
def test_tp_modules_are_calls_with_one_ranks_output() -> None:
    """q/k/v and gate/up give half their features (heads), o/down the whole hidden
    size; the expert collections are calls too."""
    calls = _calls(M.tiny("llama", layers=2), "auto")
    assert len(calls) == 2 * 7
    assert calls["model.layers.1.self_attn.q_proj"] == (32,)  # 2 of 4 heads of 16
    assert calls["model.layers.1.self_attn.k_proj"] == (16,)  # 1 of 2 kv heads
    assert calls["model.layers.1.self_attn.o_proj"] == (64,)
    assert calls["model.layers.1.mlp.up_proj"] == (64,)
    assert calls["model.layers.1.mlp.down_proj"] == (64,)
    moe = _calls(M.tiny("mixtral", layers=1), "auto")
    assert set(moe) == {f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"} | {
        "model.layers.0.mlp.experts"
    }


def test_a_style_an_export_capture_cannot_keep_is_refused() -> None:
    from torch.distributed.tensor.parallel import SequenceParallel

    model = M.tiny("llama", layers=1)
    plan = {"model.layers.*.input_layernorm": SequenceParallel()}
    with pytest.raises(
        conveyor.ConfigError,
        match=r"input_layernorm \(LlamaRMSNorm\) a "
        r"SequenceParallel, but LlamaForCausalLM is captured with torch.export",
    ):
        check_export_plan(model, plan, kept_for_tp(model, plan, 2))


def test_without_a_plan_the_capture_is_unchanged() -> None:
    model = M.tiny("llama", layers=1)
    assert kept_for_tp(model, None, 2) == {}
    first = microbatch.first(M.batches()[0], M.MICRO)
    assert capture(model, first, {}) is capture(model, first)
    assert not [n for n in capture(model, first).graph.nodes if n.op == "call_module"]
    assert torch.ops.conveyor.kept_call.default is not None


def test_qwen3_norms_on_the_local_heads_are_kept_whole() -> None:
    """replicated_with_grad_allreduce (q_norm / k_norm) becomes a SequenceParallel whose
    module is a call shaped as its input: the local heads."""
    from torch.distributed.tensor.parallel import SequenceParallel

    model = M.tiny("qwen3", layers=1)
    plan = resolve("auto", model)
    assert plan is not None
    style = plan["model.layers.*.self_attn.q_norm"]
    assert isinstance(style, SequenceParallel) and style.use_local_output
    calls = _calls(model, "auto")
    assert calls["model.layers.0.self_attn.q_norm"] == (2, 16)  # 2 of 4 heads of 16
    assert calls["model.layers.0.self_attn.k_norm"] == (1, 16)
