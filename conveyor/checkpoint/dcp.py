"""Around ``torch.distributed.checkpoint`` (DCP): values in and out, warnings, errors."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def pack(value: Any) -> Any:
    """A tensor as is (detached); anything else pickled into one opaque blob, so that DCP
    does not flatten a dict (a module's extra state, say) into keys of its own."""
    if isinstance(value, Tensor):
        return value.detach()
    blob = io.BytesIO()
    torch.save(value, blob)
    return blob.getvalue()


def unpack(value: Any) -> Any:
    """What :func:`pack` stored, back."""
    if isinstance(value, bytes):
        return torch.load(io.BytesIO(value), weights_only=False)
    return value


def empty_for(md: Any) -> Any:
    """A tensor to load a stored tensor into, or a placeholder for a stored object."""
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    return None


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a DTensor (FSDP / tensor-parallel shards)."""
    return isinstance(value, Tensor) and hasattr(value, "placements")


def empty_like_for(md: Any, param: Any) -> Any:
    """Where to load a parameter's stored optimizer state: sharded like the parameter when
    it is a DTensor of the same shape (AdamW's moments), else as :func:`empty_for`."""
    if (
        is_sharded(param)
        and isinstance(md, TensorStorageMetadata)
        and tuple(md.size) == tuple(param.shape)
    ):
        return torch.empty_like(param, dtype=md.properties.dtype)
    return empty_for(md)
