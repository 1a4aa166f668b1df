"""Execution sequences (Colossal-AI style): a model as a chain of named submodules and functions.

``conveyor.sequence(model, ["conv1", "bn1", "relu", "layer1", flatten, "fc"])`` says how the
model runs when its ``forward`` cannot be traced or cut by hand: each step consumes the
previous step's output (the first step gets the model's arguments). The result is itself an
``nn.Module`` that runs those steps, so it can be checked against the model, and it is split
like a layer list: by ``balance``, by ``pipeline_stage`` annotations, or by parameter counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn

from conveyor.errors import ConfigError
from conveyor.partition.annotations import chain_sizes, owner, stage_marks, whole_stage
from conveyor.partition.cuts import balance as min_max_balance
from conveyor.partition.tree import install

SequenceEntry = str | Callable[..., Any]
"""One entry of an execution sequence: a submodule's name, or a plain function."""


class ExecutionSequence(nn.Module):
    """Runs ``steps`` in order: names of submodules of ``source``, or plain callables.

    The step modules sit at their original attribute paths (``layer1.0`` under an empty
    ``layer1`` container), so parameter and state_dict names are the original model's and
    the parameters are the model's own objects.

    Args:
        source: The model the steps come from (kept for its annotations).
        steps: Submodule names of ``source`` and callables, in execution order.
    """

    def __init__(self, source: nn.Module, steps: Sequence[SequenceEntry]) -> None:
        super().__init__()
        self.steps = list(steps)
        # Kept outside the module tree (no "source." prefix): read for annotations only.
        self.__dict__["source"] = source
        for step in self.steps:
            if isinstance(step, str):
                install(self, step, source.get_submodule(step))

    def called_modules(self) -> list[nn.Module]:
        """The steps that are submodules, in the order the forward calls them."""
        return [self.get_submodule(s) for s in self.steps if isinstance(s, str)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the steps.

        Args:
            *args: The first step's positional arguments.
            **kwargs: The first step's keyword arguments.

        Returns:
            The last step's output; each later step takes the previous one's output.
        """
        value: Any = None
        for i, step in enumerate(self.steps):
            fn = self.get_submodule(step) if isinstance(step, str) else step
            value = fn(*args, **kwargs) if i == 0 else fn(value)
        return value

    def names(self) -> list[str]:
        """A printable name per step.

        Returns:
            The submodule path, or the function's (a partial's function's) name.
        """
        return [
            s if isinstance(s, str) else getattr(getattr(s, "func", s), "__name__", repr(s))
            for s in self.steps
        ]

    def extra_repr(self) -> str:
        """The step names, for ``repr``."""
        return "steps=[" + ", ".join(self.names()) + "]"


def sequence(model: nn.Module, steps: Iterable[SequenceEntry | nn.Module]) -> ExecutionSequence:
    """The execution sequence of ``model``.

    Args:
        model: The model.
        steps: Submodule names (or the submodules themselves) and functions between them,
            e.g. ``functools.partial(torch.flatten, start_dim=1)``, in execution order.

    Returns:
        A module that runs the steps, each consuming the previous one's output.

    Raises:
        ConfigError: A step is not a submodule, its name or a callable; there is no step;
            or a parameter of the model belongs to no step.
    """
    path = {id(m): name for name, m in model.named_modules() if name}
    resolved: list[SequenceEntry] = []
    for step in steps:
        if isinstance(step, nn.Module) and id(step) in path:
            resolved.append(path[id(step)])
        elif isinstance(step, nn.Module) and any(True for _ in step.state_dict()):
            raise ConfigError(
                f"step {type(step).__name__} has parameters or buffers but is not a "
                f"submodule of the model; add it to the model, or pass the model's own "
                f"submodules or their names"
            )
        elif isinstance(step, str):
            try:
                model.get_submodule(step)
            except AttributeError as e:
                raise ConfigError(
                    f"the model has no submodule {step!r}; name steps by their attribute "
                    f"paths, as in model.named_modules() (e.g. 'layer1.0')"
                ) from e
            resolved.append(step)
        elif callable(step):
            resolved.append(step)
        else:
            raise ConfigError(f"step {step!r} is neither a submodule name nor a callable")
    if not resolved:
        raise ConfigError("an execution sequence needs at least one step")
    seq = ExecutionSequence(model, resolved)
    held = {id(p) for p in seq.parameters()}
    missing = [n for n, p in model.named_parameters() if id(p) not in held]
    if missing:
        raise ConfigError(
            f"parameters {missing[:5]}{' ...' if len(missing) > 5 else ''} belong to no step "
            f"of the execution sequence; add the modules that own them as steps"
        )
    return seq


def split_sequence(
    seq: ExecutionSequence,
    stages: int,
    balance: Sequence[int] | None = None,
    placement: Sequence[int] | None = None,
) -> list[nn.Module]:
    """Cut an execution sequence into contiguous runs of steps.

    Args:
        seq: The execution sequence.
        stages: How many stages to make.
        balance: Steps per stage; None to cut by the ``pipeline_stage`` annotations on the
            step modules or their ancestors, or else by parameter counts.
        placement: The rank of each stage, for a cut by parameter counts.

    Returns:
        One execution sequence per stage.

    Raises:
        ConfigError: Annotations and ``balance`` were both given, ``balance`` does not fit,
            or the annotations do not make ``stages`` stages in data-flow order.
    """
    steps, names = seq.steps, seq.names()
    source: nn.Module = seq.__dict__["source"]
    marks = stage_marks(source)
    if marks and balance is not None:
        raise ConfigError(
            "the model has pipeline_stage annotations and a balance was given too; pass one "
            "of them (balance=None to use the annotations)"
        )
    if marks:
        chain: list[tuple[str, tuple[int, str] | None]] = []
        for step, name in zip(steps, names, strict=True):
            mark = None
            if isinstance(step, str):
                above = owner(step.rpartition(".")[0], marks)
                outer = (marks[above], f"model.{above}") if above is not None else None
                mark = whole_stage(source.get_submodule(step), f"model.{step}", outer)
            chain.append((f"model.{name}" if isinstance(step, str) else f"step {name}", mark))
        sizes = chain_sizes(chain, stages)
    elif balance is None:
        costs = [
            float(sum(p.numel() for p in seq.get_submodule(s).parameters()))
            if isinstance(s, str)
            else 0.0
            for s in steps
        ]
        sizes = min_max_balance(costs, stages, placement)
    else:
        sizes = [int(b) for b in balance]
        if len(sizes) != stages or min(sizes, default=0) < 1 or sum(sizes) != len(steps):
            raise ConfigError(
                f"balance {list(balance)} does not fit: the pipeline has {stages} stages and "
                f"the execution sequence {len(steps)} steps; give {stages} counts >= 1 that "
                f"add up to {len(steps)}"
            )
    out: list[nn.Module] = []
    start = 0
    for size in sizes:
        out.append(ExecutionSequence(source, steps[start : start + size]))
        start += size
    return out
