"""A causal language model counted on the meta device: FLOPs, bytes and saved activations
per part, for one sequence, without a single real tensor.

The model (a transformers config, built here on the meta device, or a model already on
it) runs one forward with its loss and two backwards under a dispatch mode that records
every aten operation: its FLOPs by torch's own formulas (the table behind
``torch.utils.flop_counter.FlopCounterMode``), the bytes it reads and writes, and which of
those are parameters. The parts are the model's decoder layers and what comes before them
(``pre``: the embeddings) and after (``post``: final norm, head and loss), told apart by
hooks on the layers' inputs and outputs.

- F: the forward and loss.
- B: the gradients with respect to every layer's input only (``autograd.grad`` on those
  tensors; autograd then skips every weight gradient).
- W: the whole backward less B, operation by operation: exactly the weight-gradient work.

What autograd saves for the backward is counted per part through
``saved_tensors_hooks`` (a storage once, parameters never), which is what the runtime's
:class:`~conveyor.runtime.memory.ActivationMeter` counts on a real step.

Attention is counted as the fused kernel GPUs run (``scaled_dot_product_attention`` taken
to the flash kernel's aten op, which saves its output and log-sum-exp instead of the
sequence x sequence scores): on the meta device SDPA would otherwise fall back to its math
form. Everything scales linearly with the micro-batch size (:mod:`~conveyor.planning.estimate`
multiplies), so one sequence is traced.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as functional
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from conveyor.errors import ConfigError
from conveyor.partition.experts import is_experts_collection, num_experts

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The ``dtype`` names a layout takes, and the torch dtype each traces in."""

MATMUL, ATTENTION, OTHER = "matmul", "attention", "other"
Record = tuple[str, float, float, float, bool]  # an op's kind, flops, bytes, fixed bytes, causal
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "matmul", "linear"}
_ATTENTION = "attention"  # in the name of every fused attention op, forward and backward


@dataclass(frozen=True)
class Op:
    """One kind of aten operation of a part, for one sequence.

    Attributes:
        kind: ``"matmul"``, ``"attention"`` (a fused attention kernel) or ``"other"``.
        flops: Its FLOPs (torch's formula; full attention, as FlopCounterMode counts it).
        bytes: Bytes of activations it reads and writes (they grow with the batch).
        fixed_bytes: Bytes of parameters it reads (they do not).
        causal: A fused attention with a causal mask (its kernel skips half the scores).
        count: How many times the part runs it.
    """

    kind: str
    flops: float
    bytes: float
    fixed_bytes: float
    causal: bool
    count: int


@dataclass(frozen=True)
class Part:
    """One part of the model (the embeddings, a decoder layer, or the head with the loss).

    Attributes:
        name: ``"pre"``, ``"layer"`` or ``"post"``.
        forward, backward, weight: Its operations in F, B and W.
        saved_bytes: What autograd saves in F for the backward, per sequence.
        params: Its parameters (a tied weight counts in every part that reads it).
        param_tensors: How many parameter tensors those are.
        expert_params: Of ``params``, those in expert collections (split over ``ep``).
        experts: The expert count of its mixture-of-experts layer (0 without one).
        routed_bytes: The hidden states its experts receive, per sequence: each token once
            per expert it is routed to (what an expert all-to-all moves each way).
    """

    name: str
    forward: tuple[Op, ...]
    backward: tuple[Op, ...]
    weight: tuple[Op, ...]
    saved_bytes: float
    params: int
    param_tensors: int
    expert_params: int
    experts: int
    routed_bytes: float = 0.0


@dataclass(frozen=True)
class ModelCount:
    """A model counted for one sequence of ``seq`` tokens in ``dtype``.

    Attributes:
        name: The model's class name.
        seq: Tokens per sequence.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        parts: ``pre``, one :class:`Part` per decoder layer, ``post``.
        hidden_bytes: Bytes of one token's hidden state (what a layer passes on).
        heads: Attention heads of its config (0 if it has none to read).
    """

    name: str
    seq: int
    dtype: str
    parts: tuple[Part, ...]
    hidden_bytes: float
    heads: int = 0

    @property
    def layers(self) -> tuple[Part, ...]:
        """The decoder layers' parts."""
        return self.parts[1:-1]

    @property
    def params(self) -> int:
        """Parameters of the model (a tied weight once)."""
        return sum(p.params for p in self.parts) - self.tied_params

    @functools.cached_property
    def forward_flops(self) -> tuple[float, float]:
        """FLOPs of one sequence's forward: (the whole model's, the decoder layers')."""
        layers = sum(self.flops("forward", p) for p in self.layers)
        return self.flops("forward"), layers

    tied_params: int = 0
    """Parameters read by both ends (a tied embedding), counted in both parts."""

    def flops(self, phase: str = "all", part: Part | None = None) -> float:
        """FLOPs of one sequence through the whole model, or through ``part``:
        ``"forward"``, ``"backward"`` (B and W) or ``"all"``."""
        phases = {"forward": ("forward",), "backward": ("backward", "weight")}
        chosen = phases.get(phase, ("forward", "backward", "weight"))
        parts = self.parts if part is None else (part,)
        return sum(float(o.flops * o.count) for p in parts for ph in chosen for o in getattr(p, ph))


