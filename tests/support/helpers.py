"""What the tests share besides their models: losses, a gradient reader, error measures and
comparisons, the unsplit-versus-pipelined training runs, and resetting conveyor's process
context.

Models and their data live apart: ``models.py`` (the small MLP and its batches), ``zoo.py``
(models of every shape the partitioner meets), ``real_models.py`` (models as people bring
them). Processes: ``distributed.py``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    import conveyor

Named = Iterable[tuple[str, torch.Tensor]]
Steps = list[tuple[torch.Tensor, torch.Tensor]]
Run = tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]


# ---------------------------------------------------------------------------------- losses
def mse(out: Any, target: Any) -> Any:
    """Mean squared error, as a named function (spawned workers pickle it by name)."""
    return F.mse_loss(out, target)


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of (batch, sequence, vocab) logits."""
    return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))


# ------------------------------------------------------------------------------- gradients
def grads_of(named: Named) -> dict[str, torch.Tensor]:
    """A copy of every ``.grad`` by name, over ``(name, parameter)`` pairs (those without a
    gradient are left out)."""
    return {n: p.grad.detach().clone() for n, p in named if p.grad is not None}


def params_of(named: Named) -> dict[str, torch.Tensor]:
    """A copy of every parameter by name."""
    return {n: p.detach().clone() for n, p in named}


# ------------------------------------------------------------------------------ error measures
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error in the 2-norm: ``|a - b| / |b|`` (over the whole tensor)."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error in the max-norm: the largest element difference over ``b``'s largest
    magnitude."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


REDUCTION = 1024
"""The longest sum behind one value in the suite's models, unless a test says otherwise: a
batch of at most a few hundred tokens (a weight's gradient sums over them) plus the widest
layer's inner dimension (each of those terms is a dot product over it)."""


def rounding_bound(
    reference: Iterable[torch.Tensor],
    reduction: int = REDUCTION,
    dtype: torch.dtype = torch.float32,
) -> float:
    """The most float rounding can move one of two computations of the same values that
    sum in different orders (micro-batches, ranks, threads, another CPU's kernels): each
    rounds a sum of ``reduction`` terms by at most ``reduction * eps / 2`` of the terms'
    magnitude, and the terms are measured by ``reference``, the whole set of values
    involved (every gradient of the model, or of the layer), in the 2-norm.

    Measured against the set, not each tensor: a gradient zero in exact arithmetic (an
    attention key bias, whose terms cancel) is rounding noise of the size of its terms, not
    of itself. A tensor is then checked as far as rounding allows: a wrong factor (2x,
    0.5x) fails wherever the tensor is larger than the bound, that is, unless its
    gradient is itself within rounding of zero.

    ``dtype``: the type the values are rounded to (``torch.bfloat16`` under autocast, whose
    matrix products still sum in float32: ``reduction`` is then the roundings to the half
    type along the path, about one per layer and direction)."""
    scale = math.sqrt(sum(float(t.detach().double().norm()) ** 2 for t in reference))
    return reduction * torch.finfo(dtype).eps * scale


def assert_close(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    what: str,
    *,
    reduction: int = REDUCTION,
    dtype: torch.dtype = torch.float32,
) -> None:
    """The same names, and every tensor within :func:`rounding_bound` of ``want``'s, the
    bound taken over all of ``want`` (the gradients or values involved)."""
    assert set(got) == set(want), f"{what}: names {sorted(got)} != {sorted(want)}"
    bound = rounding_bound(want.values(), reduction, dtype)
    for name in want:
        err = float((got[name].detach().double() - want[name].detach().double()).norm())
        assert err <= bound, (
            f"{what}: {name} differs by {err:.2e}, more than rounding reaches ({bound:.2e}: "
            f"sums of {reduction} terms in {dtype})"
        )


assert_close_to_largest = assert_close
"""The name some tests know :func:`assert_close` by (it measures every tensor against the
whole set, so a gradient zero in exact arithmetic is measured against the largest)."""


