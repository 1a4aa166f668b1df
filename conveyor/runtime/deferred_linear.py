"""Weight gradients of linear layers and convolutions computed later, in W.

Under a split backward, B needs only ``dX = dY W`` and W only ``dW = dYᵀ X``. For
``F.linear``, ``x @ weight`` / ``torch.addmm(bias, x, weight)`` (transformers' ``Conv1D``)
and ``F.conv{1,2,3}d`` calls on a stage's parameters (and ``F.linear`` on one expert of a
parameter, ``experts.w[e]``) this module does exactly that: B computes dX and
keeps (X, dY) (:mod:`conveyor.runtime.deferred_grads`); W adds the weight gradient straight
into ``.grad``. Every other operation goes through autograd as usual, its weight gradients
in B (:mod:`conveyor.runtime.split_backward`). Under ``torch.autocast`` a call computes as
autocast's does (input, weight and bias in the autocast dtype); X and dY are kept in that
dtype and W's GEMM runs in it, its result added to the parameter's own-dtype gradient.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Set
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn import functional as F
from torch.nn import grad as nn_grad
from torch.overrides import TorchFunctionMode

from conveyor.runtime import deferred_grads
from conveyor.runtime.deferred_grads import ConvGrad, Entry, LinearGrad
from conveyor.runtime.opaque_linear import (
    OpaqueDeferring,
    autocast_input,
    deferrable,
    linear_call,
    sink,
)

_EXPERT = "_conveyor_expert_of"
"""Attribute of ``param[e]`` (a stage parameter indexed by one expert): ``(param, e)``."""

_KINDS: dict[Callable[..., torch.Tensor], tuple[Callable[..., torch.Tensor], ...]] = {
    F.conv1d: (nn_grad.conv1d_input, nn_grad.conv1d_weight),
    F.conv2d: (nn_grad.conv2d_input, nn_grad.conv2d_weight),
    F.conv3d: (nn_grad.conv3d_input, nn_grad.conv3d_weight),
}
_CONV: dict[Any, Callable[..., torch.Tensor]] = {
    **{call: call for call in _KINDS},
    # what a graph captured with torch.export calls
    torch.ops.aten.conv1d.default: F.conv1d,
    torch.ops.aten.conv2d.default: F.conv2d,
    torch.ops.aten.conv3d.default: F.conv3d,
}
_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = (None, None, None, 1, 0, 1, 1)


def _cast(
    weight: torch.Tensor, bias: torch.Tensor | None, cast: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Under autocast the input comes cast already; the parameters are cast here."""
    if cast is None:
        return weight, bias
    return weight.to(cast), None if bias is None else bias.to(cast)


# Both Functions take ``ctx`` in ``forward`` rather than a separate ``setup_context``:
# with one, ``Function.apply`` binds its arguments through ``inspect.signature`` at every
# call (about 170 us of host time per linear measured here, in every F of a split
# backward); functorch transforms, which need the separate form, do not run these eager
# stages (compiled ones go through ``conveyor::linear``, opaque_linear.py).


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        slot: list[Entry],
        cast: torch.dtype | None,
        target: tuple[torch.Tensor, torch.Tensor | None, Any, bool],
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)  # the parameter itself: cast again in backward
        ctx.slot, ctx.target = slot, target
        weight, bias = _cast(weight, bias, cast)
        if target[3]:  # x @ weight (+ bias): torch.addmm / matmul on a [in, out] weight
            if bias is None:
                return torch.matmul(x, weight)
            return torch.addmm(bias, x, weight)
        out = F.linear(x, weight, bias)
        if out._base is not None:
            # F.linear of a 3-d input returns a view, and autograd forbids modifying a
            # custom Function's view output in place (``out += residual``); _unsafe_view
            # is how ATen's own linear returns it: the same storage, no view tracking.
            out = torch.ops.aten._unsafe_view(out._base, out.shape)
        return out

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        x, weight = ctx.saved_tensors
        param, bias, index, transposed = ctx.target
        # x detached: its graph (every saved tensor before it) is freed at B.
        ctx.slot.append(LinearGrad(param, bias, x.detach(), dy, index, transposed))
        dx = None
        if ctx.needs_input_grad[0]:
            w = weight.to(dy.dtype)
            dx = dy @ (w.t() if transposed else w)
        return dx, None, None, None, None, None


class _DeferredConv(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        slot: list[Entry],
        cast: torch.dtype | None,
        conv: tuple[Callable[..., torch.Tensor], tuple[Any, Any, Any, int]],
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bias, ctx.slot, ctx.spec = bias, slot, conv[1]
        ctx.of_input, ctx.of_weight = _KINDS[conv[0]]
        weight, bias = _cast(weight, bias, cast)
        call, spec = conv
        return call(x, weight, bias, *spec)

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        x, weight = ctx.saved_tensors
        ctx.slot.append(ConvGrad(weight, ctx.bias, x.detach(), dy, ctx.of_weight, ctx.spec))
        dx = None
        if ctx.needs_input_grad[0]:
            dx = ctx.of_input(x.shape, weight.to(dy.dtype), dy, *ctx.spec)
        return dx, None, None, None, None, None


def _target(
    weight: Any, bias: Any, params: Set[int], transposed: bool
) -> tuple[torch.Tensor, torch.Tensor | None, Any, bool] | None:
    """What W adds a linear call's gradient into: ``(weight, bias, None, transposed)`` for
    the stage's own parameters, ``(param, bias_param, e, False)`` for one expert of them;
    None otherwise."""
    if deferrable(weight, bias, params):
        return weight, bias, None, transposed
    expert = getattr(weight, _EXPERT, None)
    if expert is None or transposed:
        return None
    of_bias = None if bias is None else getattr(bias, _EXPERT, None)
    if bias is not None and (of_bias is None or of_bias[1] is not expert[1]):
        return None
    return expert[0], None if of_bias is None else of_bias[0], expert[1], False


_MATMUL = (torch.matmul, torch.Tensor.matmul, torch.ops.aten.matmul.default)
_ADDMM = (torch.addmm, torch.ops.aten.addmm.default)


def _matmul_call(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, Any, Any] | None:
    """``(x, weight, bias)`` of ``x @ weight`` or ``torch.addmm(bias, x, weight)`` (as
    transformers' ``Conv1D`` calls it, GPT-2's), with a 2-d ``weight``; None otherwise."""
    if func in _MATMUL and len(args) == 2 and not kwargs:
        x, weight, bias = args[0], args[1], None
    elif func in _ADDMM and len(args) == 3 and not kwargs:  # beta = alpha = 1 only
        bias, x, weight = args
    else:
        return None
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)):
        return None
    if weight.dim() != 2 or x.dim() < 2 or not torch.is_grad_enabled():
        return None
    return x, weight, bias