def count_model(model: Any, seq: int, dtype: str = "bf16") -> ModelCount:
    """Count ``model`` for one sequence of ``seq`` tokens (see the module docstring).

    Args:
        model: A transformers config of a causal language model, or such a model built
            under :func:`conveyor.empty_weights` (or on the meta device).
        seq: Tokens per sequence.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``.

    Returns:
        The counts; the same object for the same config, ``seq`` and ``dtype``.

    Raises:
        ConfigError: For a model that is neither, one with no decoder-layer list, or a
            model whose forward does not take ``input_ids`` and ``labels``.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if seq < 1:
        raise ConfigError(f"seq must be >= 1, got {seq}")
    if isinstance(model, nn.Module):
        return _count(_on_meta(model, dtype), seq, dtype)
    return _count_config(_ConfigKey(model), seq, dtype)


class _ConfigKey:
    """A config hashed by its contents, so a config counted once is not counted again."""

    def __init__(self, config: Any) -> None:
        if not hasattr(config, "to_json_string"):
            raise ConfigError(
                f"cannot count a {type(config).__name__}; pass a transformers config "
                "(AutoConfig.for_model(...)) or a model built under conveyor.empty_weights()"
            )
        self.config = config
        self.key = config.to_json_string()

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ConfigKey) and other.key == self.key


@functools.lru_cache(maxsize=16)
def _count_config(key: _ConfigKey, seq: int, dtype: str) -> ModelCount:
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(key.config)
    config._attn_implementation = "sdpa"
    _training(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.tie_weights()  # transformers 5.0 leaves a model built on meta untied
    return _count(model.to(DTYPES[dtype]), seq, dtype)


def _on_meta(model: nn.Module, dtype: str) -> nn.Module:
    if any(not p.is_meta for p in model.parameters()):
        raise ConfigError(
            "count a model on the meta device: build it under conveyor.empty_weights(), "
            "or pass its transformers config"
        )
    copied = copy.deepcopy(model)
    _training(getattr(copied, "config", None))
    return copied.to(device="meta", dtype=DTYPES[dtype])


def _training(config: Any) -> None:
    """Count the model as it trains: without a key/value cache (the cache's update copies
    keys and values, which then take more saved memory than views of a fused projection)."""
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False


@contextlib.contextmanager
def _one_sequence() -> Iterator[None]:
    """Without a cache, transformers' masks look for sequences packed into one row of
    position ids, a branch on tensor values that the meta device cannot take; the traced
    row is one sequence, which is that function's answer for no packing (None)."""
    masking = sys.modules.get("transformers.masking_utils")  # imported by such a model
    found = getattr(masking, "find_packed_sequence_indices", None)
    if found is not None:
        masking.find_packed_sequence_indices = lambda position_ids: None  # type: ignore[union-attr]
    try:
        yield
    finally:
        if found is not None:
            masking.find_packed_sequence_indices = found  # type: ignore[union-attr]


