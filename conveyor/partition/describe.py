"""A readable description of a split: per stage its modules, parameters and what it sends.

Modules are named as in the model, by the largest modules that run wholly in the stage,
with numbered runs folded (``transformer.h.0-3``); a module cut between stages is listed
as ``part of ...`` on each side. What crosses a boundary is listed by the graph node that
made it (``add_7 (transformer.h.1)``) with dtype and shape where the capture recorded
them, or as the stage's output.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from conveyor.partition.captured import module_path
from conveyor.partition.execution import ExecutionSequence
from conveyor.partition.methods import SplitMethod, split_method

_HOW: dict[SplitMethod, str] = {
    "layers": "a layer list, cut between its layers",
    "sequence": "an execution sequence, cut between its steps",
    "fx": "captured with torch.fx, cut as a graph",
    "export": "captured with torch.export, cut as a graph",
}
SENDS = "conveyor_sends"  # GraphModule.meta key: (label, value) per value a stage sends
COPIED = "conveyor_copied"  # node.meta key: a value each stage that needs it makes again


@dataclass(frozen=True)
class StageInfo:
    """One stage: where it runs, its modules, parameter count, tied weights, what it sends.

    Attributes:
        stage: Its index.
        rank: The pipeline rank it runs on.
        modules: Its modules, largest whole ones first, then ``part of ...``.
        parameters: How many parameters it holds.
        tied: Its parameters an earlier stage holds too, as ``name = name (stage s)``.
        sends: Per value it sends, (value, 'dtype[shape]' or '' where unknown).
    """

    stage: int
    rank: int
    modules: tuple[str, ...]
    parameters: int
    tied: tuple[str, ...]
    sends: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class SplitInfo:
    """The whole split, printable (``print(pipe)``).

    Attributes:
        model: The model's type name.
        method: How it was cut: ``"layers"``, ``"sequence"``, ``"fx"`` or ``"export"``.
        stages: Each stage's description.
        recomputed: Modules whose values each stage that needs them makes again.
    """

    model: str
    method: SplitMethod
    stages: tuple[StageInfo, ...]
    recomputed: tuple[str, ...] = ()

    @property
    def how(self) -> str:
        """How it was cut, in words."""
        return _HOW[self.method]

    def __str__(self) -> str:
        """A line per stage (and its tied weights and sends), after a title line."""
        lines = [f"{self.model} in {len(self.stages)} stages ({self.how})"]
        if self.recomputed:
            lines.append(
                "made again on each stage that needs it, not sent: " + ", ".join(self.recomputed)
            )
        for info in self.stages:
            modules = ", ".join(info.modules) or "(no module: operations only)"
            lines.append(
                f"stage {info.stage} on rank {info.rank}: {modules}; "
                f"{_count(info.parameters)} parameters"
            )
            if info.tied:
                lines.append("  tied: " + ", ".join(info.tied))
            if info.sends:
                sends = (f"{name} {shape}".rstrip() for name, shape in info.sends)
                lines.append("  sends: " + ", ".join(sends))
        return "\n".join(lines)

    def with_shapes(self, measured: dict[int, list[str]]) -> SplitInfo:
        """This description with the shapes a run measured.

        They replace the capture's, which are its sample's (a cached capture's sample may
        have had another micro-batch size).

        Args:
            measured: Per stage, one 'dtype[shape]' (or '') per value it sends.

        Returns:
            A new description; a stage whose count of shapes does not match keeps none.
        """
        stages = []
        for info in self.stages:
            # the stage also passes on values that are not tensors (no shape): skip those
            shapes = [shape for shape in measured.get(info.stage, []) if shape]
            if len(shapes) != len(info.sends):
                shapes = [""] * len(info.sends)
            sends = tuple(
                (name, got or shape) for (name, shape), got in zip(info.sends, shapes, strict=True)
            )
            stages.append(dataclasses.replace(info, sends=sends))
        return dataclasses.replace(self, stages=tuple(stages))


def describe_split(
    model: nn.Module | Sequence[nn.Module], stages: Sequence[nn.Module], placement: Sequence[int]
) -> SplitInfo:
    """The description of ``stages`` cut from ``model``.

    Args:
        model: The unsplit model (a module, layer list or execution sequence).
        stages: Its stage modules.
        placement: The rank of each stage.

    Returns:
        The printable description.
    """
    touched = [_touched(stage) for stage in stages]
    recomputed = sorted(set().union(*(_copied(stage) for stage in stages)) - set().union(*touched))
    blocks = _blocks(model)
    owners: dict[int, list[tuple[int, str]]] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            owners.setdefault(id(p), []).append((s, name))
    infos = []
    for s, stage in enumerate(stages):
        params = list(stage.named_parameters())
        tied = []
        for name, p in params:
            first, first_name = owners[id(p)][0]
            if first != s:
                tied.append(f"{name} = {first_name} (stage {first})")
        infos.append(
            StageInfo(
                stage=s,
                rank=placement[s],
                modules=tuple(_modules(touched, s, blocks)),
                parameters=sum(p.numel() for _, p in params),
                tied=tuple(tied),
                sends=tuple(_sends(stage)) if s < len(stages) - 1 else (),
            )
        )
    method = split_method(stages[0]) if stages else "layers"
    return SplitInfo(_model_name(model), method, tuple(infos), tuple(recomputed))


def _model_name(model: Any) -> str:
    """The type name of the model (of its source for an execution sequence)."""
    if isinstance(model, ExecutionSequence):
        return type(model.__dict__["source"]).__name__
    return type(model).__name__


def _touched(stage: nn.Module) -> set[str]:
    """Module paths (and their ancestors) that have work in ``stage``."""
    paths: set[str] = set()
    if isinstance(stage, fx.GraphModule):
        for n in stage.graph.nodes:
            if n.op in ("call_module", "call_function", "call_method") and COPIED not in n.meta:
                paths.add(module_path(n))
        for name, _ in stage.named_parameters():
            paths.add(name.rpartition(".")[0])
    elif isinstance(stage, ExecutionSequence):
        paths.update(s for s in stage.steps if isinstance(s, str))
    else:
        paths.update(name for name, _ in stage.named_children())
    out: set[str] = set()
    for path in paths:
        parts = path.split(".") if path else []
        out.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
    return out


def _blocks(model: Any) -> set[str]:
    """Names of the modules a cut should not go through: the elements of a
    ``ModuleList`` / ``Sequential`` and modules without children."""
    root = model.__dict__["source"] if isinstance(model, ExecutionSequence) else model
    if not isinstance(root, nn.Module):
        return set()
    out = set()
    for name, module in root.named_modules():
        children = list(module.named_children())
        if not children and name:
            out.add(name)
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            out.update(f"{name}.{c}" if name else c for c, _ in children)
    return out


def _copied(stage: nn.Module) -> set[str]:
    """Modules whose work ``stage`` does again rather than receive."""
    if not isinstance(stage, fx.GraphModule):
        return set()
    return {module_path(n) for n in stage.graph.nodes if COPIED in n.meta} - {""}


def _modules(touched: list[set[str]], s: int, blocks: set[str]) -> list[str]:
    """The largest modules only stage ``s`` touches, then the blocks cut between stages
    that it has a part of."""
    mine = touched[s]
    others: set[str] = set().union(*(t for i, t in enumerate(touched) if i != s))

    def whole(path: str) -> bool:
        return path in mine and path not in others

    wholes = sorted((p for p in mine if whole(p) and not whole(p.rpartition(".")[0])), key=_natural)
    shared = mine & others
    partial = sorted(
        (p for p in shared if p in blocks and not any(c.startswith(p + ".") for c in shared)),
        key=_natural,
    )
    return _fold(wholes) + [f"part of {p}" for p in partial]


def _natural(path: str) -> list[Any]:
    """A sort key that orders numbered parts by number (``h.2`` before ``h.10``)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in path.split(".")]


