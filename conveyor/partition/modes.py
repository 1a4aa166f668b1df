"""Dropout and batch norm in an exported graph follow their module's ``training`` flag at
run time, as they do in the unsplit model.

export writes what the model's mode meant at capture into the graph as constants: the
``train`` / ``training`` flag of dropout and batch norm, and attention's ``dropout_p``
(``p if self.training else 0.0`` in the model's code). :func:`follow_module_modes`
replaces each with a run-time read of the module that ran the operation.
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from conveyor.partition.captured import module_path

MODES = "_conveyor_modes"  # the graph attribute holding path -> ModeSource


class ModeSource:
    """Points at a module without registering it (its parameters stay where they are).

    Args:
        module: The module whose ``training`` flag is read.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __repr__(self) -> str:
        return f"ModeSource({type(self.module).__name__})"


def training_mode(sources: dict[str, ModeSource], path: str, captured: bool) -> bool:
    """Whether the module at ``path`` is in training mode, read when the graph runs.

    Args:
        sources: The graph's modules by path.
        path: The module that ran the operation.
        captured: The flag export recorded (kept in the graph for reading it).

    Returns:
        The module's ``training`` flag now.
    """
    return bool(sources[path].module.training)


def dropout_rate(sources: dict[str, ModeSource], path: str, rate: float) -> float:
    """The dropout rate for the module at ``path``, read when the graph runs.

    Args:
        sources: The graph's modules by path.
        path: The module that ran the operation.
        rate: The rate captured in training mode.

    Returns:
        ``rate`` in training mode, 0 in evaluation mode.
    """
    return float(rate) if sources[path].module.training else 0.0


def follow_module_modes(gm: fx.GraphModule, model: nn.Module) -> None:
    """Make the mode-dependent constants of an exported graph read their module's mode.

    Args:
        gm: The exported graph module; its graph is edited in place and it gets the
            :data:`MODES` table.
        model: The exported model, whose modules the graph reads.
    """
    modules = dict(model.named_modules())
    sources: dict[str, ModeSource] = {}
    gm.__dict__[MODES] = sources  # before the graph reads it
    graph = gm.graph
    for node in list(graph.nodes):
        schema = getattr(node.target, "_schema", None)
        path = module_path(node)
        if node.op != "call_function" or schema is None or path not in modules:
            continue
        for position, argument in enumerate(schema.arguments):
            if argument.name in ("train", "training"):
                read: Any = training_mode
            elif argument.name == "dropout_p":
                read = dropout_rate
            else:
                continue
            given = (
                node.args[position]
                if position < len(node.args)
                else node.kwargs.get(
                    argument.name, argument.default_value if argument.has_default_value() else None
                )
            )
            if isinstance(given, fx.Node) or given is None:
                continue
            if read is dropout_rate and not given:
                continue  # no dropout at capture: the code may still ask for some in training
            sources.setdefault(path, ModeSource(modules[path]))
            with graph.inserting_before(node):
                table = graph.create_node("get_attr", MODES)
                mode = graph.call_function(read, (table, path, given))
            for made in (table, mode):
                made.meta = {"nn_module_stack": node.meta.get("nn_module_stack", {})}
            if position < len(node.args):
                args = list(node.args)
                args[position] = mode
                node.args = tuple(args)
            else:
                node.kwargs = {**node.kwargs, argument.name: mode}
