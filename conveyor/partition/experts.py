"""Which modules are expert collections: the modules a ``torch.export`` capture keeps whole.

An expert collection follows transformers (>= 5)'s experts interface: one module holding
every expert of a mixture-of-experts layer as parameters whose first dimension is the
expert (``gate_up_proj: [num_experts, 2 * intermediate, hidden]``,
``down_proj: [num_experts, hidden, intermediate]``, biases ``[num_experts, out]``), with an
int ``num_experts``, called as ``experts(hidden_states, top_k_index, top_k_weights)``.
:mod:`conveyor.experts` shards them over the expert-parallel ranks, which needs them to
run as modules: a ``torch.export`` capture keeps them whole, one ``call_module`` node each
(:mod:`conveyor.partition.kept`), instead of the ATen operations inside.
"""

from __future__ import annotations

import inspect

from torch import nn

CALL = ("hidden_states", "top_k_index", "top_k_weights")
"""The experts interface's arguments, in order."""


def num_experts(module: nn.Module) -> int | None:
    """The number of experts of ``module`` if it is an expert collection, else None.

    Args:
        module: Any module.

    Returns:
        Its ``num_experts`` when it has that int attribute, its own parameters all have
        at least 2 dimensions with the first of size ``num_experts``, and its forward
        takes ``(hidden_states, top_k_index, top_k_weights)``; otherwise None.
    """
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        return None
    own = list(module.parameters(recurse=False))
    if not own or any(p.dim() < 2 or p.shape[0] != count for p in own):
        return None
    return count if _takes_routing(module) else None


def is_experts_collection(module: nn.Module) -> bool:
    """Whether ``module`` is an expert collection (see :func:`num_experts`)."""
    return num_experts(module) is not None


def _takes_routing(module: nn.Module) -> bool:
    """Whether the module's forward is called as ``(hidden_states, top_k_index,
    top_k_weights)`` (transformers' decorators keep the signature with ``wraps``)."""
    forward = getattr(type(module), "_conveyor_base_forward", type(module).forward)
    try:
        params = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return False
    return tuple(params[1:4]) == CALL
