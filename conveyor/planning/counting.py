"""A causal language model counted on the meta device: FLOPs, bytes and saved activations
per part, for one sequence, without a single real tensor (:func:`count_model`).

The model (a transformers config, built here on the meta device, or a model already on
it) runs one traced step (:mod:`~conveyor.planning.tracing`): a forward with its loss and
two backwards, every aten operation recorded (:mod:`~conveyor.planning.recording`) under
the part that ran it: the embeddings (``pre``), a decoder layer, or the final norm, head
and loss (``post``). F is the forward, B the gradients with respect to the layers' inputs
only, W the rest of the backward: exactly the weight-gradient work.

What autograd saves for the backward is counted per part the way the runtime's
:class:`~conveyor.runtime.memory.ActivationMeter` counts it on a real step. Attention is
counted as the fused kernel GPUs run (the flash kernel's aten op, which saves its output
and log-sum-exp instead of the sequence x sequence scores). Layers alike are traced twice
and counted once. Everything scales linearly with the micro-batch size
(:mod:`~conveyor.planning.counted` multiplies), so one sequence is traced.
"""

from __future__ import annotations

import collections
import copy
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from conveyor.errors import ConfigError
from conveyor.partition.experts import is_experts_collection, num_experts
from conveyor.planning.model_count import ATTENTIONS, DTYPES, ModelCount, Op, Part, Record
from conveyor.planning.tracing import ATTENTION_NAME, Run, counting_attention, trace


def count_model(model: Any, seq: int, dtype: str = "bf16", attention: str = "flash") -> ModelCount:
    """Count ``model`` for one sequence of ``seq`` tokens (see the module docstring).

    Args:
        model: A transformers config of a causal language model, or such a model built
            under :func:`conveyor.empty_weights` (or on the meta device).
        seq: Tokens per sequence.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        attention: ``"flash"``: attention as the fused kernel a GPU runs, written by hand
            or not; ``"math"``: as written, or as SDPA's math form (the scores saved).

    Returns:
        The counts; the same object for the same config, ``seq``, ``dtype`` and
        ``attention``.

    Raises:
        ConfigError: For a model that is neither, one with no decoder-layer list, or a
            model whose forward does not take ``input_ids`` and ``labels``.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if seq < 1:
        raise ConfigError(f"seq must be >= 1, got {seq}")
    if attention not in ATTENTIONS:
        raise ConfigError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    if isinstance(model, nn.Module):
        with counting_attention():
            return _count(_on_meta(model, dtype), seq, dtype, attention)
    return _count_config(_ConfigKey(model), seq, dtype, attention)


class _ConfigKey:
    """A config hashed by its contents, so a config counted once is not counted again."""

    def __init__(self, config: Any) -> None:
        if not hasattr(config, "to_json_string"):
            raise ConfigError(
                f"cannot count a {type(config).__name__}; pass a transformers config "
                "(AutoConfig.for_model(...)) or a model built under conveyor.empty_weights()"
            )
        self.config = config
        self.key = config.to_json_string()

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ConfigKey) and other.key == self.key


@functools.lru_cache(maxsize=16)
def _count_config(key: _ConfigKey, seq: int, dtype: str, attention: str) -> ModelCount:
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(key.config)
    _training(config)
    with counting_attention(), torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, attn_implementation=ATTENTION_NAME
            )
        except ValueError:  # attention written by hand (BLOOM's): counted as it runs
            model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        model.tie_weights()  # transformers 5.0 leaves a model built on meta untied
        return _count(model.to(DTYPES[dtype]), seq, dtype, attention)


def _on_meta(model: nn.Module, dtype: str) -> nn.Module:
    """A copy of ``model`` to count (counting changes it), on meta in ``dtype``."""
    if any(not p.is_meta for p in model.parameters()):
        raise ConfigError(
            "count a model on the meta device: build it under conveyor.empty_weights(), "
            "or pass its transformers config"
        )
    copied = copy.deepcopy(model)
    _training(getattr(copied, "config", None))
    choose = getattr(copied, "set_attn_implementation", None)  # a transformers model's
    if callable(choose):
        choose(ATTENTION_NAME)
    return copied.to(device="meta", dtype=DTYPES[dtype])


def _training(config: Any) -> None:
    """Count the model as it trains: without a key/value cache (the cache's update copies
    keys and values, which then take more saved memory than views of a fused projection)."""
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: its longest list of modules of one class.

    Raises:
        ConfigError: If it has no such list of two or more.
    """
    lists = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1
    ]
    if not lists:
        raise ConfigError(
            f"{type(model).__name__} has no list of decoder layers (an nn.ModuleList of one "
            "class) to count; pass a transformers causal language model"
        )
    return max(lists, key=len)


