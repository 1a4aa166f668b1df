"""The layers of a captured graph: what ``balance=`` counts, where automatic cuts go, and
what a cut between two of them costs.

A layer is a leaf-module call (under export, the run of operations one leaf module made)
or an operation that reads a parameter directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from conveyor.partition.captured import COMPUTE_OPS, Captured, module_path
from conveyor.partition.replicate import replicable

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass
class Layers:
    """The captured graph's layers, in execution order, and what a cut between them costs.

    Attributes:
        groups: ``groups[i]``, the nodes of layer i.
        paths: ``paths[i]``, the module layer i ran in.
        costs: ``costs[i]``, the parameters layer i reads.
        penalty: ``penalty[k]``, the modules a cut after layer k goes through.
        crossing: ``crossing[k]``, the bytes (values, where sizes are unknown) a cut after
            layer k sends.
    """

    groups: list[list[fx.Node]]
    paths: list[str]
    costs: list[float]
    penalty: list[float]
    crossing: list[float]


def layers(cap: Captured, model: nn.Module) -> Layers:
    """The layers of a captured model (see the module doc).

    Args:
        cap: The model's capture.
        model: The captured model.

    Returns:
        Its layers with their costs and the cost of each cut between them.
    """
    modules = dict(model.named_modules())
    leaves = {name for name, m in modules.items() if name and not any(True for _ in m.children())}
    groups: list[list[fx.Node]] = []
    paths: list[str] = []
    costs: list[float] = []
    reads: list[set[int]] = []

    def begin(path: str) -> None:
        groups.append([])
        paths.append(path)
        costs.append(0.0)
        reads.append(set())

    copied = replicable(cap)
    open_leaf: str | None = None  # the exported leaf module whose operations are grouped
    for n in cap.graph.nodes:
        if n.op not in COMPUTE_OPS or n in copied:
            open_leaf = open_leaf if n.op == "get_attr" or n in copied else None
            continue
        path = module_path(n)
        params = _parameters_read(n, model, cap)
        if cap.exported and path in leaves:
            if path != open_leaf:
                begin(path)
                open_leaf = path
        elif n.op == "call_module" or params:
            begin(path)
            open_leaf = None
        else:
            open_leaf = None
            continue
        groups[-1].append(n)
        for p in params:
            if id(p) not in reads[-1]:  # a weight read twice by one layer costs once
                reads[-1].add(id(p))
                costs[-1] += float(p.numel())
    penalty = _penalties(paths, modules)
    crossing = _crossing(cap.graph, groups, copied)
    return Layers(groups, paths, costs, penalty, crossing)


def _parameters_read(node: fx.Node, model: nn.Module, cap: Captured) -> list[nn.Parameter]:
    """The parameters a node uses: a leaf module's, or those an operation reads by name."""
    if node.op == "call_module":
        return list(model.get_submodule(str(node.target)).parameters())
    values = [cap.attr(model, str(m.target)) for m in node.all_input_nodes if m.op == "get_attr"]
    return [v for v in values if isinstance(v, nn.Parameter)]


def _penalties(paths: list[str], modules: dict[str, nn.Module]) -> list[float]:
    """Per cut point: the modules a cut there goes through (containers and the model
    itself excluded: cutting between the blocks of a ModuleList is free)."""
    n = len(paths)
    span: dict[str, list[int]] = {}
    for i, path in enumerate(paths):
        parts = path.split(".") if path else []
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            first_last = span.setdefault(prefix, [i, i])
            first_last[1] = i
    diff = [0.0] * (n + 1)
    for prefix, (first, last) in span.items():
        if isinstance(modules.get(prefix), _CONTAINERS) or first == last:
            continue
        diff[first] += 1.0  # cuts after first .. last - 1 go through it
        diff[last] -= 1.0
    return _running_sums(diff, n)


def _crossing(graph: fx.Graph, groups: list[list[fx.Node]], copied: set[fx.Node]) -> list[float]:
    """Per cut point: bytes of the values that would cross it (each tensor counts at
    least 1, so graphs without recorded sizes count values). Values in ``copied`` do not
    cross (each stage makes its own) but what they read must reach their last user."""
    n = len(groups)
    position: dict[fx.Node, int] = {}
    for i, group in enumerate(groups):
        for node in group:
            position[node] = i
    nodes = [m for m in graph.nodes if m.op != "get_attr" and m not in copied]
    for m in nodes:
        if m in position:
            continue
        if m.op == "placeholder":
            position[m] = -1
        elif m.op == "output":
            position[m] = n
        else:
            came = [position[a] for a in m.all_input_nodes if a in position]
            if came:
                position[m] = max(came)
    for m in reversed(graph.nodes):
        used = [position[u] for u in m.users if u in position]
        if m in copied:  # made again where needed: its inputs must reach the last user
            position[m] = max(used, default=0)
        elif m not in position and m.op != "get_attr":  # built from nothing: where first used
            position[m] = min(used, default=0)
    diff = [0.0] * (n + 1)
    for m in nodes:
        if m.op == "output":
            continue
        last = max((position[u] for u in m.users if u in position), default=position[m])
        lo, hi = max(position[m], 0), min(last, n)
        if hi > lo:
            size = _nbytes(m.meta.get("val"))
            diff[lo] += size
            diff[hi] -= size
    return _running_sums(diff, n)


def _running_sums(diff: list[float], n: int) -> list[float]:
    """The value at each of the ``n - 1`` cut points from its per-point changes."""
    out, running = [], 0.0
    for k in range(n - 1):
        running += diff[k]
        out.append(running)
    return out


def _nbytes(value: Any) -> float:
    """Bytes of the tensors in ``value``, each at least 1 (unknown sizes count as 1)."""
    total = 0.0
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            count = 1
            for size in leaf.shape:
                count *= size if isinstance(size, int) else _hint(size)
            total += max(1.0, float(count * leaf.element_size()))
    return total if total else 0.0


def _hint(size: Any) -> int:
    """The sample's value of a symbolic size, 1 where export recorded none."""
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else 1
