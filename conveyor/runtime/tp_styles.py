"""``tp_plan="auto"``: a transformers model's own tensor-parallel plan as torch styles.

transformers models carry their plan in ``config.base_model_tp_plan``: module-name
patterns relative to the base model (``layers.*.self_attn.q_proj``) mapped to style
names. :func:`resolve` prefixes the base model's name in the full model (``model.``) and
maps each name to the torch ``ParallelStyle`` that does the same:

=========================================  =================================================
transformers style                          torch ``ParallelStyle``
=========================================  =================================================
``colwise``                                 ``ColwiseParallel()``
``rowwise``                                 ``RowwiseParallel()``
``colwise_rep``, ``colwise_gather_output``  ``ColwiseParallel(output_layouts=Replicate())``
``rowwise_rep``, ``rowwise_split_input``    ``RowwiseParallel(input_layouts=Replicate())``
``embedding_rowwise``                       ``RowwiseParallel(input_layouts=Replicate())``
``embedding_colwise``                       ``ColwiseParallel(output_layouts=Replicate())``
``replicated_with_grad_allreduce``          ``SequenceParallel(sequence_dim=0,
                                            use_local_output=True)`` (see below)
``replicate``                               (left out: nothing to shard)
=========================================  =================================================

``replicated_with_grad_allreduce`` marks a module with replicated parameters that runs on
this rank's slice of its input, so that each rank's gradient is a part of the whole: Qwen3's
per-head ``q_norm`` / ``k_norm`` on the local heads. torch's ``SequenceParallel`` does that
(parameters replicated DTensors, their gradients summed over tp) whichever dimension it
calls sharded, as long as it is not the one the module normalizes: dimension 0.

Entries for expert collections and what is inside them (``moe_tp_experts``,
``packed_colwise`` on their 3-D weights, ``ep_router``, ...) are left out: experts are
sharded by expert parallelism (``conveyor.init(ep=...)``), not by ``tp_plan``. Any other
style name has no torch equivalent and is a ``ConfigError``.

``sequence_parallel`` (transformers' ``SequenceParallel(use_local_output=True)``, which no
transformers model's plan uses) is a ``ConfigError`` too: it takes the module's input as
this rank's slice of the sequence, but transformers' ``colwise`` / ``rowwise`` neighbours
pass the whole sequence, so on a norm between them every rank would count every token
and the parameters' gradients would come out tp times too large.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from conveyor.errors import ConfigError
from conveyor.partition.experts import is_experts_collection

EXPERT_STYLES = ("moe_tp_experts", "moe_identity_expert", "packed_colwise", "packed_rowwise",
                 "grouped_gemm", "ep_router", "ep_dispatch_experts")  # fmt: skip
"""transformers styles that shard experts (left to expert parallelism)."""


def _styles() -> dict[str, Callable[[], Any]]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    def colwise_rep() -> Any:
        return ColwiseParallel(output_layouts=Replicate())

    def rowwise_rep() -> Any:
        return RowwiseParallel(input_layouts=Replicate())

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_rep": colwise_rep,
        "colwise_gather_output": colwise_rep,
        "rowwise_rep": rowwise_rep,
        "rowwise_split_input": rowwise_rep,
        "embedding_rowwise": rowwise_rep,  # torch's default would gather the ids as shards
        "embedding_colwise": colwise_rep,
        "replicated_with_grad_allreduce": lambda: SequenceParallel(
            sequence_dim=0, use_local_output=True
        ),
    }


def resolve(tp_plan: Mapping[str, Any] | str | None, model: Any) -> Mapping[str, Any] | None:
    """``tp_plan`` as ``{module-name pattern: ParallelStyle}``: ``"auto"`` becomes the
    model's own plan (see the module doc), anything else is returned as it is.

    Raises:
        ConfigError: ``"auto"`` for a model without ``config.base_model_tp_plan``, a
            style name with no torch equivalent, or ``sequence_parallel``.
    """
    if not isinstance(tp_plan, str):
        return tp_plan
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not plan or not isinstance(model, nn.Module):
        raise ConfigError(
            f"tp_plan='auto' reads the model's config.base_model_tp_plan, which "
            f"{type(model).__name__} does not have; pass tp_plan as a dict of module-name "
            f"patterns to torch ParallelStyles"
        )
    base = getattr(model, "base_model", model)
    prefix = next((n for n, m in model.named_modules() if m is base), "")
    modules = {n for n, _ in model.named_modules()}
    names = [*modules, *(n for n, _ in model.named_parameters())]
    experts = [n for n, m in model.named_modules() if n and is_experts_collection(m)]
    styles = _styles()
    out: dict[str, Any] = {}
    for pattern, style in plan.items():
        full = f"{prefix}.{pattern}" if prefix else pattern
        hits = [n for n in names if fnmatch.fnmatchcase(n, full)]
        if style in EXPERT_STYLES or style == "replicate" or not modules.intersection(hits):
            continue
        if any(h == e or h.startswith(e + ".") for h in hits for e in experts):
            continue  # inside an expert collection: experts stay under ep
        if style == "sequence_parallel":
            raise ConfigError(
                f"tp_plan='auto': {type(model).__name__}'s plan gives {pattern!r} the "
                f"transformers style 'sequence_parallel', whose input transformers' "
                f"colwise/rowwise neighbours pass whole, so its gradients would count every "
                f"token tp times; in config.base_model_tp_plan give it "
                f"'replicated_with_grad_allreduce' if it runs on this rank's slice of a "
                f"split tensor, else leave it out"
            )
        if style not in styles:
            raise ConfigError(
                f"tp_plan='auto': {type(model).__name__}'s plan gives {pattern!r} the "
                f"transformers style {style!r}, which has no torch ParallelStyle "
                f"equivalent; pass tp_plan as a dict of torch ParallelStyles instead"
            )
        out[full] = styles[style]()
    return out