def _conv_spec(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """A convolution call's arguments in ``F.conv2d``'s order, defaults filled in."""
    values = list(args) + [None] * (len(_CONV_ARGS) - len(args))
    for i, name in enumerate(_CONV_ARGS):
        if i >= len(args):
            values[i] = kwargs.get(name, _CONV_DEFAULTS[i])
    return values


class _Deferring(TorchFunctionMode):
    def __init__(self, params: set[int], slot: list[Entry]) -> None:
        super().__init__()
        self.params, self.slot = params, slot

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and id(args[0]) in self.params:
            return self._expert(func, args)
        if func in _CONV and torch.is_grad_enabled():
            return self._conv(func, args, kwargs)
        transposed = False
        call = linear_call(func, args, kwargs)
        if call is None:
            call, transposed = _matmul_call(func, args, kwargs), True
        if call is not None:
            x, weight, bias = call
            target = _target(weight, bias, self.params, transposed)
            cast = None if target is None else autocast_input(x, weight)
            if target is not None and cast is not None:
                return _DeferredLinear.apply(cast[0], weight, bias, self.slot, cast[1], target)  # type: ignore[no-untyped-call]
        return func(*args, **kwargs)

    @staticmethod
    def _expert(func: Any, args: tuple[Any, ...]) -> Any:
        """``param[e]``: marked as one expert of ``param`` when ``e`` is one index."""
        out = func(*args)
        index = args[1]
        one = isinstance(index, int) or (
            isinstance(index, torch.Tensor) and index.dim() == 0 and not index.is_floating_point()
        )
        if one and isinstance(out, torch.Tensor):
            setattr(out, _EXPERT, (args[0], index))
        return out

    def _conv(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x, weight, bias, *spec = _conv_spec(args, kwargs)
        padding = spec[1]
        if isinstance(x, torch.Tensor) and deferrable(weight, bias, self.params):
            cast = autocast_input(x, weight)
            # padding="same" is left to autograd (torch.nn.grad takes numbers)
            if cast is not None and (not isinstance(padding, str) or padding == "valid"):
                spec[1] = 0 if padding == "valid" else padding
                return _DeferredConv.apply(  # type: ignore[no-untyped-call]
                    cast[0], weight, bias, self.slot, cast[1], (_CONV[func], tuple(spec))
                )
        return func(*args, **kwargs)


class LinearWeightStore:
    """What each (stage, micro-batch) keeps from its B until its W
    (:mod:`~conveyor.runtime.deferred_grads` entries)."""

    def __init__(self, params: list[torch.Tensor], opaque: bool = False) -> None:
        """``opaque``: the stages are compiled; linear calls go through
        :class:`~conveyor.runtime.opaque_linear.OpaqueDeferring` and their (X, dY) reach
        the slot that :meth:`collecting` opens during B."""
        self._params = {id(p) for p in params}
        self._slots: dict[tuple[int, int], list[Entry]] = {}
        self.opaque = opaque

    def add_params(self, params: list[torch.Tensor]) -> None:
        """Defer calls on ``params`` too (FSDP's gathered parameters)."""
        self._params |= {id(p) for p in params}

    @contextmanager
    def capture(self, key: tuple[int, int]) -> Iterator[None]:
        """Within this block, linear calls on the stage's parameters are deferred."""
        slot = self._slots.setdefault(key, [])
        with OpaqueDeferring() if self.opaque else _Deferring(self._params, slot):
            yield

    def collecting(self, key: tuple[int, int] | None) -> contextlib.AbstractContextManager[Any]:
        """Within this block, compiled stages' linear backwards keep (X, dY) for ``key``'s
        W (None: they keep nothing); a no-op for eager stages."""
        if not self.opaque:
            return contextlib.nullcontext()
        return sink(None if key is None else self._slots.setdefault(key, []))

    def collector(
        self, key: tuple[int, int]
    ) -> Callable[[bool], contextlib.AbstractContextManager[Any]]:
        """What the split backward calls to keep (``True``) or drop (``False``) ``key``'s
        linear inputs and output gradients (:meth:`collecting`)."""
        return functools.partial(self._collecting_for, key)

    def _collecting_for(
        self, key: tuple[int, int], keep: bool
    ) -> contextlib.AbstractContextManager[Any]:
        return self.collecting(key if keep else None)

    def kept(self, key: tuple[int, int]) -> list[torch.Tensor]:
        """The tensors kept for ``key``'s W."""
        return [t for entry in self._slots.get(key, []) for t in entry.kept()]

    def flush(self, keys: list[tuple[int, int]]) -> None:
        """W of ``keys``' micro-batches: every kept weight gradient added into ``.grad``,
        each entry freed as soon as it is used."""
        for key in keys:
            deferred_grads.run(self._slots.pop(key, []))
