"""The box of a tensor a rank holds (:func:`conveyor.weights.parts.held_part`), on real
processes: for each placement over a 2 x 2 mesh, of uneven sizes, on the meta device and
off it, the whole tensor cut to the box is exactly the DTensor's local shard, so that a
checkpoint read of the box gives each rank exactly what it keeps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support import distributed

pytestmark = pytest.mark.multiprocess

SHAPE = (7, 5)  # uneven over 2 and over 4


def _boxes(rank: int) -> list[Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from conveyor.weights.parts import held_part

    dist.init_process_group("gloo")
    mesh = dist.device_mesh.init_device_mesh("cpu", (2, 2))
    whole = torch.arange(35.0).view(SHAPE)
    out = []
    for placements in ([Shard(0), Shard(0)], [Shard(0), Shard(1)], [Shard(1), Shard(0)],
                       [Replicate(), Shard(1)], [Shard(1), Shard(1)],
                       [Replicate(), Replicate()]):  # fmt: skip
        real = distribute_tensor(whole, mesh, placements, src_data_rank=None)
        meta = distribute_tensor(torch.empty(SHAPE, device="meta"), mesh, placements)
        box = held_part(real)
        out.append((str(placements), box, held_part(meta), real.to_local().clone()))
    partial = DTensor.from_local(whole, mesh, [Replicate(), Partial()], run_check=False)
    out.append(("partial", held_part(partial), None, None))
    out.append(("plain", held_part(whole), None, None))
    return out


def test_the_box_a_rank_holds_is_its_shard_of_the_whole() -> None:
    whole = torch.arange(35.0).view(SHAPE)
    for rank, boxes in enumerate(distributed.run(_boxes, 4, fork=True)):
        for what, box, meta_box, local in boxes:
            if what in ("partial", "plain"):
                assert box is None, what  # read whole, then cut as before
                continue
            assert box is not None and box == meta_box, (rank, what)
            assert torch.equal(whole[box], local), (rank, what, box)
