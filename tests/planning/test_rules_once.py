"""Rules written once: the rows each rank holds of a split vocabulary (the runtime's
shards, ``print(pipe)`` and the planner's memory all use :func:`rows_per_rank`), and the
part of a DTensor a rank holds."""

from __future__ import annotations

import pytest
import torch

from conveyor.partition.cuts import rows_per_rank
from conveyor.runtime.local_part import local_shard
from conveyor.vocab.shards import chunk_rows
from tests.support import distributed


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_rows_per_rank_is_torch_chunks_largest(ranks: int) -> None:
    for rows in (1, 2, 7, 36, 37, 100, 50257):
        chunks = torch.arange(rows).chunk(ranks)
        assert rows_per_rank(rows, ranks) == len(chunks[0]), (rows, ranks)
        spans = [chunk_rows(rows, ranks, r) for r in range(ranks)]
        assert max(hi - lo for lo, hi in spans) == rows_per_rank(rows, ranks)


def _local_parts(rank: int) -> tuple[list[int], bool]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,))
    whole = torch.arange(6.0).reshape(3, 2)
    part = local_shard(distribute_tensor(whole, mesh, [Shard(0)]))
    plain = torch.ones(2)
    return [type(part).__name__ == "Tensor", bool(torch.equal(part, whole))], (
        local_shard(plain) is plain
    )


def test_local_shard_is_a_dtensors_own_part_and_leaves_tensors() -> None:
    (got,) = distributed.run(_local_parts, 1, fork=True, timeout=60)
    assert got == ([True, True], True)


def test_the_planners_vocabulary_memory_counts_the_ranks_holding_the_most_rows() -> None:
    """5 rows over 2 ranks: the first holds 3 (torch.chunk's), so the planner counts 3/5
    of the layers' bytes (weights, gradients and AdamW's two states: 4 times the weights
    in their own dtype) and logits per rank, not half of them."""
    from conveyor.planning.costs import Costs, UnitCost
    from conveyor.planning.memory import Setting
    from conveyor.planning.vocab import VocabUnits, evaluate_vocab
    from conveyor.schedules import get_schedule

    def unit(i: int, parameters: int) -> UnitCost:
        return UnitCost(f"unit {i}", 1e-3, 1e-3, 1e-3, 1e-3, 2e-3, 100, parameters, 400)

    prof = Costs(tuple(unit(i, 1000) for i in range(6)), 4, 2, 1e-5, 1e9)
    schedule = get_schedule("1f1b", 2, 4)

    def peaks(rows: int) -> list[float]:
        found = VocabUnits(embedding=0, output=5, parameter_bytes=10_000, rows=rows,
                           widening=rows / 8)  # fmt: skip
        return list(evaluate_vocab(schedule, prof, found, None, Setting()).peak_memory)

    even, odd = peaks(4), peaks(5)
    # weights, gradients and states: 4 x (6000 - 5000); logits: 400 x 3/8 - 400 x 2/8
    assert [o - e for o, e in zip(odd, even, strict=True)] == [4 * 1000 + 150 - 100] * 2
