"""An exported model's call at the ends of the pipeline: stage 0 checks the arguments
against the capture sample and flattens them, the last stage rebuilds the model's output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from conveyor.errors import ConfigError
from conveyor.partition.captured import InputLayout
from conveyor.partition.failure import first_line


def check_inputs(layout: InputLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Flatten a stage-0 call the way the capture sample was flattened.

    Keyword arguments given in another order than the sample's are reordered.

    Args:
        layout: The capture's input layout.
        args: The call's positional arguments.
        kwargs: The call's keyword arguments.

    Returns:
        The graph's flat inputs.

    Raises:
        ConfigError: The call's structure, a size the capture fixed, or a relation between
            sizes the captured graph relies on differs from the sample's.
    """
    spec_kwargs = layout.spec.child(1).context if layout.spec.num_children == 2 else []
    if list(kwargs) != list(spec_kwargs) and set(kwargs) == set(spec_kwargs):
        kwargs = {k: kwargs[k] for k in spec_kwargs}
    flat, spec = pytree.tree_flatten((args, kwargs))
    if spec != layout.spec:
        raise ConfigError(
            f"the model was captured with inputs {_show(layout.spec)} but this step passes "
            f"{_show(spec)}; pass inputs of the same structure every step (the same keys "
            f"and positions), or build a new Pipeline"
        )
    for name, value, fixed in zip(layout.names, flat, layout.fixed, strict=True):
        if fixed is None or not isinstance(value, torch.Tensor):
            continue
        if len(fixed) != value.dim() or any(
            f is not None and f != s for f, s in zip(fixed, value.shape, strict=False)
        ):
            sizes = ["*" if f is None else str(f) for f in fixed]
            raise ConfigError(
                f"input {name!r} has shape {list(value.shape)}, but the captured model fixed "
                f"its sizes to [{', '.join(sizes)}] (* is free: the model's code turns the "
                f"others into constants); pass inputs of those sizes"
            )
    if layout.guards is not None:
        try:
            layout.guards(*flat)
        except Exception as e:
            raise ConfigError(
                f"this step's inputs break a condition the captured model relies on "
                f"({first_line(e)}); its code fixed a relation between input sizes when it "
                f"was captured: pass inputs that keep it, or build a new Pipeline"
            ) from e
    return flat


def flatten_inputs(layout: InputLayout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Stage 0 of an exported model: the call's arguments as the graph's flat inputs.

    The call stage 0's graph makes; see :func:`check_inputs` for arguments and errors.

    Args:
        layout: The capture's input layout.
        args: The call's positional arguments.
        kwargs: The call's keyword arguments.

    Returns:
        The graph's flat inputs.
    """
    return check_inputs(layout, args, kwargs)


def rebuild_output(spec: pytree.TreeSpec, flat: Sequence[Any]) -> Any:
    """The last stage of an exported model: the model's own output from its flat values.

    Args:
        spec: The pytree structure of the model's output.
        flat: The graph's flat outputs.

    Returns:
        The output as the model returns it (``ModelOutput``, dict, tuple...).
    """
    return pytree.tree_unflatten(list(flat), spec)


def _show(spec: pytree.TreeSpec) -> str:
    """A call structure in words: '2 positional and keywords a, b'."""
    try:
        args, kwargs = pytree.tree_unflatten(["·"] * spec.num_leaves, spec)
    except Exception:
        return str(spec)
    parts = [f"{len(args)} positional"] if args else []
    if kwargs:
        parts.append("keywords " + ", ".join(kwargs))
    return " and ".join(parts) or "no arguments"
