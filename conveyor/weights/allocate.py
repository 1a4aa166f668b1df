"""Memory for meta tensors that another owner manages: FSDP2 keeps its shards in storage
of its own, which only ``to_empty`` (FSDP-aware) allocates."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def allocate_sharded(stages: Iterable[nn.Module], device: torch.device) -> None:
    """``to_empty`` each stage (FSDP shards get their storage, uninitialized), keeping the
    values of the tensors that were already real: ``to_empty`` would discard them."""
    for stage in stages:
        real: list[tuple[nn.Module, str, bool, Any]] = [
            (holder, key, param, value)
            for holder in stage.modules()
            for param, store in ((True, holder._parameters), (False, holder._buffers))
            for key, value in store.items()
            if value is not None and not value.is_meta
        ]
        stage.to_empty(device=device)
        with torch.no_grad():
            for holder, key, param, value in real:
                now: Any = (holder._parameters if param else holder._buffers)[key]
                if hasattr(now, "device_mesh"):
                    local = value.to_local() if hasattr(value, "device_mesh") else value
                    now.to_local().copy_(local)
                else:
                    now.copy_(value)
