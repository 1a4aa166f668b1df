"""Split any model that can be captured as a graph into stages along its data flow.

The model is captured by :mod:`conveyor.partition.capture` (``torch.fx``, or
``torch.export`` on a sample when fx cannot). The graph's *layers* are what ``balance=``
counts and where automatic cuts go: leaf-module calls (under export, the run of operations
one leaf module made) and operations that read a parameter directly. Every node gets a
stage (:func:`conveyor.partition.annotations.assign_stages`): a layer's from the
annotations or the cut, any other node the latest stage among its inputs. Then each stage
becomes a ``GraphModule`` of its nodes:

- stage 0 takes the model's own arguments; stage s > 0 takes one argument, the tuple stage
  s - 1 returned, and unpacks it;
- a non-last stage returns a tuple of every value a later stage needs, in graph order:
  tensors, pytrees of them, and non-tensor values (``x.size(1)``) as they are. A value used
  two stages later is relayed through the stages between, so each stage talks only to the
  next and gradients flow back along every tensor;
- parameter and buffer reads (``get_attr``) are repeated in every stage that uses them rather
  than sent, so a weight used on two stages (a tied embedding and head) is the same
  ``Parameter`` in both: :func:`shared_parameters` finds it;
- under export, stage 0 accepts the call as the model does (positional, keyword, nested)
  and the last stage returns the model's own output type (a ``ModelOutput``, a dict).

Without annotations or ``balance`` the cuts minimise the largest stage's parameter count
while preferring cuts that go through few modules (between the blocks of a
``ModuleList``/``Sequential`` rather than inside one) and send few bytes
(:func:`conveyor.partition.balance.balance_cuts`).

Limits (those of the capture): Python branches on ``self.training`` or on shapes are fixed
at capture, so split in the mode you train in (dropout and batch norm follow
``model.train()`` / ``model.eval()`` either way).

We build the stage graphs ourselves rather than with ``torch.fx.passes.split_module``: its
submodules take one positional argument per value and live under ``submod_i.`` prefixes,
while the pipeline needs one-argument stages that relay skips and keep original names.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from conveyor.errors import ConfigError
from conveyor.partition.annotations import Item, assign_stages, owner, stage_marks
from conveyor.partition.balance import balance_cuts
from conveyor.partition.capture import Captured, InputLayout, capture, check_inputs, module_path
from conveyor.partition.describe import COPIED, SENDS, value_label
from conveyor.partition.tree import install

_COMPUTE = ("call_module", "call_function", "call_method")
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
INPUTS = "_conveyor_inputs"
OUTPUT_SPEC = "_conveyor_output_spec"


@dataclass
class Layers:
    """The captured graph's layers, in execution order, and what a cut between them costs.

    ``groups[i]``: the nodes of layer i; ``paths[i]``: the module it ran in;
    ``costs[i]``: parameters it reads; ``penalty[k]`` / ``crossing[k]``: modules cut and
    bytes (values, where sizes are unknown) sent by a cut after layer k.
    """

    groups: list[list[fx.Node]]
    paths: list[str]
    costs: list[float]
    penalty: list[float]
    crossing: list[float]


def replicable(cap: Captured) -> set[fx.Node]:
    """Values every stage that needs them computes again rather than receives: tensors
    made only from sizes, constants and buffers (an attention mask from the sequence
    length, rotary sines and cosines), no parameter, no gradient, no randomness, no
    in-place write. Only graphs captured with torch.export record what is a tensor."""
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


_PURE_WRAPPERS = ("wrap_with_set_grad_enabled", "wrap_with_autocast")


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


def _maybe_tensor(node: fx.Node) -> bool:
    """False for values the capture knows are not tensors (sizes, flags)."""
    value = node.meta.get("val")
    return value is None or any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value))


def _describe(node: fx.Node) -> str:
    """How error messages name a node: its module, else the operation."""
    path = module_path(node)
    return f"model.{path}" if path else f"the operation {node.name} ({node.op} {node.target})"


def _parameters_read(node: fx.Node, model: nn.Module, cap: Captured) -> list[nn.Parameter]:
    """The parameters a node uses: a leaf module's, or those an operation reads by name."""
    if node.op == "call_module":
        return list(model.get_submodule(str(node.target)).parameters())
    values = [cap.attr(model, str(m.target)) for m in node.all_input_nodes if m.op == "get_attr"]
    return [v for v in values if isinstance(v, nn.Parameter)]


def layers(cap: Captured, model: nn.Module) -> Layers:
    """What ``balance`` counts in a captured model (see the module doc)."""
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
        if n.op not in _COMPUTE or n in copied:
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
    out, running = [], 0.0
    for k in range(n - 1):
        running += diff[k]
        out.append(running)
    return out


def _crossing(
    graph: fx.Graph, groups: list[list[fx.Node]], copied: set[fx.Node]
) -> list[float]:
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
    out, running = [], 0.0
    for k in range(n - 1):
        running += diff[k]
        out.append(running)
    return out


