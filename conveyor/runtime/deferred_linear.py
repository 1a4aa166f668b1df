"""Weight gradients of linear layers computed later, several micro-batches at once.

Under a split backward, B needs only ``dX = dY W`` and W only ``dW = dYᵀ X``. For
``F.linear`` calls on a stage's parameters this module does exactly that: B computes dX
and keeps (X, dY); W adds ``dYᵀ X`` straight into ``weight.grad`` with one GEMM over every
micro-batch whose W runs together, instead of one small GEMM, one fresh gradient tensor and
one accumulation per micro-batch. Other operations go through autograd as usual
(:mod:`conveyor.runtime.split_backward`). Under ``torch.autocast`` the call computes as
autocast's linear does (X, W and bias in the autocast dtype); X and dY are kept in that
dtype and W's GEMM runs in it, its result added to the parameter's own-dtype gradient.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd.graph import Node
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from conveyor.runtime.opaque_linear import (
    Entry,
    OpaqueDeferring,
    autocast_input,
    deferrable,
    is_opaque,
    keeping_buffers,
    linear_call,
    sink,
)


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        slot: list[Entry],
        cast: torch.dtype | None,
    ) -> torch.Tensor:
        if cast is not None:  # autocast: x comes cast already, the parameters are cast here
            weight = weight.to(cast)
            bias = None if bias is None else bias.to(cast)
        out = F.linear(x, weight, bias)
        if out._base is not None:
            # F.linear of a 3-d input returns a view, and autograd forbids modifying a
            # custom Function's view output in place (``out += residual``); _unsafe_view
            # is how ATen's own linear returns it: the same storage, no view tracking.
            out = torch.ops.aten._unsafe_view(out._base, out.shape)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, weight, bias, slot, _ = inputs
        ctx.save_for_backward(x, weight)  # the parameter itself: cast again in backward
        ctx.bias, ctx.slot, ctx.done = bias, slot, False

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        x, weight = ctx.saved_tensors
        if not ctx.done:  # a replay of the graph (W of another branch) must not add twice
            # x detached: its graph (every saved tensor before it) need not live until W.
            ctx.slot.append((weight, ctx.bias, x.detach(), dy))
            ctx.done = True
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        return dy @ weight.to(dy.dtype), None, None, None, None


def is_deferred(node: Node) -> bool:
    """Whether ``node`` is the backward of a deferred linear, eager or
    :mod:`~conveyor.runtime.opaque_linear` (its weight edges carry no gradient: W adds it
    from the store)."""
    return getattr(node, "_forward_cls", None) is _DeferredLinear or is_opaque(node)


class _Deferring(TorchFunctionMode):
    def __init__(self, params: set[int], slot: list[Entry]) -> None:
        super().__init__()
        self.params, self.slot = params, slot

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        call = linear_call(func, args, kwargs)
        if call is not None and deferrable(call[1], call[2], self.params):
            x, weight, bias = call
            cast = autocast_input(x, weight)
            if cast is not None:
                return _DeferredLinear.apply(cast[0], weight, bias, self.slot, cast[1])  # type: ignore[no-untyped-call]
        return func(*args, **kwargs)


class LinearWeightStore:
    """(X, dY) of deferred linear calls per (stage, micro-batch), until W."""

    def __init__(self, params: list[torch.Tensor], opaque: bool = False) -> None:
        """``opaque``: the stages are compiled; linear calls go through
        :class:`~conveyor.runtime.opaque_linear.OpaqueDeferring` and their (X, dY) reach
        the slot that :meth:`collecting` opens during B and W."""
        self._params = {id(p) for p in params}
        self._slots: dict[tuple[int, int], list[Entry]] = {}
        self.opaque = opaque

    def add_params(self, params: list[torch.Tensor]) -> None:
        """Defer linear calls on ``params`` too (FSDP's gathered parameters)."""
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
        stack = contextlib.ExitStack()
        stack.enter_context(sink(None if key is None else self._slots.setdefault(key, [])))
        stack.enter_context(keeping_buffers())
        return stack

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
        """The inputs and output gradients kept for ``key``'s W."""
        return [t for _, _, x, dy in self._slots.get(key, []) for t in (x, dy)]

    @torch.no_grad()
    def flush(self, keys: list[tuple[int, int]]) -> None:
        """Add the weight gradients of ``keys``' micro-batches, one GEMM per weight."""
        groups: dict[int, list[Entry]] = {}
        for key in keys:
            for entry in self._slots.pop(key, []):
                groups.setdefault(id(entry[0]), []).append(entry)
        for entries in groups.values():
            weight, bias = entries[0][0], entries[0][1]
            xs = torch.cat([x.reshape(-1, x.shape[-1]) for _, _, x, _ in entries])
            dys = torch.cat([dy.reshape(-1, dy.shape[-1]) for _, _, _, dy in entries])
            if dys.dtype != weight.dtype:  # autocast: a low-precision GEMM, fp32 gradient
                gw = (dys.t() @ xs).to(weight.dtype)
                weight.grad = gw if weight.grad is None else weight.grad.add_(gw)
            elif weight.grad is None:
                weight.grad = dys.t() @ xs
            else:
                weight.grad.addmm_(dys.t(), xs)
            if bias is not None:
                db = dys.sum(0, dtype=bias.dtype)
                bias.grad = db if bias.grad is None else bias.grad.add_(db)
