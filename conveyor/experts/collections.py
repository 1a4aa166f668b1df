"""Which modules of a model are expert collections.

An expert collection follows transformers (>= 5)'s experts interface: one module holding
every expert of a mixture-of-experts layer as parameters whose first dimension is the
expert (``gate_up_proj: [num_experts, 2 * intermediate, hidden]``,
``down_proj: [num_experts, hidden, intermediate]``, biases ``[num_experts, out]``), with an
int ``num_experts``, called as ``experts(hidden_states, top_k_index, top_k_weights)``:
``hidden_states`` ``[tokens, hidden]``, ``top_k_index`` ``[tokens, k]`` (the experts each
token is routed to) and ``top_k_weights`` ``[tokens, k]`` (their routing weights), returning
``[tokens, hidden]``: the weighted sum of each token's experts' outputs. Mixtral, Qwen2/3-MoE,
OLMoE, DeepSeek-V2/V3 and most other transformers MoE models have one such module per
MoE layer (``model.layers.N.mlp.experts``); their shared experts, where they have them, are
ordinary MLPs and stay replicated.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from torch import nn

from conveyor.errors import ConfigError
from conveyor.partition.experts import is_experts_collection, num_experts

__all__ = ["check_plan", "find_experts", "is_experts_collection", "num_experts"]


def check_plan(ep_plan: object) -> None:
    """Check that ``ep_plan`` is None or a list of module-name patterns.

    Raises:
        ConfigError: another value, in one sentence.
    """
    if ep_plan is None:
        return
    if not isinstance(ep_plan, (list, tuple)) or not all(isinstance(p, str) for p in ep_plan):
        raise ConfigError(
            f"ep_plan must be a list of module-name patterns, got {ep_plan!r}; pass e.g. "
            f"ep_plan=['model.layers.*.mlp.experts'], or None for every experts module"
        )


def find_experts(
    named: Iterable[tuple[str, nn.Module]], ep_plan: Sequence[str] | None = None
) -> list[tuple[str, nn.Module]]:
    """The expert collections among ``named`` modules.

    Args:
        named: ``(name, module)`` pairs, e.g. ``model.named_modules()``.
        ep_plan: fnmatch patterns over the names, e.g. ``["model.layers.*.mlp.experts"]``;
            None: every expert collection.

    Returns:
        The matching ``(name, module)`` pairs in the given order; modules nested in a
        chosen one are not listed again.

    Raises:
        ConfigError: a pattern that matches no module, or that matches a module that is
            not an expert collection (one sentence naming it).
    """
    modules = [(name, m) for name, m in named if name]
    if ep_plan is None:
        return _outermost([(n, m) for n, m in modules if is_experts_collection(m)])
    check_plan(ep_plan)
    chosen: list[tuple[str, nn.Module]] = []
    for pattern in ep_plan:
        hits = [(n, m) for n, m in modules if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ConfigError(
                f"ep_plan pattern {pattern!r} matches no module of the model; patterns match "
                f"module names as in model.named_modules(), e.g. 'model.layers.*.mlp.experts'"
            )
        for name, module in hits:
            if not is_experts_collection(module):
                raise ConfigError(
                    f"ep_plan pattern {pattern!r} matches model.{name} "
                    f"({type(module).__name__}), which is not an expert collection (3-D "
                    f"parameters [num_experts, ...], an int num_experts, called as "
                    f"experts(hidden_states, top_k_index, top_k_weights)); name the experts "
                    f"module itself, e.g. '{name}.experts'"
                )
            if all(m is not module for _, m in chosen):
                chosen.append((name, module))
    return chosen


def _outermost(found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``found`` without the modules nested inside another one of them."""
    names = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(n.startswith(o + ".") for o in names)]
