"""Linear layers whose weight gradients stay out of compiled graphs (split backward).

A compiled region's backward is one autograd node: B (input gradients) would run it
whole, weight GEMMs included, and W would have nothing left to do. Under a split backward
with ``Pipeline(compile=...)``, :class:`OpaqueDeferring` therefore routes ``F.linear`` on
parameters through the custom op ``conveyor::linear``, which ``torch.compile`` treats as
one opaque call. Its backward is the op ``conveyor::linear_dx``: it returns only
``dX = dY W`` (to the weight and bias it returns no gradient) and hands ``(W, b, X, dY)``
(copies) to the sink that is open at that moment, a :class:`~conveyor.runtime.deferred_linear.
LinearWeightStore` slot; W then adds ``dYᵀ X``, as for eager stages. The side effect
cannot be dropped by the compiler: ``dX`` is used.

A linear whose input needs no gradient (its ``dX`` would be unused, so the compiler could
drop the op) stays an ordinary ``F.linear``; its weight gradient is then computed with the
rest of the compiled backward, in B.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Set
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from conveyor.runtime.deferred_grads import Entry, LinearGrad

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)
_ATEN_LINEAR = torch.ops.aten.linear.default

_sink: list[list[Entry] | None] = [None]


@contextmanager
def sink(slot: list[Entry] | None) -> Iterator[None]:
    """Within this block, ``conveyor::linear_dx`` appends its ``(W, b, X, dY)`` to
    ``slot`` (None: to nothing, e.g. while a replay must not add twice)."""
    before = _sink[0]
    _sink[0] = slot
    try:
        yield
    finally:
        _sink[0] = before


@torch.library.custom_op("conveyor::linear", mutates_args=())
def _linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cast: torch.dtype | None
) -> torch.Tensor:
    if cast is not None:
        weight = weight.to(cast)
        bias = None if bias is None else bias.to(cast)
    return F.linear(x, weight, bias).contiguous()


@_linear.register_fake
def _linear_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cast: torch.dtype | None
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("conveyor::linear_dx", mutates_args=())
def _linear_dx(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    slot = _sink[0]
    if slot is not None:
        # Copies: compiled code (inductor) reuses a buffer once its last use in the graph
        # is done, and that use is this call, so a kept alias would be overwritten.
        slot.append(LinearGrad(weight, bias, x.detach().clone(), dy.detach().clone()))
    return dy @ weight.to(dy.dtype)


@_linear_dx.register_fake
def _linear_dx_fake(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return dy.new_empty((*dy.shape[:-1], weight.shape[1]))


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight, bias)


def _backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
    x, weight, bias = ctx.saved_tensors
    return torch.ops.conveyor.linear_dx(dy, x, weight, bias), None, None, None


_linear.register_autograd(_backward, setup_context=_setup)


def deferrable(weight: Any, bias: Any, params: Set[int] | None) -> bool:
    """Whether W may take a linear call's weight (and bias) gradient, for eager and
    compiled stages alike: both are plain tensors (a DTensor goes through autograd's
    generic split) that are the stage's trainable leaves.

    A leaf is an ``nn.Parameter`` that needs a gradient: a stage's own, or the gathered
    one FSDP swaps in for a block's forward and backward (``fsdp="reshard"`` gathers per
    use, so it is known only then). Eager stages also know plain tensors by ``params``
    (their ids). Compiled stages pass None: an id test in traced code makes dynamo guard
    on each parameter's identity and compile every block again.
    """

    def mine(t: Any) -> bool:
        if type(t) is nn.Parameter:
            return bool(t.requires_grad)
        return params is not None and type(t) is torch.Tensor and id(t) in params

    return mine(weight) and (bias is None or mine(bias))


Linear = Callable[[torch.Tensor, Any, Any, "torch.dtype | None"], Any]


def linear_call(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, Any, Any] | None:
    """``(x, weight, bias)`` of a torch function mode's call of ``F.linear`` (or of the
    ATen op a graph captured with torch.export calls directly) on a tensor input with
    gradients enabled; None for any other call."""
    if (func is F.linear or func is _ATEN_LINEAR) and torch.is_grad_enabled():
        x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if isinstance(x, torch.Tensor):
            return x, weight, bias
    return None


def autocast_input(x: torch.Tensor, weight: Any) -> tuple[torch.Tensor, torch.dtype | None] | None:
    """``x`` as autocast's linear takes it, and the dtype it casts input, weight and bias
    to (None without autocast); None where autocast would leave the linear as it is."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, None
    cast = torch.get_autocast_dtype(device)
    if x.dtype in _CASTABLE and weight.dtype in _CASTABLE:
        return x.to(cast), cast
    return None


class OpaqueDeferring(TorchFunctionMode):
    """Routes ``F.linear`` (and ATen's linear) on parameters (:func:`deferrable`) whose
    input needs a gradient through ``conveyor::linear`` (see the module doc); traced by
    ``torch.compile``."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        call = linear_call(func, args, kwargs)
        # An input without a gradient: nothing would ask for the op's backward.
        if call is not None and call[0].requires_grad and deferrable(call[1], call[2], None):
            x, weight, bias = call
            cast = autocast_input(x, weight)
            if cast is not None:
                return torch.ops.conveyor.linear(cast[0], weight, bias, cast[1])
        return func(*args, **kwargs)
