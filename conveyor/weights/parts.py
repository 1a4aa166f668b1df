"""The part of a tensor a rank holds, as a box of the whole (one index range per
dimension): what a sharded parameter (an FSDP or tensor-parallel shard, vocabulary rows,
a range of experts: a DTensor) keeps of the whole tensor, so that only that part is read
from a checkpoint.

The ranges are DTensor's own: for each dimension, a 1-D ``arange`` of its length is cut by
``distribute_tensor`` with the placements that shard that dimension (in their order, so
nested and strided shards of one dimension come out as they do for the tensor itself),
locally (``src_data_rank=None``, no communication). A part that is not one range per
dimension, or a placement of another kind, gives None: the tensor is read whole and cut.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from conveyor.weights.plan import Slot
from conveyor.weights.safetensors_file import Part


def held_part(target: Tensor) -> Part | None:
    """The box of the whole tensor that ``target`` (a DTensor, possibly on the meta device)
    holds on this rank; None for a plain tensor, or where the part is not a box."""
    mesh = getattr(target, "device_mesh", None)
    if mesh is None:
        return None
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    assert isinstance(target, DTensor)
    placements = target.placements
    part = []
    for dim, length in enumerate(target.shape):
        along: list[Any] = []
        for p in placements:
            if p.is_replicate() or (p.is_shard() and not p.is_shard(dim)):
                along.append(Replicate())  # another dimension's shard: not this one's
            elif p.is_shard(dim) and dim == 0:
                along.append(p)  # as it is (a strided shard included): dim 0 of the arange
            elif p.is_shard(dim) and type(p) is Shard:
                along.append(Shard(0))
            else:
                return None  # a partial sum, or a strided shard of another dimension
        if all(p.is_replicate() for p in along):
            part.append(slice(0, length))
            continue
        indices = distribute_tensor(torch.arange(length), mesh, along, src_data_rank=None)
        held = indices.to_local().cpu()
        lo = int(held[0]) if held.numel() else 0
        if not torch.equal(held, torch.arange(lo, lo + held.numel())):
            return None
        part.append(slice(lo, lo + held.numel()))
    box = tuple(part)
    if tuple(s.stop - s.start for s in box) != tuple(target.to_local().shape):
        return None
    return box


def part_of(slots: list[Slot]) -> Part | None:
    """The box every slot of one tensor holds (None: some slot needs the whole tensor, or
    they hold different parts)."""
    parts = {_key(held_part(slot.get())) for slot in slots}
    if len(parts) != 1:
        return None
    (key,) = parts
    return None if key is None else tuple(slice(lo, hi) for lo, hi in key)


def _key(part: Part | None) -> tuple[tuple[int, int], ...] | None:
    return None if part is None else tuple((s.start, s.stop) for s in part)


def size(part: Part) -> int:
    """The elements of a box."""
    count = 1
    for s in part:
        count *= s.stop - s.start
    return count
