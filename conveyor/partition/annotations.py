"""Stage annotations and the one rule that places everything else.

MindSpore style ``model.block3.pipeline_stage = 1`` and OneFlow style
``conveyor.set_stage(model.block3, 1)`` set the same attribute. A module's annotation covers
everything that runs inside it unless a submodule is annotated itself. Whatever has no
annotation runs on the latest stage among the values it consumes, so a few annotations are
enough. Pure Python: the graph, layer-list and execution-sequence splitters all describe their
work as :class:`Item` s and call :func:`assign_stages`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from conveyor.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

ATTRIBUTE = "pipeline_stage"

M = TypeVar("M", bound="nn.Module")


def set_stage(module: M, stage: int) -> M:
    """Run ``module`` (and everything inside it) on pipeline stage ``stage``.

    Args:
        module: The module to annotate.
        stage: Its stage, an int >= 0.

    Returns:
        ``module`` itself.

    Raises:
        ConfigError: ``stage`` is not an int >= 0.
    """
    setattr(module, ATTRIBUTE, _checked(stage, type(module).__name__))
    return module


def stage_of(module: nn.Module, name: str = "") -> int | None:
    """The stage ``module`` is annotated with.

    Args:
        module: Any module.
        name: How error messages name it (default: its type).

    Returns:
        Its ``pipeline_stage``, or None without one.

    Raises:
        ConfigError: The annotation is not an int >= 0.
    """
    stage = getattr(module, ATTRIBUTE, None)
    return None if stage is None else _checked(stage, name or type(module).__name__)


def stage_marks(model: nn.Module) -> dict[str, int]:
    """The annotated submodules of ``model`` (the model itself excluded).

    Args:
        model: Any module.

    Returns:
        Qualified name -> stage.

    Raises:
        ConfigError: An annotation is not an int >= 0.
    """
    out: dict[str, int] = {}
    for name, module in model.named_modules():
        stage = stage_of(module, name) if name else None
        if stage is not None:
            out[name] = stage
    return out


def annotated_stages(model: object) -> int | None:
    """How many stages the ``pipeline_stage`` annotations of ``model`` make.

    Args:
        model: A module, a layer list or an execution sequence.

    Returns:
        The highest annotated stage + 1, or None without annotations.
    """
    source = getattr(model, "__dict__", {}).get("source", model)  # an execution sequence
    roots = list(source) if isinstance(source, (list, tuple)) else [source]
    stages = [s for root in roots for s in stage_marks(root).values()]
    stages += [s for root in roots if (s := stage_of(root)) is not None]
    return max(stages) + 1 if stages else None


def owner(path: str, marks: dict[str, int]) -> str | None:
    """The innermost annotated module among ``path`` and its ancestors.

    Args:
        path: A module's qualified name ('' for the model).
        marks: The model's annotations (:func:`stage_marks`).

    Returns:
        That module's qualified name, or None when none is annotated.
    """
    parts = path.split(".") if path else []
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in marks:
            return prefix
    return None


def _checked(stage: object, name: str) -> int:
    """``stage`` when it is an int >= 0 (not a bool)."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
        raise ConfigError(f"{name}: {ATTRIBUTE} must be an int >= 0, got {stage!r}")
    return stage


@dataclass(frozen=True)
class Item:
    """One unit of work in execution order, for :func:`assign_stages`.

    Attributes:
        name: How error messages name it.
        inputs: Indices of earlier items whose values it consumes.
        stage: Its annotation, or None to follow its data.
        owner: The annotated module ``stage`` comes from.
        counts: False for items (the model's inputs) that do not make a stage non-empty.
    """

    name: str
    inputs: tuple[int, ...] = ()
    stage: int | None = None
    owner: str = ""
    counts: bool = True


