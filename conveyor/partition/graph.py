"""Split any ``torch.fx``-traceable model into stages along its data flow.

The model is traced with the default leaves (``torch.nn`` modules stay whole). Every node
gets a stage (:func:`conveyor.partition.annotations.assign_stages`), then each stage becomes
a ``GraphModule`` of its nodes:

- stage 0 takes the model's own arguments; stage s > 0 takes one argument, the tuple stage
  s - 1 returned, and unpacks it;
- a non-last stage returns a tuple of every value a later stage needs, in graph order:
  tensors, pytrees of them, and non-tensor values (``x.size(1)``) as they are. A value used
  two stages later is relayed through the stages between, so each stage talks only to the
  next and gradients flow back along every tensor;
- parameter and buffer reads (``get_attr``) are repeated in every stage that uses them rather
  than sent, so a weight used on two stages (a tied embedding and head) is the same
  ``Parameter`` in both: :func:`shared_parameters` finds it.

Limits (those of ``torch.fx``): Python branches on ``self.training`` or on shapes are fixed
at trace time, so split in the mode you train in; forward hooks run only on leaf modules.

We build the stage graphs ourselves rather than with ``torch.fx.passes.split_module``: its
submodules take one positional argument per value and live under ``submod_i.`` prefixes,
while the pipeline needs one-argument stages that relay skips and keep original names.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from conveyor.errors import ConfigError
from conveyor.partition.annotations import Item, assign_stages, owner, stage_marks
from conveyor.partition.balance import balance as min_max_balance

_COMPUTE = ("call_module", "call_function", "call_method")


def trace(model: nn.Module) -> tuple[fx.Graph, dict[str, Any]]:
    """The model's fx graph and the tensor constants it reads; a clear error when it
    cannot be traced."""
    before = set(vars(model))
    tracer = fx.Tracer()
    # Buffers become graph reads too (so ``self.mask[:t]`` with a traced t works).
    tracer.proxy_buffer_attributes = True
    try:
        graph = tracer.trace(model)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"torch.fx cannot trace {type(model).__name__} ({first}), so conveyor cannot "
            f"split it as a graph; pass an nn.Sequential or a list of layers, or an "
            f"execution sequence: conveyor.sequence(model, ['embed', 'blocks.0', ...])"
        ) from e
    finally:
        # The tracer parks literal tensors on the model as _tensor_constant<i>; take them.
        constants = {name: vars(model)[name] for name in set(vars(model)) - before}
        for name in constants:
            delattr(model, name)
    return graph, constants


def _path(node: fx.Node) -> str:
    """The qualified name of the module a node runs in ('' at the top level)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    return str(next(reversed(stack.values()))[0]) if stack else ""


def _describe(node: fx.Node) -> str:
    """How error messages name a node: its module, else the operation."""
    path = _path(node)
    return f"model.{path}" if path else f"the operation {node.name} ({node.op} {node.target})"


def _attr(model: nn.Module, target: str, constants: dict[str, Any]) -> Any:
    if target in constants:
        return constants[target]
    *prefix, field = target.split(".")
    return getattr(model.get_submodule(".".join(prefix)), field)


def _parameters_read(node: fx.Node, model: nn.Module, constants: dict[str, Any]) -> list[Any]:
    """The parameters a node uses: a leaf module's, or those an operation reads by name."""
    if node.op == "call_module":
        return list(model.get_submodule(str(node.target)).parameters())
    values = [
        _attr(model, str(m.target), constants) for m in node.all_input_nodes if m.op == "get_attr"
    ]
    return [v for v in values if isinstance(v, nn.Parameter)]


def layers(graph: fx.Graph, model: nn.Module, constants: dict[str, Any]) -> list[fx.Node]:
    """What ``balance`` counts in a traced model: leaf-module calls and operations that read
    a parameter directly (``F.linear(x, self.w)``), in execution order. Other operations
    follow their data."""
    return [
        n
        for n in graph.nodes
        if n.op == "call_module" or (n.op in _COMPUTE and _parameters_read(n, model, constants))
    ]


