"""Backward split in two: B (input gradients, now) and W (weight gradients, later).

B runs autograd from the stage outputs to the stage inputs only, and captures the
gradient arriving at each *join*: a node on the input path where a parameter's branch
hangs off (for ``Linear``, its ``AddmmBackward``). W later runs autograd from those
captured gradients into the parameter branches alone, so nothing on the input path is
computed twice and B + W costs about one ordinary backward.

When a parameter's branch joins the input path at more than one place (a weight used
twice in one stage), replaying from each join would count the shared path twice; then
W falls back to a plain backward into the parameters (correct, just slower).

Compiled stages (``Pipeline(compile=...)``): a compiled region's backward is one node that
computes every gradient of the region at once, so a parameter whose join is such a node
gets its gradient in B, from that same call (replaying the node in W would run the whole
region's backward twice). Linear weights are not among them: their GEMMs stay outside the
compiled graphs (:mod:`conveyor.runtime.opaque_linear`) and hand (X, dY) to the store while
a ``collect`` block is open; B and W open it except where a replay would add twice.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from conveyor.runtime.deferred_linear import is_deferred

Collect = Callable[[bool], contextlib.AbstractContextManager[Any]]
"""``collect(True)`` keeps compiled linears' (X, dY) for W, ``collect(False)`` drops them."""


def _no_collect(keep: bool) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def is_compiled(node: Node) -> bool:
    """Whether ``node`` is the backward of a compiled region (AOTAutograd's)."""
    return type(node).__name__ == "CompiledFunctionBackward"


def _grad_node(t: torch.Tensor) -> Node | None:
    """The autograd node gradients of ``t`` flow into (its grad accumulator for leaves)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    # A leaf's accumulator is created lazily; a view's grad_fn points at it.
    view_fn = t.view_as(t).grad_fn
    assert view_fn is not None
    return view_fn.next_functions[0][0]


@dataclass
class WeightWork:
    """What W needs: captured join gradients and the parameters behind each join."""

    joins: list[tuple[Node, tuple[torch.Tensor | None, ...], list[torch.Tensor]]] = field(
        default_factory=list
    )
    # (outputs, output gradients, params) replayed from the stage outputs.
    from_outputs: (
        tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor]] | None
    ) = None
    collect: Collect = _no_collect

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad`` and drop everything held."""
        with self.collect(True):
            self._run()
        self.joins = []
        self.from_outputs = None

    def _run(self) -> None:
        for node, grads, params in self.joins:
            edges = [GradientEdge(node, k) for k, g in enumerate(grads) if g is not None]
            values = [g for g in grads if g is not None]
            if edges:
                torch.autograd.backward(edges, values, retain_graph=True, inputs=params)
        if self.from_outputs is not None:
            outs, out_grads, params = self.from_outputs
            torch.autograd.backward(outs, out_grads, retain_graph=True, inputs=params)


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Reverse edges of the graph below ``roots``: node -> nodes that feed it gradient."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    seen = set(roots)
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        # A deferred linear's weight and bias get their gradient from its store, not here.
        edges = node.next_functions[:1] if is_deferred(node) else node.next_functions
        for child, _ in edges:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return parents


def _upward(
    start: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node]
) -> tuple[set[Node], set[Node]]:
    """Nodes reachable upward from ``start`` without entering ``stop``, and the ``stop``
    nodes met on the way."""
    seen: set[Node] = set(start)
    met: set[Node] = set()
    queue = deque(start)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, met


def backward_input(
    outputs: list[torch.Tensor],
    grads: list[torch.Tensor] | None,
    inputs: list[torch.Tensor],
    params: list[torch.Tensor],
    collect: Collect = _no_collect,
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B: gradients of ``inputs``; returns them and the :class:`WeightWork` for W.

    ``collect``: the store's sink for compiled linears (module doc)."""
    work = WeightWork(collect=collect)
    if not outputs:
        return [None] * len(inputs), work
    wanted = [x for x in inputs if x.requires_grad]
    roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
    if not wanted:
        work.from_outputs = (outputs, grads, params)
        return [None] * len(inputs), work
    if not roots:  # every output is an input passed through unchanged
        got = torch.autograd.grad(outputs, wanted, grads, allow_unused=True)
        return _place(inputs, wanted, got), work
    parents = _parents(roots)
    input_nodes = [n for n in (_grad_node(x) for x in wanted) if n is not None]
    on_input_path, _ = _upward(input_nodes, parents, set())
    by_join: dict[Node, list[torch.Tensor]] = defaultdict(list)
    from_outputs: list[torch.Tensor] = []
    in_b: list[torch.Tensor] = []  # joined at a compiled node: computed by B's call
    shared = False
    for p in params:
        node = _grad_node(p)
        if node is None or node not in parents:
            continue  # unused by this stage's graph
        reached, joins = _upward([node], parents, on_input_path)
        if any(is_compiled(j) for j in joins):
            in_b.append(p)
            continue
        sources = len(joins) + (1 if any(r in reached for r in roots) else 0)
        if sources > 1:
            shared = True
            break
        if joins:
            by_join[joins.pop()].append(p)
        else:
            from_outputs.append(p)
    if shared:
        # Shared branch: replay the whole backward into the parameters in W (which keeps
        # the compiled linears' (X, dY); B keeps none, or they would count twice).
        with collect(False):
            got = torch.autograd.grad(outputs, wanted, grads, retain_graph=True, allow_unused=True)
        work.from_outputs = (outputs, grads, params)
        return _place(inputs, wanted, got), work
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = [
        join.register_prehook(lambda g, join=join: captured.__setitem__(join, tuple(g)))
        for join in by_join
    ]
    try:
        with collect(True):
            got = torch.autograd.grad(
                outputs, [*wanted, *in_b], grads, retain_graph=True, allow_unused=True
            )
    finally:
        for h in handles:
            h.remove()
    got, own = got[: len(wanted)], got[len(wanted) :]
    with torch.no_grad():
        for p, g in zip(in_b, own, strict=True):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
    work.joins = [(join, captured[join], ps) for join, ps in by_join.items() if join in captured]
    if from_outputs:
        work.from_outputs = (outputs, grads, from_outputs)
    return _place(inputs, wanted, got), work


def _place(
    inputs: list[torch.Tensor], wanted: list[torch.Tensor], got: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    found = {id(x): g for x, g in zip(wanted, got, strict=True)}
    return [found.get(id(x)) for x in inputs]