# ------------------------------------------------------------------------------ memory
def memory_model_peak(actions: Any, split_backward: bool, report: Any) -> int:
    """The schedule's memory model over one rank's ``actions`` with the sizes a
    ``MemoryReport`` measured, written apart from conveyor's own: F's bytes held until the
    last of B / W; under a split backward B's change held until W."""
    held = peak = 0
    for a in actions:
        key = a.stage, a.microbatch
        if a.kind == "F":
            held += report.forward[key]
        elif a.kind == "B" and not split_backward:
            held -= report.forward[key]
        elif a.kind == "B":
            held += report.at_backward[key]
        else:
            held -= report.forward[key] + report.at_backward[key]
        peak = max(peak, held)
    return peak


# --------------------------------------------------------------------- results of several ranks
def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One dict from every rank's; no name may come from two ranks."""
    out: dict[str, Any] = {}
    for part in parts:
        overlap = set(out) & set(part)
        assert not overlap, f"parameters on two ranks: {overlap}"
        out.update(part)
    return out


def tied_names(model: nn.Module) -> dict[str, str]:
    """Every name of a parameter -> its first name (a tied weight has several)."""
    first: dict[int, str] = {}
    return {
        name: first.setdefault(id(p), name)
        for name, p in model.named_parameters(remove_duplicate=False)
    }


def merge_tied(
    parts: list[dict[str, torch.Tensor]], alias: dict[str, str], what: str
) -> dict[str, torch.Tensor]:
    """One dict from every rank's, by first name (:func:`tied_names`); the copies of a tied
    weight, on several ranks, must be equal."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, value in part.items():
            name = alias[name]
            if name in out:
                assert torch.equal(out[name], value), f"{what}: copies of {name} differ"
            out[name] = value
    return out


# ------------------------------------------------------------------------- training runs
def _sgd(
    owner: Any, step: Callable[[torch.Tensor, torch.Tensor], float], steps: Steps, lr: float
) -> Run:
    """Losses per step, final grads and final parameters of ``owner`` (anything with
    ``parameters`` and ``named_parameters``) under SGD; no update after the last step."""
    opt = torch.optim.SGD(owner.parameters(), lr=lr)
    losses = []
    for i, (x, y) in enumerate(steps):
        opt.zero_grad()
        losses.append(step(x, y))
        if i < len(steps) - 1:
            opt.step()
    return losses, grads_of(owner.named_parameters()), params_of(owner.named_parameters())


Trace = list[tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]]
"""Per step: its loss, the gradients it left and the parameters after the update."""


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def sgd_trace(
    named: Iterable[tuple[str, torch.Tensor]],
    step: Callable[[Any, Any], Any],
    data: Iterable[tuple[Any, Any]],
    lr: float,
    copy: Callable[[torch.Tensor], torch.Tensor] = _copy,
) -> Trace:
    """Train with SGD, one ``step(inputs, targets)`` (which returns the loss) per batch of
    ``data``, and record after each: the loss, ``copy`` of every ``.grad`` (those without
    one left out), then, after the update and ``zero_grad``, ``copy`` of every parameter.
    The same for an unsplit model and a pipeline's part (``named``: its named parameters;
    none: no update, as for a rank holding only parameter-free stages)."""
    named = list(named)
    opt = torch.optim.SGD([p for _, p in named], lr=lr) if named else None
    out: Trace = []
    for x, y in data:
        loss = float(step(x, y))
        grads = {n: copy(p.grad) for n, p in named if p.grad is not None}
        if opt is not None:
            opt.step()
            opt.zero_grad()
        out.append((loss, grads, {n: copy(p) for n, p in named}))
    return out


def reference(model: nn.Module, steps: Steps, lr: float = 0.1) -> Run:
    """Losses per step, final grads and final parameters of the unsplit model under SGD."""

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss.item()

    return _sgd(model, step, steps, lr)


def pipelined(pipe: conveyor.Pipeline, steps: Steps, lr: float = 0.1) -> Run:
    """The same as :func:`reference`, through a pipeline (this rank's part)."""
    return _sgd(pipe, lambda x, y: pipe.train_step(x, y).item(), steps, lr)


# ------------------------------------------------------------------------------ process state
def reset_context() -> None:
    """Forget conveyor's process context, as a fresh script starts: the next
    ``conveyor.current()`` or ``init()`` makes a new one. (Nothing to do where conveyor
    was never imported.)"""
    context = sys.modules.get("conveyor.context")
    if context is not None:
        context.forget()