def node_stages(
    graph: fx.Graph,
    model: nn.Module,
    constants: dict[str, Any],
    stages: int,
    balance: Sequence[int] | None = None,
) -> dict[fx.Node, int]:
    """The stage of every placeholder, compute and output node.

    With annotations on the model: their stages, others following their data. Without:
    the :func:`layers` cut into contiguous runs, ``balance`` layers per stage or, when None,
    the exact min-max split of their parameter counts; others follow their data.
    """
    nodes = [n for n in graph.nodes if n.op != "get_attr"]
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
            where = owner(_path(n), marks)
            if where is not None:
                explicit[n] = (marks[where], f"model.{where}")
    else:
        run = layers(graph, model, constants)
        if balance is None:
            costs = [sum(p.numel() for p in _parameters_read(n, model, constants)) for n in run]
            sizes = min_max_balance(costs, stages)
        else:
            sizes = _checked_balance(balance, stages, len(run))
        bounds = [s for s, size in enumerate(sizes) for _ in range(size)]
        explicit = {n: (s, _describe(n)) for n, s in zip(run, bounds, strict=True)}
    items = [
        Item(
            name=_describe(n),
            inputs=tuple(index[m] for m in n.all_input_nodes if m in index),
            stage={"placeholder": 0, "output": stages - 1}.get(n.op, explicit.get(n, (None,))[0]),
            owner=explicit.get(n, (None, ""))[1],
            counts=n.op in _COMPUTE,
        )
        for n in nodes
    ]
    return dict(zip(nodes, assign_stages(items, stages), strict=True))


def _checked_balance(balance: Sequence[int], stages: int, count: int) -> list[int]:
    sizes = [int(b) for b in balance]
    if len(sizes) != stages or min(sizes, default=0) < 1 or sum(sizes) != count:
        raise ConfigError(
            f"balance {list(balance)} does not fit: the pipeline has {stages} stages and the "
            f"traced model has {count} layers (leaf-module calls and operations that read a "
            f"parameter); give {stages} counts >= 1 that add up to {count}"
        )
    return sizes


def split_graph(
    model: nn.Module, stages: int, balance: Sequence[int] | None = None
) -> list[nn.Module]:
    """Stage modules of an fx-traceable model, by annotations or balanced (see module doc)."""
    graph, constants = trace(model)
    where = node_stages(graph, model, constants, stages, balance)
    last = stages - 1
    persistent = set(model.state_dict(keep_vars=True))
    out: list[nn.Module] = []
    carried: list[fx.Node] = []  # the values stage s - 1 returns, in order
    for s in range(stages):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        if s == 0:
            for n in graph.nodes:
                if n.op == "placeholder":
                    env[n] = g.node_copy(n)
        else:
            inputs = g.placeholder("inputs")
            for i, n in enumerate(carried):
                env[n] = g.call_function(operator.getitem, (inputs, i))
        for n in graph.nodes:
            if n.op == "get_attr" and any(where[u] == s for u in n.users):
                env[n] = g.node_copy(n)
            elif n.op in _COMPUTE and where[n] == s:
                env[n] = g.node_copy(n, env.__getitem__)
            elif n.op == "output" and s == last:
                g.node_copy(n, env.__getitem__)
        if s < last:
            carried = [
                n
                for n in graph.nodes
                if n in env
                and n.op != "get_attr"
                and max((where[u] for u in n.users), default=-1) > s
            ]
            g.output(tuple(env[n] for n in carried))
        root = nn.Module()
        for n in g.nodes:
            if n.op in ("call_module", "get_attr"):
                install(root, str(n.target), _attr(model, str(n.target), constants))
        gm = fx.GraphModule(root, g, class_name=f"{type(model).__name__}Stage{s}")
        _mark_non_persistent(gm, g, persistent)
        out.append(gm)
    _attach_unused(model, out, persistent)
    return out


def install(root: nn.Module, target: str, value: Any) -> None:
    """Put ``value`` at ``target`` under ``root``, creating empty containers on the way."""
    *prefix, field = target.split(".")
    holder = root
    for part in prefix:
        child = holder._modules.get(part)
        if child is None:
            child = nn.Module()
            holder.add_module(part, child)
        holder = child
    if getattr(holder, field, None) is value:
        return
    if isinstance(value, nn.Module):
        # Replaces a container made earlier for a deeper target: the real module holds it.
        holder._modules[field] = value
    elif isinstance(value, nn.Parameter):
        holder.register_parameter(field, value)
    elif isinstance(value, torch.Tensor):
        holder.register_buffer(field, value)
    else:
        setattr(holder, field, value)


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