def _count(model: nn.Module, seq: int, dtype: str, attention: str) -> ModelCount:
    """Count ``model``, a copy of the caller's: only the layers traced stay in its list."""
    layers = decoder_layers(model)
    everything = list(layers)
    traced, stands_for = _representatives(everything)
    expert_owner = _expert_params(model)
    layer_params = [{id(p): p for p in layer.parameters()} for layer in everything]
    outside = {id(p): p for p in model.parameters()}
    for owned in layer_params:
        for key in owned:
            outside.pop(key, None)
    kept = set(traced)
    for i in reversed(range(len(everything))):
        if i not in kept:
            del layers[i]
    heads = _config_int(model, "num_attention_heads", "n_head")
    hidden = _config_int(model, "hidden_size", "n_embd")
    run = trace(model, list(layers), seq, hidden, heads, fused=attention == "flash")
    # Layers alike share one Part object (and the estimate's per-part times with it).
    made = {
        i: _part(run, j + 1, "layer", layer_params[i], expert_owner) for j, i in enumerate(traced)
    }
    parts = [_part(run, 0, "pre", outside, expert_owner)]
    parts += [made[stands_for[i]] for i in range(len(everything))]
    parts.append(_part(run, len(traced) + 1, "post", outside, expert_owner))
    both = run.reads.get(0, set()) & run.reads.get(len(traced) + 1, set())
    return ModelCount(
        name=type(model).__name__,
        seq=seq,
        dtype=dtype,
        attention=attention,
        parts=tuple(parts),
        hidden_bytes=run.hidden / seq,
        heads=heads,
        tied_params=sum(p.numel() for k, p in outside.items() if k in both),
        kv_heads=_config_int(model, "num_key_value_heads", "num_kv_heads") or heads,
    )


def _representatives(layers: list[nn.Module]) -> tuple[list[int], list[int]]:
    """The layers to trace, and for every layer the traced one that stands for it.

    Layers alike (one class, the same parameter shapes, the same attention type) cost the
    same, so the first two of each kind are traced (the first also carries what all
    layers share, such as rotary tables) and later ones take the second's counts.
    """
    seen: dict[Any, list[int]] = {}
    stands_for = []
    for i, layer in enumerate(layers):
        shapes = tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())
        kind = (type(layer), shapes, getattr(layer, "attention_type", None))
        found = seen.setdefault(kind, [])
        if len(found) < 2:
            found.append(i)
        stands_for.append(i if found[-1] == i else found[-1])
    return sorted(i for found in seen.values() for i in found), stands_for


def _part(
    run: Run, index: int, name: str, params: Mapping[int, Tensor], expert_owner: dict[int, int]
) -> Part:
    """Part ``index`` of a run; outside the layers, only the parameters it read."""
    if name != "layer":
        params = {k: p for k, p in params.items() if k in run.reads.get(index, ())}
    return Part(
        name=name,
        forward=_ops(run.forward.get(index, [])),
        backward=_ops(run.backward.get(index, [])),
        weight=_ops(_minus(run.whole.get(index, []), run.backward.get(index, []))),
        saved_bytes=float(run.saved[index]),
        saved_hidden=float(run.wide[index]),
        workspace=float(run.workspace.get(index, 0.0)),
        params=sum(p.numel() for p in params.values()),
        param_tensors=len(params),
        expert_params=sum(p.numel() for k, p in params.items() if k in expert_owner),
        experts=max((expert_owner[k] for k in params if k in expert_owner), default=0),
        routed_bytes=float(run.routed[index]),
    )


def _ops(records: list[Record]) -> tuple[Op, ...]:
    counts = collections.Counter(records)
    return tuple(
        Op(r.kind, r.flops, r.bytes, r.fixed, r.causal, c, r.shape, r.grows, r.out)
        for r, c in counts.items()
    )


def _minus(whole: list[Record], part: list[Record]) -> list[Record]:
    left = collections.Counter(whole)
    left.subtract(collections.Counter(part))
    return list(left.elements())


def _expert_params(model: nn.Module) -> dict[int, int]:
    """Parameter id -> expert count, for the parameters of expert collections."""
    found: dict[int, int] = {}
    for module in model.modules():
        if is_experts_collection(module):
            for p in module.parameters():
                found[id(p)] = int(num_experts(module) or 0)
    return found


def _config_int(model: nn.Module, *names: str) -> int:
    """The first of ``names`` its config holds as an integer, or 0."""
    config = getattr(model, "config", None)
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return 0
