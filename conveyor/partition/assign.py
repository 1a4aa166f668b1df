"""The stage of every node of a captured graph.

A layer (:mod:`conveyor.partition.layers`) gets its stage from the annotations or from
the cut; any other node the latest stage among its inputs
(:func:`conveyor.partition.annotations.assign_stages`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx, nn

from conveyor.errors import ConfigError
from conveyor.partition.annotations import Item, assign_stages, owner, stage_marks
from conveyor.partition.captured import COMPUTE_OPS, Captured, module_path
from conveyor.partition.cuts import balance_cuts
from conveyor.partition.layers import layers
from conveyor.partition.replicate import replicable


def node_stages(
    cap: Captured,
    model: nn.Module,
    stages: int,
    balance: Sequence[int] | None = None,
    placement: Sequence[int] | None = None,
) -> dict[fx.Node, int]:
    """The stage of every placeholder, compute and output node that is not replicated.

    With annotations on the model: their stages, others following their data. Without:
    the :func:`~conveyor.partition.layers.layers` cut into contiguous runs, ``balance``
    layers per stage or, when None, by :func:`~conveyor.partition.cuts.balance_cuts`
    over parameter counts; others follow their data.

    Args:
        cap: The model's capture.
        model: The captured model.
        stages: How many stages to make.
        balance: Layers per stage, or None.
        placement: The rank of each stage, for an automatic cut.

    Returns:
        Node -> stage.

    Raises:
        ConfigError: Annotations and ``balance`` were both given, ``balance`` does not fit
            the layers, the model has fewer layers than stages, or the annotations break
            the stage order.
    """
    copied = replicable(cap)
    nodes = [n for n in cap.graph.nodes if n.op != "get_attr" and n not in copied]
    index = {n: i for i, n in enumerate(nodes)}
    explicit: dict[fx.Node, tuple[int, str]] = {}
    marks = stage_marks(model)
    if marks:
        if balance is not None:
            raise ConfigError(
                "the model has pipeline_stage annotations and a balance was given too; "
                "pass one of them (balance=None to use the annotations)"
            )
        for n in nodes:
            where = owner(module_path(n), marks)
            if where is not None:
                explicit[n] = (marks[where], f"model.{where}")
    else:
        found = layers(cap, model)
        count = len(found.groups)
        if balance is not None:
            sizes = _checked_balance(balance, stages, count)
        elif count < stages:
            raise ConfigError(
                f"the model has {count} layers (leaf-module calls and operations that read a "
                f"parameter) but the pipeline needs {stages} stages; use fewer ranks or chunks"
            )
        else:
            sizes = balance_cuts(
                found.costs, stages, found.penalty, found.crossing, placement=placement
            )
        bounds = [s for s, size in enumerate(sizes) for _ in range(size)]
        for group, s in zip(found.groups, bounds, strict=True):
            for n in group:
                explicit[n] = (s, _describe(n))
    items = [
        Item(
            name=_describe(n),
            inputs=tuple(index[m] for m in n.all_input_nodes if m in index),
            stage={"placeholder": 0, "output": stages - 1}.get(n.op, explicit.get(n, (None,))[0]),
            owner=explicit.get(n, (None, ""))[1],
            counts=n.op in COMPUTE_OPS,
        )
        for n in nodes
    ]
    return dict(zip(nodes, assign_stages(items, stages), strict=True))


def _checked_balance(balance: Sequence[int], stages: int, count: int) -> list[int]:
    """``balance`` as ints, when it has one count >= 1 per stage adding up to ``count``."""
    sizes = [int(b) for b in balance]
    if len(sizes) != stages or min(sizes, default=0) < 1 or sum(sizes) != count:
        raise ConfigError(
            f"balance {list(balance)} does not fit: the pipeline has {stages} stages and the "
            f"captured model has {count} layers (leaf-module calls and operations that read a "
            f"parameter); give {stages} counts >= 1 that add up to {count}"
        )
    return sizes


def _describe(node: fx.Node) -> str:
    """How error messages name a node: its module, else the operation."""
    path = module_path(node)
    return f"model.{path}" if path else f"the operation {node.name} ({node.op} {node.target})"