def assign_stages(items: Sequence[Item], stages: int) -> list[int]:
    """The stage of every item: its annotation, else the latest stage among its inputs.

    Items with neither (constants built from nothing) take the earliest stage that consumes
    them.

    Args:
        items: The work, in execution order.
        stages: How many stages the pipeline has.

    Returns:
        The stage of each item.

    Raises:
        ConfigError: An annotation goes backwards along the data flow, the annotations
            make another number of stages than ``stages``, or a stage is left empty.
    """
    marked = [it.stage for it in items if it.stage is not None and it.counts]
    made = max(marked) + 1 if marked else 1
    if made != stages:
        raise ConfigError(
            f"the pipeline_stage annotations make {made} stage{'s' if made > 1 else ''} "
            f"(0..{made - 1}) but the "
            f"pipeline needs {stages} (pp x chunks); annotate stages 0..{stages - 1} or "
            f"change pp or chunks to match"
        )
    out: list[int | None] = []
    for it in items:
        came = [(s, i) for i in it.inputs if (s := out[i]) is not None]
        latest = max(came, default=None)
        if it.stage is None:
            out.append(None if latest is None else latest[0])
            continue
        if latest is not None and latest[0] > it.stage:
            source = items[latest[1]]
            raise ConfigError(
                f"{it.owner or it.name} is annotated pipeline_stage={it.stage} but consumes "
                f"the output of {source.owner or source.name}, which runs on stage "
                f"{latest[0]}; stages must follow the data flow, so give "
                f"{it.owner or it.name} a stage >= {latest[0]}"
            )
        out.append(it.stage)
    # Free items: consumers come later, so one reverse pass settles chains of them.
    users: list[list[int]] = [[] for _ in items]
    for j, it in enumerate(items):
        for i in it.inputs:
            users[i].append(j)
    for i in range(len(items) - 1, -1, -1):
        if out[i] is None:
            out[i] = min((s for j in users[i] if (s := out[j]) is not None), default=0)
    final = [s if s is not None else 0 for s in out]
    used = {s for s, it in zip(final, items, strict=True) if it.counts}
    for s in range(stages):
        if s not in used:
            raise ConfigError(
                f"stage {s} is empty: no module or operation runs on it; annotate at least "
                f"one module with pipeline_stage={s}, or number the stages without gaps"
            )
    return final


def whole_stage(
    module: nn.Module, name: str, outer: tuple[int, str] | None = None
) -> tuple[int, str] | None:
    """The stage of a module run as one step.

    Its own annotation wins over ``outer``; without either, the annotations inside it
    decide.

    Args:
        module: The step's module.
        name: How error messages name it.
        outer: An annotated ancestor's (stage, module name), or None.

    Returns:
        (stage, annotated module), or None if nothing annotates it.

    Raises:
        ConfigError: Annotations inside it disagree (a step cannot be cut).
    """
    own = stage_of(module, name)
    found = (own, name) if own is not None else outer
    for sub, m in module.named_modules(prefix=name):
        stage = stage_of(m, sub)
        if stage is None or sub == name:
            continue
        if found is None:
            found = (stage, sub)
        elif stage != found[0]:
            raise ConfigError(
                f"{sub} is annotated pipeline_stage={stage} but runs inside {name}, which is "
                f"one layer on stage {found[0]}; annotate {name} as a whole, or make its parts "
                f"separate layers (or steps of an execution sequence)"
            )
    return found


def chain_sizes(steps: Sequence[tuple[str, tuple[int, str] | None]], stages: int) -> list[int]:
    """Steps per stage for a chain, each step consuming the previous one's output.

    Args:
        steps: Per step, its name and (stage, annotated module), or None to follow the
            previous step.
        stages: How many stages the pipeline has.

    Returns:
        Steps per stage.

    Raises:
        ConfigError: The annotations go backwards, make another number of stages, or
            leave one empty.
    """
    items = [Item("the model inputs", stage=0, counts=False)]
    for i, (name, mark) in enumerate(steps):
        stage, by = mark if mark is not None else (None, "")
        items.append(Item(name, (i,), stage, by))
    assigned = assign_stages(items, stages)[1:]
    return [assigned.count(s) for s in range(stages)]
