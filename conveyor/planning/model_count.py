"""What counting a model gives: :class:`ModelCount`, its :class:`Part` s and their
:class:`Op` s, per sequence (made by :func:`conveyor.planning.counting.count_model`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The ``dtype`` names a layout takes, and the torch dtype each traces in."""

MATMUL, ATTENTION, OTHER = "matmul", "attention", "other"
ATTENTIONS = ("flash", "math")
"""How attention is counted: as the fused flash kernel, or as written (scores saved)."""


class Record(NamedTuple):
    """One aten operation as traced (the fields of :class:`Op` but its count)."""

    kind: str
    flops: float
    bytes: float
    fixed: float
    causal: bool
    shape: tuple[int, int, int, int] = (0, 0, 0, 0)
    grows: str = ""
    out: float = 0.0


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
        shape: A matrix multiply's (batch, m, n, k): ``batch`` products of an m x k and a
            k x n matrix; zeros for other operations.
        grows: Which of them grows with the tokens: ``"m"`` (the rows of an input or its
            gradient), ``"k"`` (a weight gradient sums over the tokens), ``"batch"``, or
            ``""``.
        out: Bytes of its outputs (of ``bytes``).
    """

    kind: str
    flops: float
    bytes: float
    fixed_bytes: float
    causal: bool
    count: int
    shape: tuple[int, int, int, int] = (0, 0, 0, 0)
    grows: str = ""
    out: float = 0.0


@dataclass(frozen=True)
class Part:
    """One part of the model (the embeddings, a decoder layer, or the head with the loss).

    Attributes:
        name: ``"pre"``, ``"layer"`` or ``"post"``.
        forward, backward, weight: Its operations in F, B and W.
        saved_bytes: What autograd saves in F for the backward, per sequence.
        saved_hidden: Of ``saved_bytes``, the tensors as wide as the hidden states (norm
            and dropout inputs, residuals: on every tensor-parallel rank whole unless
            sequence parallelism splits them).
        workspace: The most bytes of temporaries alive at once during its F or B beyond
            what it saves (the loss's logits in fp32 and their gradient, say).
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
    saved_hidden: float = 0.0
    workspace: float = 0.0


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
        tied_params: Parameters read by both ends (a tied embedding), counted in both parts.
        kv_heads: Key/value heads of its config (``heads`` without grouped-query attention).
        attention: How its attention was counted (:data:`ATTENTIONS`).
    """

    name: str
    seq: int
    dtype: str
    parts: tuple[Part, ...]
    hidden_bytes: float
    heads: int = 0
    tied_params: int = 0
    kv_heads: int = 0
    attention: str = "flash"

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

    def flops(self, phase: str = "all", part: Part | None = None) -> float:
        """FLOPs of one sequence through the whole model, or through ``part``:
        ``"forward"``, ``"backward"`` (B and W) or ``"all"``."""
        phases = {"forward": ("forward",), "backward": ("backward", "weight")}
        chosen = phases.get(phase, ("forward", "backward", "weight"))
        parts = self.parts if part is None else (part,)
        return sum(float(o.flops * o.count) for p in parts for ph in chosen for o in getattr(p, ph))

    def tp_divides_heads(self, tp: int) -> bool:
        """Whether ``tp`` ranks can split the attention heads (and the key/value heads)
        evenly, as tensor parallelism splits them; True when the config names none."""
        return all(n % tp == 0 for n in (self.heads, self.kv_heads) if n)