def _nbytes(value: Any) -> float:
    total = 0.0
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            count = 1
            for size in leaf.shape:
                count *= size if isinstance(size, int) else _hint(size)
            total += max(1.0, float(count * leaf.element_size()))
    return total if total else 0.0


def _hint(size: Any) -> int:
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else 1


def node_stages(
    cap: Captured,
    model: nn.Module,
    stages: int,
    balance: Sequence[int] | None = None,
    placement: Sequence[int] | None = None,
) -> dict[fx.Node, int]:
    """The stage of every placeholder, compute and output node.

    With annotations on the model: their stages, others following their data. Without:
    the :func:`layers` cut into contiguous runs, ``balance`` layers per stage or, when
    None, by :func:`~conveyor.partition.balance.balance_cuts` over parameter counts;
    others follow their data.
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
            f"captured model has {count} layers (leaf-module calls and operations that read a "
            f"parameter); give {stages} counts >= 1 that add up to {count}"
        )
    return sizes


def layer_count(model: nn.Module, sample: Any = None) -> int:
    """How many layers ``balance=`` counts for a model split as a graph."""
    return len(layers(capture(model, sample), model).groups)


def split_graph(
    model: nn.Module,
    stages: int,
    balance: Sequence[int] | None = None,
    sample: Any = None,
    placement: Sequence[int] | None = None,
) -> list[nn.Module]:
    """Stage modules of a capturable model, by annotations or balanced (see module doc).

    ``sample``: one micro-batch of the model's input, needed only when fx cannot trace the
    model and it is captured with torch.export.
    """
    cap = capture(model, sample)
    graph = cap.graph
    where = node_stages(cap, model, stages, balance, placement)
    last = stages - 1
    # Stages that use each node: a replicated value is made in each of them.
    uses: dict[fx.Node, set[int]] = {}
    copied = replicable(cap)
    for n in reversed(graph.nodes):
        here: set[int] = set()
        for u in n.users:
            here |= uses[u] if u in copied else {where[u]}
        uses[n] = here
    for n in copied:
        where[n] = -1  # in no stage by itself: see ``uses``
    persistent = set(model.state_dict(keep_vars=True))
    out: list[nn.Module] = []
    carried: list[fx.Node] = []  # the values stage s - 1 returns, in order
    for s in range(stages):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        extra: dict[str, Any] = {}
        if s == 0:
            _inputs(g, graph, env, cap.inputs, extra)
        else:
            inputs = g.placeholder("inputs")
            for i, n in enumerate(carried):
                env[n] = g.call_function(operator.getitem, (inputs, i))
        for n in graph.nodes:
            if n.op == "get_attr" and s in uses[n]:
                env[n] = g.node_copy(n)
            elif n.op in _COMPUTE and where[n] == s:
                env[n] = g.node_copy(n, env.__getitem__)
            elif n.op in _COMPUTE and n in copied and s in uses[n]:
                env[n] = g.node_copy(n, env.__getitem__)
                env[n].meta[COPIED] = True
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
            sends = [value_label(n) for n in carried if _maybe_tensor(n)]
        root = nn.Module()
        for name, value in extra.items():
            install(root, name, value)
        for n in g.nodes:
            if n.op in ("call_module", "get_attr") and str(n.target) not in extra:
                install(root, str(n.target), cap.attr(model, str(n.target)))
        gm = fx.GraphModule(root, g, class_name=f"{type(model).__name__}Stage{s}")
        if s < last:
            gm.meta[SENDS] = sends
        _mark_non_persistent(gm, g, persistent)
        out.append(gm)
    _attach_unused(model, out, persistent)
    return out


def _inputs(
    g: fx.Graph,
    graph: fx.Graph,
    env: dict[fx.Node, fx.Node],
    layout: InputLayout | None,
    extra: dict[str, Any],
) -> None:
    """Stage 0's placeholders: the model's own (fx), or ``*args, **kwargs`` flattened the
    way the capture sample was (export)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if layout is None:
        for n in placeholders:
            env[n] = g.node_copy(n)
        return
    args, kwargs = g.placeholder("*args"), g.placeholder("**kwargs")
    extra[INPUTS] = layout
    flat = g.call_function(flatten_inputs, (g.get_attr(INPUTS), args, kwargs))
    for i, n in enumerate(placeholders):
        env[n] = g.call_function(operator.getitem, (flat, i))


def flatten_inputs(layout: InputLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Stage 0 of an exported model: the call's arguments as the graph's flat inputs."""
    return check_inputs(layout, args, kwargs)


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


def rebuild_output(spec: pytree.TreeSpec, flat: Sequence[Any]) -> Any:
    """The model's output (``ModelOutput``, dict, tuple...) from its flat values."""
    return pytree.tree_unflatten(list(flat), spec)


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
