"""Which modules are expert collections: the modules a ``torch.export`` capture keeps whole.

An expert collection follows transformers (>= 5)'s experts interface: one module holding
every expert of a mixture-of-experts layer as parameters whose first dimension is the
expert (``gate_up_proj: [num_experts, 2 * intermediate, hidden]``,
``down_proj: [num_experts, hidden, intermediate]``, biases ``[num_experts, out]``), with an
int ``num_experts``, called as ``experts(hidden_states, top_k_index, top_k_weights)``.
:mod:`conveyor.experts` shards them over the expert-parallel ranks, which needs them to
run as modules: :func:`conveyor.partition.export.capture_export` records each call as one
``call_module`` node instead of the ATen operations inside.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import fx, nn

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


@torch.library.custom_op("conveyor::experts_call", mutates_args=())
def _experts_call(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, which: int
) -> torch.Tensor:
    raise RuntimeError(  # only ever traced: kept_whole turns it into a call of the module
        "conveyor::experts_call stands for an expert collection's call while torch.export "
        "records the model; it is never run"
    )


@_experts_call.register_fake
def _experts_call_fake(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, which: int
) -> torch.Tensor:
    return hidden_states.new_empty(hidden_states.shape)


@contextlib.contextmanager
def recorded_as_calls(model: nn.Module) -> Iterator[list[str]]:
    """While ``torch.export`` records ``model``, each expert collection's call is one
    opaque ``conveyor::experts_call`` op (its ``which`` indexes the yielded names);
    :func:`as_module_calls` turns those into ``call_module`` nodes afterwards."""
    found = [(n, m) for n, m in model.named_modules() if n and is_experts_collection(m)]
    names = [n for n, m in found if not any(n.startswith(o + ".") for o, _ in found)]
    patched = []
    for which, name in enumerate(names):
        module = model.get_submodule(name)

        def call(
            hidden_states: torch.Tensor,
            top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor,
            which: int = which,
        ) -> torch.Tensor:
            out: torch.Tensor = torch.ops.conveyor.experts_call(
                hidden_states, top_k_index, top_k_weights, which
            )
            return out

        module.forward = call
        patched.append(module)
    try:
        yield names
    finally:
        for module in patched:
            del module.forward


def as_module_calls(graph: fx.Graph, names: list[str]) -> None:
    """Each ``conveyor::experts_call`` node of ``graph`` becomes a ``call_module`` of the
    collection it stands for, keeping the node's metadata (its module path: its stage)."""
    op = torch.ops.conveyor.experts_call.default
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not op:
            continue
        hidden, index, weights, which = node.args
        with graph.inserting_before(node):
            call = graph.call_module(names[int(which)], (hidden, index, weights))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
