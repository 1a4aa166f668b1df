"""What the aten operations of a traced run do, recorded on the meta device.

:class:`Recorder` (a dispatch mode) keeps every operation's FLOPs by torch's own formulas
(the table behind ``torch.utils.flop_counter.FlopCounterMode``), the bytes it reads and
writes and which of those are parameters, a matrix multiply's shape, and the most bytes of
new tensors alive at once in each part; :class:`FlashAttention` turns
``scaled_dot_product_attention`` into the flash kernel's aten op, the kernel GPUs run (on
the meta device SDPA would fall back to its math form, which saves the sequence x sequence
scores); :class:`SavedBytes` counts what autograd saves for the backward. Each files what
it sees under the part that ``where()`` names when it happens.

Attention a model writes by hand (BLOOM's ALiBi attention: scores by ``baddbmm``, a
softmax, a ``bmm`` with the values) is counted as the fused kernel a GPU runs it with
(FlashAttention takes ALiBi slopes): the multiplies that make or read the scores (a
tensor ``[..., heads, seq, seq]``) are attention, the element-wise work on the scores runs
inside the kernel, the scores are never saved (the kernel's log-sum-exp is), and the
backward recomputes the scores as the flash kernel does (2.5 forwards, not 2).
"""

from __future__ import annotations

import collections
import weakref
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
FLASH_BACKWARD = 2.5 / 2  # the flash backward's FLOPs over a plain one's (it recomputes S)


class Scores:
    """Which tensors are attention scores written by hand: ``[..., heads, seq, seq]``."""

    def __init__(self, seq: int, heads: int) -> None:
        self.seq, self.heads = seq, heads

    def __call__(self, t: Tensor) -> bool:
        return (
            self.heads > 1
            and t.dim() >= 3
            and t.shape[-1] == t.shape[-2] == self.seq
            and t.shape[-3] % self.heads == 0
        )


class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every aten op, into the list of the part ``where()`` names, as a :data:`Record`;
    per part, the parameters it read and the most bytes of new tensors alive at once.

    Args:
        params: The model's parameters by id.
        where: The index of the part running now.
        scores: Which tensors are hand-written attention scores.
        backward: Whether a backward is running.
    """

    def __init__(
        self,
        params: Mapping[int, Tensor],
        where: Callable[[], int],
        scores: Scores,
        backward: Callable[[], bool],
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.where, self.scores, self.backward = where, scores, backward
        self.weighty = {key: key for key in params}  # parameters, their views and casts
        self.kept = list(params.values())  # alive, so that no other tensor takes their ids
        self.ops: dict[int, list[Record]] = {}
        self.reads: dict[int, set[int]] = collections.defaultdict(set)
        self.live: dict[int, tuple[int, int]] = {}  # storage id -> (part, bytes)
        self.current: collections.Counter[int] = collections.Counter()
        self.peak: collections.Counter[int] = collections.Counter()
        self.lse: collections.Counter[int] = collections.Counter()  # hand-written attention's

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
        self._track(part, inputs, outputs)
        hand = [t for t in inputs + outputs if self.scores(t)]
        if hand and name not in _MATMULS:
            return out  # inside the fused kernel
        packet = func._overloadpacket
        flops = (
            float(flop_registry[packet](*args, **kwargs, out_val=out))
            if packet in flop_registry
            else 0.0
        )
        if name == "_grouped_mm" and not flops:
            flops = _grouped_mm_flops(inputs[0], inputs[1], outputs[0])
        if hand:  # a multiply of hand-written attention: the fused kernel's share of it
            moved = sum(nbytes(t) for t in inputs + outputs if not self.scores(t))
            if self.backward():
                flops *= FLASH_BACKWARD
            elif not self.scores(outputs[0]):  # scores x values: the kernel keeps its lse
                self.lse[part] += outputs[0].numel() // outputs[0].shape[-1] * 4
            record = Record(ATTENTION, flops, moved, 0.0, True, out=nbytes(outputs[0]))
            self.ops.setdefault(part, []).append(record)
            return out
        moved = sum(nbytes(t) for t in inputs + outputs) - fixed
        kind = ATTENTION if _ATTENTION in name else MATMUL if name in _MATMULS else OTHER
        causal = kind == ATTENTION and bool(_causal(args, kwargs))
        shape, grows = _shape(name, inputs, fixed > 0) if kind == MATMUL else ((0, 0, 0, 0), "")
        written = sum(nbytes(t) for t in outputs)
        self.ops.setdefault(part, []).append(
            Record(kind, flops, moved, fixed, causal, shape, grows, written)
        )
        return out

    def _track(self, part: int, inputs: list[Tensor], outputs: list[Tensor]) -> None:
        """Count each new storage among ``outputs`` under ``part`` until it is freed."""
        owned = {id(t.untyped_storage()) for t in inputs}
        for t in outputs:
            storage = t.untyped_storage()
            key = id(storage)
            if key in self.live or key in owned:  # not new: written in place
                continue
            size = storage.nbytes()
            self.live[key] = (part, size)
            self.current[part] += size
            self.peak[part] = max(self.peak[part], self.current[part])
            weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        part, size = self.live.pop(key, (0, 0))
        self.current[part] -= size

    def take(self) -> tuple[dict[int, list[Record]], collections.Counter[int]]:
        """The ops recorded so far by part, and per part the most bytes of new tensors
        alive at once; both start empty again."""
        ops, self.ops = self.ops, {}
        peak, self.peak = self.peak, collections.Counter(self.current)
        return ops, peak


class FusedDropout(TorchFunctionMode):
    """Dropout as a GPU runs it: one kernel that writes the output and a one-byte mask
    (``native_dropout``), where the CPU and meta decomposition keeps a mask in the
    input's dtype."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not functional.dropout:
            return func(*args, **kwargs)
        p = float(kwargs.get("p", args[1] if len(args) > 1 else 0.5))
        training = bool(kwargs.get("training", args[2] if len(args) > 2 else True))
        if not training or p == 0.0 or kwargs.get("inplace", False):
            return func(*args, **kwargs)
        return torch.ops.aten.native_dropout(args[0], p, True)[0]


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


class MathAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` as a framework without a fused kernel runs it
    (Megatron-LM's core attention): the scores by a batched multiply, one softmax kernel
    (scale and mask fused in), dropout, and a multiply with the values; autograd saves the
    probabilities, the dropout mask and the dropped probabilities (5 bytes a score in
    half precision: Korthikanti et al., *Reducing Activation Recomputation in Large
    Transformer Models*, 2022, section 4.1)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        if k.shape[-3] != q.shape[-3]:  # grouped-query attention: every head its keys
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        scale = kwargs.get("scale") or q.shape[-1] ** -0.5
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        probs = torch.softmax(scores, dim=-1)
        dropout = float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0) or 0.0)
        if dropout:  # the fused kernel, with its one-byte mask (FusedDropout's)
            probs = torch.ops.aten.native_dropout(probs, dropout, True)[0]
        return torch.matmul(probs, v)


class SavedBytes:
    """What autograd saves, per part: each storage once, parameters never, hand-written
    attention scores never (the fused kernel keeps none); also, per part, the saved
    tensors as wide as the hidden states (the runtime's ActivationMeter keys storages by
    data pointer, which meta tensors do not have; here a view's base tensor, kept alive, is
    the key). ``pack`` is the saved-tensors pack hook."""

    def __init__(
        self, params: set[int], where: Callable[[], int], hidden: int, scores: Scores
    ) -> None:
        self.params, self.where, self.hidden, self.scores = params, where, hidden, scores
        self.held: dict[int, Tensor] = {}
        self.bytes: collections.Counter[int] = collections.Counter()
        self.wide: collections.Counter[int] = collections.Counter()

    def pack(self, t: Tensor) -> Tensor:
        """Count ``t``'s storage under the running part, once; ``t`` itself is kept."""
        base = t if t._base is None else t._base
        if id(base) not in self.params and id(base) not in self.held and not self.scores(t):
            self.held[id(base)] = base
            size = base.untyped_storage().nbytes()
            self.bytes[self.where()] += size
            if self.hidden and base.dim() and base.shape[-1] == self.hidden:
                self.wide[self.where()] += size
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


def _shape(
    name: str, inputs: list[Tensor], weighted: bool
) -> tuple[tuple[int, int, int, int], str]:
    """A multiply's (batch, m, n, k) and which of them grows with the tokens: the rows of
    an input multiplied by a weight (or its gradient), the inner dimension of a weight
    gradient (two activations multiplied), the batch of a batched multiply."""
    a, b = (inputs[1], inputs[2]) if name in ("addmm", "baddbmm") else (inputs[0], inputs[1])
    if a.dim() < 2 or b.dim() < 2:
        return (0, 0, 0, 0), ""
    batch = a.shape[0] if a.dim() == 3 and b.dim() == 3 else 1
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if weighted:
        return (batch, m, n, k), "m"
    return (batch, m, n, k), "batch" if batch > 1 else "k"


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
