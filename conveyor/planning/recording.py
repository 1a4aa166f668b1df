"""What the aten operations of a traced run do, recorded on the meta device.

:class:`Recorder` (a dispatch mode) keeps every operation's FLOPs by torch's own formulas
(the table behind ``torch.utils.flop_counter.FlopCounterMode``), the bytes it reads and
writes and which of those are parameters; :class:`FlashAttention` turns
``scaled_dot_product_attention`` into the flash kernel's aten op, the kernel GPUs run (on
the meta device SDPA would fall back to its math form, which saves the sequence x sequence
scores); :class:`SavedBytes` counts what autograd saves for the backward. Each files what
it sees under the part that ``where()`` names when it happens.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as functional
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from conveyor.planning.model_count import ATTENTION, MATMUL, OTHER, Record

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "matmul", "linear"}
_ATTENTION = "attention"  # in the name of every fused attention op, forward and backward


class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every aten op, into the list of the part ``where()`` names, as a :data:`Record`
    (kind, flops, bytes, fixed bytes, causal); and per part, the parameters it read.

    Args:
        params: The model's parameters by id.
        where: The index of the part running now.
    """

    def __init__(self, params: Mapping[int, Tensor], where: Callable[[], int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.where = where
        self.weighty = {key: key for key in params}  # parameters, their views and casts
        self.kept = list(params.values())  # alive, so that no other tensor takes their ids
        self.ops: dict[int, list[Record]] = {}
        self.reads: dict[int, set[int]] = collections.defaultdict(set)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        part = self.where()
        inputs = list(tensors((args, kwargs)))
        outputs = list(tensors(out))
        name = func._overloadpacket.__name__
        roots = {self.weighty[id(t)] for t in inputs if id(t) in self.weighty}
        fixed = sum(nbytes(t) for t in inputs if id(t) in self.weighty)
        self.reads[part].update(roots)
        if roots and (func.is_view or name in {"_to_copy", "clone", "detach", "t"}):
            root = next(iter(roots))
            self.weighty.update((id(t), root) for t in outputs)
            self.kept += outputs
        if func.is_view or name in {"detach", "alias", "_unsafe_view"}:
            return out  # no memory traffic, no work
        packet = func._overloadpacket
        flops = (
            float(flop_registry[packet](*args, **kwargs, out_val=out))
            if packet in flop_registry
            else 0.0
        )
        if name == "_grouped_mm" and not flops:
            flops = _grouped_mm_flops(inputs[0], inputs[1], outputs[0])
        moved = sum(nbytes(t) for t in inputs + outputs) - fixed
        kind = ATTENTION if _ATTENTION in name else MATMUL if name in _MATMULS else OTHER
        causal = kind == ATTENTION and bool(_causal(args, kwargs))
        self.ops.setdefault(part, []).append((kind, flops, moved, fixed, causal))
        return out

    def take(self) -> dict[int, list[Record]]:
        """The ops recorded so far, by part; the record starts empty again."""
        ops, self.ops = self.ops, {}
        return ops


class FlashAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` as the flash kernel's aten op (what a GPU runs)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        causal = bool(kwargs.get("is_causal", False)) or mask is not None
        if k.shape[-3] != q.shape[-3]:  # grouped-query attention: every head its keys
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=kwargs.get("scale")
        )
        return out[0]


class SavedBytes:
    """What autograd saves, per part: each storage once, parameters never (the runtime's
    ActivationMeter keys storages by data pointer, which meta tensors do not have; here a
    view's base tensor, kept alive, is the key). ``pack`` is the saved-tensors pack hook."""

    def __init__(self, params: set[int], where: Callable[[], int]) -> None:
        self.params = params
        self.where = where
        self.held: dict[int, Tensor] = {}
        self.bytes: collections.Counter[int] = collections.Counter()

    def pack(self, t: Tensor) -> Tensor:
        """Count ``t``'s storage under the running part, once; ``t`` itself is kept."""
        base = t if t._base is None else t._base
        if id(base) not in self.params and id(base) not in self.held:
            self.held[id(base)] = base
            self.bytes[self.where()] += base.untyped_storage().nbytes()
        return t


def tensors(tree: Any) -> Iterator[Tensor]:
    """The tensors in nested lists, tuples and dicts, in order."""
    if isinstance(tree, Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from tensors(item)


def nbytes(t: Tensor) -> float:
    """Bytes of ``t``'s elements."""
    return float(t.numel() * t.element_size())


def _grouped_mm_flops(a: Tensor, b: Tensor, out: Tensor) -> float:
    """FLOPs of ``torch._grouped_mm``: each row meets one expert's matrix, whatever the
    routing (its formula is not in torch's table)."""
    if a.dim() == 2 and b.dim() == 2:  # a weight gradient: the groups split the rows
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2.0 * out.numel() * a.shape[-1]


def _causal(args: Any, kwargs: Any) -> bool:
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    flags = [a for a in args if isinstance(a, bool)]
    return bool(flags[0]) if flags else False
