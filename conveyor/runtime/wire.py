"""What goes over the wire: a value's tensors plus a small, cacheable description."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

HEADER_BYTES = 8192


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and whether the receiver should track gradients for one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class ValueMeta:
    """The structure of a stage's output: a pytree spec, tensor metas, and constants.

    Constants are the non-tensor leaves; they travel inside the header, so a value whose
    constants change while the input shapes do not is reported rather than sent stale.
    """

    spec: pytree.TreeSpec
    leaves: tuple[TensorMeta | tuple[str, Any], ...]

    @property
    def tensors(self) -> list[TensorMeta]:
        """Metas of the tensor leaves, in wire order."""
        return [m for m in self.leaves if isinstance(m, TensorMeta)]


# The spec of a value that is one tensor (the common stage output), made once.
_ONE_TENSOR = pytree.tree_flatten(torch.empty(0))[1]


def describe(value: Any) -> tuple[ValueMeta, list[torch.Tensor]]:
    """Split ``value`` into its wire description and the tensors to send."""
    if isinstance(value, torch.Tensor):
        meta = TensorMeta(tuple(value.shape), value.dtype, value.requires_grad)
        return ValueMeta(_ONE_TENSOR, (meta,)), [value.detach().contiguous()]
    leaves, spec = pytree.tree_flatten(value)
    metas: list[TensorMeta | tuple[str, Any]] = []
    tensors: list[torch.Tensor] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            metas.append(TensorMeta(tuple(leaf.shape), leaf.dtype, leaf.requires_grad))
            tensors.append(leaf.detach().contiguous())
        else:
            metas.append(("const", leaf))
    return ValueMeta(spec, tuple(metas)), tensors


def rebuild(meta: ValueMeta, tensors: list[torch.Tensor]) -> Any:
    """The value described by ``meta`` with ``tensors`` in its tensor leaves."""
    if meta.spec.is_leaf() and len(tensors) == 1:
        return tensors[0]
    it = iter(tensors)
    leaves = [next(it) if isinstance(m, TensorMeta) else m[1] for m in meta.leaves]
    return pytree.tree_unflatten(leaves, meta.spec)


def encode_header(meta: ValueMeta, where: str) -> torch.Tensor:
    """``meta`` as a fixed-size byte tensor (sent only when shapes are new)."""
    payload = pickle.dumps((pytree.treespec_dumps(meta.spec), meta.leaves))
    if len(payload) + 8 > HEADER_BYTES:
        raise ValueError(
            f"{where} outputs too many values to describe in {HEADER_BYTES} bytes; "
            f"return fewer tensors or constants from this stage"
        )
    out = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    out[:8] = torch.tensor(list(len(payload).to_bytes(8, "little")), dtype=torch.uint8)
    out[8 : 8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return out


def decode_header(header: torch.Tensor) -> ValueMeta:
    """Inverse of :func:`encode_header`."""
    raw = header.cpu().numpy().tobytes()
    size = int.from_bytes(raw[:8], "little")
    spec, leaves = pickle.loads(raw[8 : 8 + size])
    return ValueMeta(pytree.treespec_loads(spec), leaves)
