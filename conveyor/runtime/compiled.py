"""Compiled stages: ``Pipeline(compile=True | {torch.compile keywords})``.

Each rank compiles its own stages' work with :func:`torch.compile`, as torchtitan does:

- a layer list's stage, per layer; an execution sequence's, per step module: identical
  blocks (a transformer's decoder layers) share one compiled code, since dynamo caches per
  code object and the parameters are graph inputs;
- a graph-captured stage (a ``GraphModule``), as a whole.

Only a unit's ``forward`` is compiled (``unit.forward = torch.compile(unit.forward)``),
so module hooks (FSDP2's gathers, which conveyor's schedule drives, and the user's) stay
outside the compiled code and run in the program's order: compiled code adds and
reorders no collective. The names of parameters and buffers do not change.

Shapes: dynamo's default ``dynamic=None`` compiles a unit for the first shapes it sees,
and on a new length once more with that dimension dynamic; later lengths reuse that code.
:class:`CompileStats` counts the graphs compiled per stage (``recompiles``: those after a
unit's first) and the seconds spent compiling, for ``print(pipe)`` and the progress line.

Schedules that split the backward keep linear layers' weight GEMMs out of the compiled
graphs (:mod:`conveyor.runtime.opaque_linear`), so W still has them to do.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from conveyor.errors import ConfigError
from conveyor.partition.execution import ExecutionSequence
from conveyor.partition.sequential import SequentialStage

_KEYWORDS = frozenset(inspect.signature(torch.compile).parameters) - {"model"}
# dynamo's own timers: tracing plus the forward's compile, and a lazily compiled backward
_TIMERS = ("_compile.compile_inner", "backward._backward_impl")
_current: list[tuple[int, str] | None] = [None]
_EAGER = "_conveyor_eager_forward"  # a compiled unit's own forward


def compile_keywords(option: object) -> dict[str, Any] | None:
    """Check ``Pipeline(compile=...)``: False / None (eager), True, or a dict of
    :func:`torch.compile` keywords; returns the keywords, or None for eager stages."""
    if option is None or option is False:
        return None
    if option is True:
        return {}
    if not isinstance(option, dict):
        raise ConfigError(
            f"compile must be True, False or a dict of torch.compile keywords (e.g. "
            f"{{'mode': 'max-autotune'}}), got {type(option).__name__}"
        )
    unknown = sorted(str(k) for k in option if k not in _KEYWORDS)
    if unknown:
        raise ConfigError(
            f"compile got {', '.join(unknown)}, which torch.compile does not take; use its "
            f"keywords: {', '.join(sorted(_KEYWORDS))}"
        )
    return dict(option)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo's own timers)."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(compilation_time_metrics.get(key, ())) for key in _TIMERS)


@dataclass
class CompileStats:
    """What compiling cost on this process, per stage.

    Attributes:
        units: per stage, the names of its compiled units (those with parameters).
        graphs: per stage and unit kind (class name), graphs compiled (first + recompiles).
        seconds: per stage, seconds spent compiling (forward and backward).
    """

    units: dict[int, list[str]] = field(default_factory=dict)
    graphs: dict[int, dict[str, int]] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)

    def recompiles(self, stage: int) -> int:
        """Graphs ``stage`` compiled after the first of each unit kind."""
        return sum(n - 1 for n in self.graphs.get(stage, {}).values() if n > 1)

    def total_seconds(self) -> float:
        """Seconds spent compiling over this process's stages."""
        return sum(self.seconds.values())

    @contextmanager
    def timing(self, stage: int) -> Iterator[None]:
        """Attribute the compile time spent inside the block to ``stage``."""
        before = compile_seconds()
        try:
            yield
        finally:
            spent = compile_seconds() - before
            if spent:
                self.seconds[stage] = self.seconds.get(stage, 0.0) + spent

    def describe(self, stage: int) -> str:
        """One line for ``print(pipe)``: units, graphs, recompiles, seconds."""
        units = self.units.get(stage, [])
        graphs = sum(self.graphs.get(stage, {}).values())
        return (
            f"compiled: {len(units)} unit(s), {graphs} graph(s), "
            f"{self.recompiles(stage)} recompile(s), {self.seconds.get(stage, 0.0):.1f} s"
        )

    def _count(self, graph: fx.GraphModule) -> None:
        where = _current[0]
        if where is not None:
            stage, kind = where
            per = self.graphs.setdefault(stage, {})
            per[kind] = per.get(kind, 0) + 1


def units_of(stage: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``stage`` compiled one by one (module doc), with their names."""
    if isinstance(stage, SequentialStage):
        return list(stage.named_children())
    if isinstance(stage, ExecutionSequence):
        return [(s, stage.get_submodule(s)) for s in stage.steps if isinstance(s, str)]
    return [("(whole stage)" if isinstance(stage, fx.GraphModule) else "", stage)]


def _counting_backend(backend: Any, stats: CompileStats) -> Callable[..., Any]:
    """``backend`` (a name or a callable) counting each graph it compiles into ``stats``.
    One per pipeline, shared by all its units: dynamo reuses a code's graph for another
    unit only when their backend is the same object."""
    inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend

    def counting(gm: fx.GraphModule, example_inputs: Any, **kw: Any) -> Any:
        stats._count(gm)
        return inner(gm, example_inputs, **kw)

    return counting


def compile_stages(stages: dict[int, nn.Module], keywords: dict[str, Any]) -> CompileStats:
    """Compile the units of ``stages`` in place (module doc); returns their stats."""
    stats = CompileStats()
    kw = dict(keywords)
    backend = _counting_backend(kw.pop("backend", "inductor"), stats)
    for s, stage in stages.items():
        stats.units[s] = []
        for name, unit in units_of(stage):
            # a unit without parameters (an activation, a reshape) is left eager
            trains = any(p.requires_grad for p in unit.parameters())
            if trains or isinstance(unit, fx.GraphModule):
                stats.units[s].append(name or type(unit).__name__)
                _compile_unit(unit, s, backend, kw)
    return stats


def _compile_unit(unit: nn.Module, stage: int, backend: Any, kw: dict[str, Any]) -> None:
    eager = unit.__dict__.get(_EAGER, unit.forward)  # compiled again: from the original
    compiled: Callable[..., Any] = torch.compile(eager, backend=backend, **kw)
    where = (stage, type(unit).__name__)

    @functools.wraps(eager)
    def forward(*args: Any, **kwargs: Any) -> Any:
        before, _current[0] = _current[0], where
        try:
            return compiled(*args, **kwargs)
        finally:
            _current[0] = before

    unit.__dict__[_EAGER] = eager
    unit.forward = forward


def frames_compiled() -> int:
    """Frames dynamo has compiled in this process (its ``frames.ok`` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])
