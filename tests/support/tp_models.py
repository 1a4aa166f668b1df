"""Tiny transformers decoders under tensor parallelism: models, batches, the unsplit
reference and the comparison of each rank's shards with it.

The models (Llama, Qwen2, Qwen3, Mistral, Mixtral, OLMo 2, Phi-3, Nemotron-H: hidden 64, 4
heads, 2 key/value heads, vocabulary 128) are built from configs, the same weights every
call. A batch is 5 rows
of one length with labels padded by -100 at other lengths per row; 3 micro-batches cut
it unevenly (2, 2, 1). Two steps of other lengths, an SGD step between them.

A rank's gradient of a parameter tensor parallelism shards is a DTensor: its local shard
is compared with the matching slice (``Shard(d)``: the rank's chunk of dimension d) of
the unsplit model's gradient, the others with the whole gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

import conveyor
from conveyor.partition.capture import capture
from conveyor.runtime import microbatch
from conveyor.runtime.tp_export import kept_for_tp
from conveyor.runtime.tp_styles import resolve

MICRO = 3
LR = 0.1
LENGTHS = (9, 6)
ROWS = 5
VOCAB = 128

Step = tuple[float, dict[str, torch.Tensor]]
Shards = dict[str, tuple[torch.Tensor, str]]  # name -> (local gradient, placement)


def tiny(kind: str, layers: int = 4) -> nn.Module:
    """A tiny ``kind`` causal LM from its config (llama, qwen2, qwen3, mistral, mixtral,
    olmo2, phi3, nemotron_h)."""
    import transformers as T

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    if kind == "llama":
        config: Any = T.LlamaConfig(**common)
    elif kind == "qwen2":  # biases on q, k, v: sharded with their rows
        config = T.Qwen2Config(**common)
    elif kind == "qwen3":  # per-head q/k norms on the local heads
        config = T.Qwen3Config(head_dim=16, **common)
    elif kind == "mistral":  # eager attention: repeat_kv by the config's ratio
        config = T.MistralConfig(**common)
        config._attn_implementation = "eager"
    elif kind == "mixtral":
        config = T.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                 router_jitter_noise=0.0, **common)  # fmt: skip
        config._attn_implementation = "eager"
    elif kind == "olmo2":  # q/k norms over all heads: q/k/v outputs gathered
        config = T.Olmo2Config(**common)
    elif kind == "phi3":  # fused q/k/v and gate/up projections, sliced: outputs gathered
        config = T.Phi3Config(**common)
    elif kind == "nemotron_h":  # attention and MLP blocks (no Mamba): the embedding by rows
        blocks = ["attention", "mlp"] * (layers // 2) + ["attention"] * (layers % 2)
        config = T.NemotronHConfig(layers_block_type=blocks, head_dim=16, **common)
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config)
    return model.float().train()


def batches() -> list[dict[str, torch.Tensor]]:
    """Two steps' batches: ``input_ids`` and ``labels`` (row r padded by r % 4 + r // 4)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for length in LENGTHS:
        ids = torch.randint(1, VOCAB, (ROWS, length), generator=g)
        labels = ids.clone()
        for r in range(ROWS):
            labels[r, length - (r % 4) - r // 4 :] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def reference(kind: str, model: nn.Module | None = None) -> list[Step]:
    """Per step: the unsplit model's (``model``, else :func:`tiny`'s) whole-batch loss and
    gradients."""
    model = tiny(kind) if model is None else model
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for batch in batches():
        loss = model(**batch).loss
        loss.backward()
        out.append((float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def captured(model: nn.Module, tp_plan: Mapping[str, Any] | str, tp: int) -> nn.Module:
    """``model`` captured here as each rank's Pipeline captures it (tests/support/
    captures.py), its tp_plan's modules kept whole: forked ranks split it without export."""
    kept = kept_for_tp(model, resolve(tp_plan, model), tp)
    capture(model, microbatch.first(batches()[0], MICRO), kept)
    return model


def shards(named: Any, full: bool = False) -> Shards:
    """This rank's gradients: the local shard and how it was cut, ``"tp:S(0)"`` (mesh
    dimension and placement, ``;``-joined; ``""``: whole); ``full``: gathered whole. A
    partial sum (a replicated parameter used on a slice: Qwen3's q/k norms) is summed."""
    out: Shards = {}
    for name, p in named:
        if p.grad is None:
            continue
        g = p.grad
        if not hasattr(g, "placements") or full:
            whole = g.full_tensor() if hasattr(g, "full_tensor") else g
            out[name] = (whole.detach().clone(), "")
            continue
        if any(pl.is_partial() for pl in g.placements):  # summed over tp by the optimizer
            from torch.distributed.tensor import Replicate

            whole = [Replicate() if pl.is_partial() else pl for pl in g.placements]
            g = g.redistribute(g.device_mesh, whole)
        dims = g.device_mesh.mesh_dim_names or ("tp",)
        cut = ";".join(f"{d}:{pl}" for d, pl in zip(dims, g.placements, strict=True))
        out[name] = (g.to_local().detach().clone(), cut)
    return out


def train(
    pipe: conveyor.Pipeline,
    dp_rank: int = 0,
    dp: int = 1,
    steps: int = len(LENGTHS),
    full: bool = False,
) -> list[tuple[float, Shards]]:
    """Per step of :func:`batches` (the first ``steps``; this replica's rows): the loss and
    this rank's shards, an SGD step after each."""
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    out = []
    for batch in batches()[:steps]:
        mine = {k: v[dp_rank::dp] for k, v in batch.items()} if dp > 1 else batch
        loss = pipe.train_step(mine, None)
        out.append((float(loss), shards(pipe.named_parameters(), full)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def piece(
    whole: torch.Tensor, cut: str, ranks: Mapping[str, int], sizes: Mapping[str, int]
) -> torch.Tensor:
    """The slice of ``whole`` a rank holds after ``cut`` (see :func:`shards`): for each
    ``Shard(d)`` over a mesh dimension, this rank's chunk of dimension d."""
    for part in filter(None, cut.split(";")):
        dim, placement = part.split(":")
        if placement.startswith("S("):
            whole = whole.chunk(sizes[dim], dim=int(placement[2:-1]))[ranks[dim]]
    return whole


def check(
    got: list[tuple[float, Shards]],
    want: list[Step],
    ranks: Mapping[str, int],
    sizes: Mapping[str, int],
    what: str,
) -> set[str]:
    """Every step's loss and every held gradient within 1e-5 (relative; a gradient that is
    nearly zero is measured against a thousandth of the model's largest). Returns the
    names held."""
    held: set[str] = set()
    for step, ((loss, grads), (ref_loss, ref)) in enumerate(zip(got, want, strict=True)):
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (
            f"{what} step {step} loss {loss} != {ref_loss}"
        )
        floor = 1e-3 * max(float(g.norm()) for g in ref.values())
        for name, (local, placement) in grads.items():
            w = piece(ref[name], placement, ranks, sizes)
            assert local.shape == w.shape, f"{what} step {step} {name}: {local.shape} != {w.shape}"
            err = float((local - w).norm()) / max(float(w.norm()), floor)
            assert err < 1e-5, f"{what} step {step} {name} ({placement}): {err:.1e}"
            held.add(name)
    return held
