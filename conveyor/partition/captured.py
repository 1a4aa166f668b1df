"""What a capture hands the graph splitter: the graph, where its reads resolve, and how an
exported model's inputs and output are shaped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import fx, nn
from torch.utils import _pytree as pytree

COMPUTE_OPS = ("call_module", "call_function", "call_method")  # fx nodes that do work


@dataclass(frozen=True)
class InputLayout:
    """How stage 0 of an exported model turns ``(args, kwargs)`` into graph inputs.

    Attributes:
        spec: The pytree structure of the sample's ``(args, kwargs)``.
        fixed: Per flat input, the sizes export fixed (None where a dimension stays free),
            or None for a non-tensor input.
        names: Per flat input, its name in the graph.
        guards: export's check of the conditions its graph relies on, or None.
    """

    spec: pytree.TreeSpec
    fixed: tuple[tuple[int | None, ...] | None, ...]
    names: tuple[str, ...]
    guards: Any = None


@dataclass(frozen=True)
class Captured:
    """A model's forward as an fx graph, and where its attribute reads resolve.

    Attributes:
        graph: The forward's graph.
        holder: Resolves ``get_attr`` targets that are not the model's own (export's
            lifted constants).
        constants: Tensors fx found as literals, by the name the graph reads them under.
        exported: Whether torch.export (not fx) made the graph.
        inputs: For an exported model, how to flatten the call's arguments.
        output_spec: For an exported model, how to rebuild its output.
    """

    graph: fx.Graph
    holder: nn.Module
    constants: dict[str, Any]
    exported: bool
    inputs: InputLayout | None = None
    output_spec: pytree.TreeSpec | None = None

    def attr(self, model: nn.Module, target: str) -> Any:
        """The value a ``get_attr`` node reads: the model's own object where it has one.

        Args:
            model: The captured model.
            target: The node's dotted target.

        Returns:
            The constant, parameter, buffer, module or other attribute at ``target``.

        Raises:
            AttributeError: Neither the model nor ``holder`` has ``target``.
        """
        if target in self.constants:
            return self.constants[target]
        *prefix, field = target.split(".")
        for root in (model, self.holder):
            try:
                return getattr(root.get_submodule(".".join(prefix)), field)
            except AttributeError:
                continue
        raise AttributeError(f"the captured graph reads {target!r}, which the model lacks")


def module_path(node: fx.Node) -> str:
    """The qualified name of the module a node runs in.

    Args:
        node: A node of a captured graph.

    Returns:
        The module's dotted name, '' at the model's top level.
    """
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    return str(next(reversed(stack.values()))[0]) if stack else ""