@contextlib.contextmanager
def _no_autocast_on_meta() -> Iterator[None]:
    """Older transformers (5.0) ask ``torch.is_autocast_enabled(device.type)`` of the rotary
    embedding's device, which torch rejects for ``"meta"``; there is no autocast there."""
    asked = torch.is_autocast_enabled

    def enabled(*args: Any) -> bool:
        return False if args and args[0] == "meta" else bool(asked(*args))

    torch.is_autocast_enabled = enabled  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.is_autocast_enabled = asked


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: its longest list of modules of one class.

    Raises:
        ConfigError: If it has no such list of two or more.
    """
    lists = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1
    ]
    if not lists:
        raise ConfigError(
            f"{type(model).__name__} has no list of decoder layers (an nn.ModuleList of one "
            "class) to count; pass a transformers causal language model"
        )
    return max(lists, key=len)


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Every aten op: into the current part's list, as (kind, flops, bytes, fixed, causal)."""

    def __init__(self, params: Mapping[int, Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.weighty = {key: key for key in params}  # parameters, their views and casts
        self.kept = list(params.values())  # alive, so that no other tensor takes their ids
        self.part = 0
        self.ops: dict[int, list[Record]] = {}
        self.reads: dict[int, set[int]] = collections.defaultdict(set)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [a for a in _tensors((args, kwargs))]
        outputs = list(_tensors(out))
        name = func._overloadpacket.__name__
        roots = {self.weighty[id(t)] for t in inputs if id(t) in self.weighty}
        fixed = sum(_bytes(t) for t in inputs if id(t) in self.weighty)
        self.reads[self.part].update(roots)
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
        moved = sum(_bytes(t) for t in inputs + outputs) - fixed
        kind = ATTENTION if _ATTENTION in name else MATMUL if name in _MATMULS else OTHER
        causal = kind == ATTENTION and bool(_causal(args, kwargs))
        self.ops.setdefault(self.part, []).append((kind, flops, moved, fixed, causal))
        return out


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


def _tensors(tree: Any) -> Iterator[Tensor]:
    if isinstance(tree, Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def _bytes(t: Tensor) -> float:
    return float(t.numel() * t.element_size())


class _FlashAttention(TorchFunctionMode):
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


class _Saved:
    """What autograd saves, per part: each storage once, parameters never (the runtime's
    ActivationMeter keys storages by data pointer, which meta tensors do not have; here a
    view's base tensor, kept alive, is the key)."""

    def __init__(self, params: set[int], recorder: _Recorder) -> None:
        self.params = params
        self.recorder = recorder
        self.held: dict[int, Tensor] = {}
        self.bytes: collections.Counter[int] = collections.Counter()

    def pack(self, t: Tensor) -> Tensor:
        base = t if t._base is None else t._base
        if id(base) not in self.params and id(base) not in self.held:
            self.held[id(base)] = base
            self.bytes[self.recorder.part] += base.untyped_storage().nbytes()
        return t


@dataclass
class _Trace:
    """The hooks' view of a run: the layers' inputs and outputs, in order."""

    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)


def _count(model: nn.Module, seq: int, dtype: str) -> ModelCount:
    layers = decoder_layers(model)
    everything = list(layers)
    traced, stands_for = _representatives(everything)
    expert_owner = _expert_params(model)
    layer_params = [{id(p): p for p in layer.parameters()} for layer in everything]
    outside = {id(p): p for p in model.parameters()}
    for owned in layer_params:
        for key in owned:
            outside.pop(key, None)
    kept = layers._modules.copy()
    layers._modules = collections.OrderedDict((str(j), everything[i]) for j, i in enumerate(traced))
    try:
        run = _run(model, list(layers), seq)
    finally:
        layers._modules = kept
    n = len(everything)
    # Layers alike share one Part object (and the estimate's per-part times with it).
    made = {
        i: _part(run, j + 1, "layer", layer_params[i], expert_owner) for j, i in enumerate(traced)
    }
    parts = [_part(run, 0, "pre", outside, expert_owner)]
    parts += [made[stands_for[i]] for i in range(n)]
    parts.append(_part(run, len(traced) + 1, "post", outside, expert_owner))
    both = run.reads.get(0, set()) & run.reads.get(len(traced) + 1, set())
    return ModelCount(
        name=type(model).__name__,
        seq=seq,
        dtype=dtype,
        parts=tuple(parts),
        hidden_bytes=run.hidden / seq,
        heads=_heads(model),
        tied_params=sum(p.numel() for k, p in outside.items() if k in both),
    )


def _representatives(layers: list[nn.Module]) -> tuple[list[int], list[int]]:
    """The layers to trace, and for every layer the traced one that stands for it.

    Layers alike (one class, the same parameter shapes, the same attention type) cost the
    same, so the first two of each kind are traced (the first also carries what all
    layers share, such as rotary tables) and later ones take the second's counts.
    """
    seen: dict[Any, list[int]] = {}
    stands_for = []
    for i, layer in enumerate(layers):
        shapes = tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())
        kind = (type(layer), shapes, getattr(layer, "attention_type", None))
        found = seen.setdefault(kind, [])
        if len(found) < 2:
            found.append(i)
        stands_for.append(i if found[-1] == i else found[-1])
    return sorted(i for found in seen.values() for i in found), stands_for


@dataclass
class _Run:
    """What one traced forward and its two backwards recorded, by part index."""

    forward: dict[int, list[Record]]
    backward: dict[int, list[Record]]
    whole: dict[int, list[Record]]
    saved: collections.Counter[int]
    routed: collections.Counter[int]
    reads: dict[int, set[int]]
    hidden: float


def _run(model: nn.Module, layers: list[nn.Module], seq: int) -> _Run:
    n = len(layers)
    params = {id(p): p for p in model.parameters()}
    recorder = _Recorder(params)
    saved = _Saved(set(params), recorder)
    trace = _Trace()
    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(_enter(recorder, trace, i + 1)))
        handles.append(layer.register_forward_hook(_leave(recorder, trace, i + 2)))
    routed: collections.Counter[int] = collections.Counter()
    for module in model.modules():
        if is_experts_collection(module):
            handles.append(module.register_forward_pre_hook(_route(recorder, routed)))
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    try:
        with (
            _one_sequence(),
            _no_autocast_on_meta(),
            _FlashAttention(),
            recorder,
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t),
        ):
            loss = _loss(model, ids)
        forward = dict(recorder.ops)
        reads = {k: set(v) for k, v in recorder.reads.items()}
        # Backward hooks: the grad of a layer's output starts its part; of its input, ends it.
        for i, (x, y) in enumerate(zip(trace.inputs, trace.outputs, strict=True)):
            y.register_hook(_mark(recorder, i + 1))  # type: ignore[no-untyped-call]
            x.register_hook(_mark(recorder, i))  # type: ignore[no-untyped-call]
        recorder.ops = {}
        recorder.part = n + 1
        with _FlashAttention(), recorder:
            torch.autograd.grad(loss, trace.inputs, retain_graph=True)
        backward = dict(recorder.ops)
        recorder.ops = {}
        recorder.part = n + 1
        wanted = [p for p in model.parameters() if p.requires_grad]
        with _FlashAttention(), recorder:
            torch.autograd.grad(loss, [*trace.inputs, *wanted], allow_unused=True)
        whole = dict(recorder.ops)
    finally:
        for h in handles:
            h.remove()
    return _Run(forward, backward, whole, saved.bytes, routed, reads, _bytes(trace.inputs[0]))


