"""Values every stage that needs them computes again rather than receives."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from conveyor.partition.captured import Captured

_PURE_WRAPPERS = ("wrap_with_set_grad_enabled", "wrap_with_autocast")


def replicable(cap: Captured) -> set[fx.Node]:
    """The values of a capture that are cheaper to make again than to send.

    Those are tensors made only from sizes, constants and buffers (an attention mask
    from the sequence length, rotary sines and cosines): no parameter, no gradient, no
    randomness, no in-place write. Only graphs captured with torch.export record what is
    a tensor, so an fx capture has none.

    Args:
        cap: The capture.

    Returns:
        The graph's nodes that make such values.
    """
    if not cap.exported:
        return set()
    out: set[fx.Node] = set()
    for n in cap.graph.nodes:
        tensors = [x for x in pytree.tree_leaves(n.meta.get("val")) if isinstance(x, torch.Tensor)]
        if (
            n.op == "call_function"
            and n.users
            and tensors
            and not any(t.requires_grad for t in tensors)
            and _pure(n.target)
            and all(_free_input(m, out, cap) for m in n.all_input_nodes)
        ):
            out.add(n)
    return out


def _pure(target: Any) -> bool:
    """An operation that writes nothing and draws no random numbers: an ATen operator, an
    item of a tuple, or a grad-mode / autocast region whose body is such operations."""
    if target is operator.getitem:
        return True
    schema = getattr(target, "_schema", None)
    if schema is not None:
        tags = getattr(target, "tags", ())
        return not schema.is_mutable and torch.Tag.nondeterministic_seeded not in tags
    return getattr(target, "__name__", "") in _PURE_WRAPPERS


def _free_input(node: fx.Node, done: set[fx.Node], cap: Captured) -> bool:
    """An input a replicated value may read: another one, a buffer, a constant, a region's
    body, a size."""
    if node in done:
        return True
    if node.op == "get_attr":
        value = cap.attr(cap.holder, str(node.target))
        if isinstance(value, fx.GraphModule):  # the body of a grad-mode / autocast region
            return all(
                b.op == "call_function" and _pure(b.target)
                for b in value.graph.nodes
                if b.op not in ("placeholder", "output")
            )
        return not isinstance(value, nn.Parameter)
    value = node.meta.get("val")
    return node.op != "placeholder" and not any(
        isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value)
    )
