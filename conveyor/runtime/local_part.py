"""The part of a tensor this rank holds, in one place for every caller (FSDP and
tensor-parallel parameters, and whatever the layers above shard as DTensors)."""

from __future__ import annotations

import torch


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (a view of its data); other tensors as they are.

    Tested by ``isinstance``, which ``torch.compile`` traces (a ``getattr(t, "to_local")``
    probe is not), so the compiled expert dispatch uses it too.
    """
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