def _part(
    run: _Run, index: int, name: str, params: Mapping[int, Tensor], expert_owner: dict[int, int]
) -> Part:
    """Part ``index`` of a run; outside the layers, only the parameters it read."""
    if name != "layer":
        params = {k: p for k, p in params.items() if k in run.reads.get(index, ())}
    return Part(
        name=name,
        forward=_ops(run.forward.get(index, [])),
        backward=_ops(run.backward.get(index, [])),
        weight=_ops(_minus(run.whole.get(index, []), run.backward.get(index, []))),
        saved_bytes=float(run.saved[index]),
        params=sum(p.numel() for p in params.values()),
        param_tensors=len(params),
        expert_params=sum(p.numel() for k, p in params.items() if k in expert_owner),
        experts=max((expert_owner[k] for k in params if k in expert_owner), default=0),
        routed_bytes=float(run.routed[index]),
    )


def _loss(model: nn.Module, ids: Tensor) -> Tensor:
    try:
        out = model(input_ids=ids, labels=ids)
    except TypeError as error:
        raise ConfigError(
            f"{type(model).__name__} does not take input_ids and labels ({error}); "
            "count a transformers causal language model"
        ) from None
    loss = (
        out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else getattr(out, "loss", None)
    )
    if not isinstance(loss, Tensor):
        raise ConfigError(
            f"{type(model).__name__} returned no loss for labels; count a causal language model"
        )
    return loss


def _enter(recorder: _Recorder, trace: _Trace, part: int) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        recorder.part = part
        trace.inputs.append(next(_tensors(args)))

    return hook


def _leave(recorder: _Recorder, trace: _Trace, part: int) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, out: Any) -> None:
        recorder.part = part
        trace.outputs.append(next(_tensors(out)))

    return hook


def _route(recorder: _Recorder, routed: collections.Counter[int]) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        hidden, chosen = args[0], args[1]  # the experts interface: (states, top-k index, ...)
        routed[recorder.part] += int(_bytes(hidden) * chosen.shape[-1])

    return hook


def _mark(recorder: _Recorder, part: int) -> Callable[[Tensor], None]:
    def hook(grad: Tensor) -> None:
        recorder.part = part

    return hook


def _ops(records: list[Record]) -> tuple[Op, ...]:
    counts = collections.Counter(records)
    return tuple(Op(*key, count=c) for key, c in counts.items())


def _minus(
    whole: list[Record],
    part: list[Record],
) -> list[Record]:
    left = collections.Counter(whole)
    left.subtract(collections.Counter(part))
    return list(left.elements())


def _expert_params(model: nn.Module) -> dict[int, int]:
    """Parameter id -> expert count, for the parameters of expert collections."""
    found: dict[int, int] = {}
    for module in model.modules():
        if is_experts_collection(module):
            for p in module.parameters():
                found[id(p)] = int(num_experts(module) or 0)
    return found


def _heads(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    for name in ("num_attention_heads", "n_head"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return 0
