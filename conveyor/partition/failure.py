"""Why a model could not be captured, in one paragraph that names the model's own code."""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator

import torch
from torch import nn

from conveyor.errors import ConfigError

# Frames in these directories are not the model's code: torch, conveyor, contextlib.
_INTERNAL = (
    os.path.dirname(torch.__file__),
    os.path.dirname(os.path.dirname(__file__)),
    os.path.dirname(contextlib.__file__),
)


def capture_failure(model: nn.Module, error: Exception, fx_error: Exception | None = None) -> str:
    """What stopped the capture, where in the model's code, and the ways out.

    Args:
        model: The model that could not be captured.
        error: What stopped the last attempt (fx, or export after fx).
        fx_error: What stopped fx when ``error`` is export's; None when only fx ran.

    Returns:
        One paragraph for a :class:`~conveyor.errors.ConfigError`.
    """
    name = type(model).__name__
    where = _site(model, error) or (None if fx_error is None else _site(model, fx_error))
    first = first_line(error)
    at = f" at {where}" if where else ""
    if fx_error is None:
        return (
            f"torch.fx cannot trace {name} ({first}){at}; conveyor captures such a model with "
            f"torch.export on a sample batch: pass sample=(inputs, targets) to the Pipeline "
            f"(or call train_step first: the first batch is the sample)"
        )
    if any(p.is_meta for p in model.parameters()):
        return (
            f"conveyor cannot split {name} while its parameters are on the meta device: "
            f"torch.fx stopped ({first_line(fx_error)}) and torch.export, which runs the "
            f"forward on no data, stopped ({first}){at}, where the forward reads values it "
            f"does not have. Pass its layers as a list (nn.Sequential) or an execution "
            f"sequence (conveyor.sequence(model, ['embed', 'blocks.0', ...])), which split "
            f"without running it, or build it with real weights"
        )
    return (
        f"conveyor cannot capture {name} as a graph: torch.fx stopped ({first_line(fx_error)}) "
        f"and torch.export stopped ({first}){at}. Ways out: rewrite that line without "
        f"Python control flow on tensor values; or pass an nn.Sequential or a list of "
        f"layers; or an execution sequence: conveyor.sequence(model, ['embed', 'blocks.0', "
        f"...])"
    )


def refusal(error: BaseException) -> ConfigError | None:
    """conveyor's own ConfigError that ``error`` is or was raised from (a model refused by
    a check its forward ran into while captured, e.g. an attention context parallelism
    cannot compute), or None: that sentence says more than what stopped the capture."""
    return next((e for e in _chain(error) if isinstance(e, ConfigError)), None)


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then what it was raised from, and so on (each once)."""
    seen: set[int] = set()
    chain: BaseException | None = error
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        yield chain
        chain = chain.__cause__ or chain.__context__


def first_line(error: BaseException) -> str:
    """The first line of an error's message.

    Args:
        error: Any exception.

    Returns:
        That line, or the exception's type name when the message is empty.
    """
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _site(model: nn.Module, error: BaseException) -> str | None:
    """'model.<module> (file:line)' of the deepest model-code frame the error went through."""
    names = {id(m): n for n, m in model.named_modules()}
    found: str | None = None
    for chain in _chain(error):
        for frame, line in traceback.walk_tb(chain.__traceback__):
            path = frame.f_code.co_filename
            if path.startswith(_INTERNAL) or path.startswith("<"):
                continue
            owner = frame.f_locals.get("self")
            module = names.get(id(owner)) if isinstance(owner, nn.Module) else None
            label = "" if module is None else f"model.{module}" if module else "the model"
            found = f"{label} ({path}:{line})" if label else f"{path}:{line}"
    return found
