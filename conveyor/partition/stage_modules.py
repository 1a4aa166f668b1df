"""Stage modules from a captured graph and the stage of each of its nodes.

Each stage becomes a ``GraphModule`` of its nodes (the rules are in
:mod:`conveyor.partition.graph`). Parameters and buffers are the model's own objects under
their original names; those no stage reads go to one stage, so a checkpoint loses
nothing.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from conveyor.partition.annotations import owner, stage_marks
from conveyor.partition.captured import COMPUTE_OPS, Captured
from conveyor.partition.describe import COPIED, SENDS, value_label
from conveyor.partition.exported_io import flatten_inputs, rebuild_output
from conveyor.partition.methods import METHOD
from conveyor.partition.replicate import replicable
from conveyor.partition.tree import install

INPUTS = "_conveyor_inputs"  # stage 0's attribute holding the InputLayout
OUTPUT_SPEC = "_conveyor_output_spec"  # the last stage's attribute holding the output spec


def build_stages(
    cap: Captured, model: nn.Module, where: dict[fx.Node, int], stages: int
) -> list[nn.Module]:
    """One ``GraphModule`` per stage.

    Args:
        cap: The model's capture.
        model: The captured model, whose parameters, buffers and modules the stages hold.
        where: The stage of every node that is not replicated
            (:func:`~conveyor.partition.assign.node_stages`).
        stages: How many stages to make.

    Returns:
        The stage modules, in order.
    """
    graph = cap.graph
    last = stages - 1
    copied = replicable(cap)
    uses = _uses(graph, where, copied)
    persistent = set(model.state_dict(keep_vars=True))
    out: list[nn.Module] = []
    carried: list[fx.Node] = []  # the values stage s - 1 returns, in order
    for s in range(stages):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        extra: dict[str, Any] = {}  # attributes of the stage that are not the model's
        if s == 0:
            _inputs(g, graph, env, cap, extra)
        else:
            inputs = g.placeholder("inputs")
            for i, n in enumerate(carried):
                env[n] = g.call_function(operator.getitem, (inputs, i))
        for n in graph.nodes:
            if n.op == "get_attr":
                if s in uses[n]:
                    env[n] = g.node_copy(n)
            elif n in copied:
                if s in uses[n]:
                    env[n] = g.node_copy(n, env.__getitem__)
                    env[n].meta[COPIED] = True
            elif n.op in COMPUTE_OPS and where[n] == s:
                env[n] = g.node_copy(n, env.__getitem__)
            elif n.op == "output" and s == last:
                _output(g, n, env, cap.output_spec, extra)
        if s < last:
            carried = [
                n
                for n in graph.nodes
                if n in env
                and n.op != "get_attr"
                and n not in copied
                and max(uses[n], default=-1) > s
            ]
            g.output(tuple(env[n] for n in carried))
        gm = _stage_module(g, cap, model, extra, f"{type(model).__name__}Stage{s}")
        if s < last:
            gm.meta[SENDS] = [value_label(n) for n in carried if _maybe_tensor(n)]
        _mark_non_persistent(gm, g, persistent)
        out.append(gm)
    _attach_unused(model, out, persistent)
    return out


def _uses(
    graph: fx.Graph, where: dict[fx.Node, int], copied: set[fx.Node]
) -> dict[fx.Node, set[int]]:
    """The stages that use each node; a replicated value is made in each of them."""
    uses: dict[fx.Node, set[int]] = {}
    for n in reversed(graph.nodes):
        here: set[int] = set()
        for u in n.users:
            here |= uses[u] if u in copied else {where[u]}
        uses[n] = here
    return uses


def _inputs(
    g: fx.Graph,
    graph: fx.Graph,
    env: dict[fx.Node, fx.Node],
    cap: Captured,
    extra: dict[str, Any],
) -> None:
    """Stage 0's placeholders: the model's own (fx), or ``*args, **kwargs`` flattened the
    way the capture sample was (export)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if cap.inputs is None:
        for n in placeholders:
            env[n] = g.node_copy(n)
        return
    args, kwargs = g.placeholder("*args"), g.placeholder("**kwargs")
    extra[INPUTS] = cap.inputs
    flat = g.call_function(flatten_inputs, (g.get_attr(INPUTS), args, kwargs))
    for i, n in enumerate(placeholders):
        env[n] = g.call_function(operator.getitem, (flat, i))


def _output(
    g: fx.Graph,
    node: fx.Node,
    env: dict[fx.Node, fx.Node],
    spec: pytree.TreeSpec | None,
    extra: dict[str, Any],
) -> None:
    """The last stage's output: as captured (fx), or the model's own output type rebuilt
    from export's flat outputs."""
    if spec is None:
        g.node_copy(node, env.__getitem__)
        return
    flat = fx.map_arg(node.args[0], env.__getitem__)
    extra[OUTPUT_SPEC] = spec
    g.output(g.call_function(rebuild_output, (g.get_attr(OUTPUT_SPEC), flat)))


def _stage_module(
    g: fx.Graph, cap: Captured, model: nn.Module, extra: dict[str, Any], name: str
) -> fx.GraphModule:
    """A ``GraphModule`` running ``g``, holding what it reads under the model's names."""
    root = nn.Module()
    for target, value in extra.items():
        install(root, target, value)
    for n in g.nodes:
        if n.op in ("call_module", "get_attr") and str(n.target) not in extra:
            install(root, str(n.target), cap.attr(model, str(n.target)))
    gm = fx.GraphModule(root, g, class_name=name)
    gm.meta[METHOD] = "export" if cap.exported else "fx"
    return gm


def _maybe_tensor(node: fx.Node) -> bool:
    """False for values the capture knows are not tensors (sizes, flags)."""
    value = node.meta.get("val")
    return value is None or any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value))


def _mark_non_persistent(gm: nn.Module, graph: fx.Graph, persistent: set[str]) -> None:
    """Tensors read by name that are not in the model's state_dict stay out of the stage's."""
    for n in graph.nodes:
        if n.op == "get_attr" and str(n.target) not in persistent:
            *prefix, field = str(n.target).split(".")
            holder = gm.get_submodule(".".join(prefix))
            if field in holder._buffers:
                holder._non_persistent_buffers_set.add(field)


def _attach_unused(model: nn.Module, stages: list[nn.Module], persistent: set[str]) -> None:
    """Parameters and saved buffers no stage reads go to the stage their annotation names,
    else stage 0, under their original names: nothing is dropped from a checkpoint."""
    held = {id(t) for st in stages for t in (*st.parameters(), *st.buffers())}
    marks = stage_marks(model)
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in named:
        if id(tensor) in held or (name not in persistent and not isinstance(tensor, nn.Parameter)):
            continue
        where = owner(name.rpartition(".")[0], marks)
        stage = marks[where] if where is not None and marks[where] < len(stages) else 0
        install(stages[stage], name, tensor)
        held.add(id(tensor))