def _fold(paths: list[str]) -> list[str]:
    """``a.h.0, a.h.1, a.h.2`` -> ``a.h.0-2`` (runs of consecutive numbers under one parent)."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None  # parent, first, last
    for path in paths:
        match = re.fullmatch(r"(.*\.)?(\d+)", path)
        if match:
            parent, number = match.group(1) or "", int(match.group(2))
            if run is not None and run[0] == parent and number == run[2] + 1:
                run = (parent, run[1], number)
                continue
            if run is not None:
                out.append(_run_name(run))
            run = (parent, number, number)
            continue
        if run is not None:
            out.append(_run_name(run))
            run = None
        out.append(path)
    if run is not None:
        out.append(_run_name(run))
    return out


def _run_name(run: tuple[str, int, int]) -> str:
    """``parent.first-last``, or ``parent.first`` for a run of one."""
    parent, first, last = run
    return f"{parent}{first}" if first == last else f"{parent}{first}-{last}"


def _sends(stage: nn.Module) -> list[tuple[str, str]]:
    """What a stage sends: its recorded values, else its output as a whole."""
    if isinstance(stage, fx.GraphModule) and SENDS in stage.meta:
        return list(stage.meta[SENDS])
    return [("its output", "")]


def value_label(node: fx.Node) -> tuple[str, str]:
    """How a split's description names a value a graph stage sends.

    Args:
        node: The node that made the value.

    Returns:
        (name with its module or 'input', 'dtype[shape]' or '').
    """
    path = module_path(node)
    where = "input" if node.op == "placeholder" else path
    name = f"{node.name} ({where})" if where else node.name
    return name, shape_of(node.meta.get("val"))


def shape_of(value: Any) -> str:
    """The dtype and shape of a value holding one tensor.

    Args:
        value: A tensor or a pytree of them (sizes a capture left symbolic are shown as
            the sample's).

    Returns:
        'dtype[shape]', or '' unless ``value`` holds exactly one tensor.
    """
    leaves = [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]
    if len(leaves) != 1:
        return ""
    t = leaves[0]
    sizes = [str(s) if isinstance(s, int) else str(_hint(s)) for s in t.shape]
    return f"{str(t.dtype).removeprefix('torch.')}[{', '.join(sizes)}]"


def _hint(size: Any) -> int | str:
    """The sample's value of a symbolic size, '?' where unknown."""
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else "?"


def _count(n: int) -> str:
    """A parameter count for people: 12.3 M, 45 k, 678."""
    if n >= 1_000_000:
        return f"{n / 1e6:.1f} M"
    if n >= 10_000:
        return f"{n / 1e3:.0f} k"
    return str(n)
