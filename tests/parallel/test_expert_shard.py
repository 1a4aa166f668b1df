"""Sharding expert collections over ep > 1 in one process: torch's fake process group
stands for a world of 2 (nothing is exchanged: ``shard_experts`` cuts each rank's share
locally). Experts frozen before they are sharded stay frozen, the others trainable, and
rank 0 keeps the first half of every expert tensor. The multi-process runs (the frozen
experts trained through a pipeline, tests/parallel/test_resplit.py) are in the slow lane.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from conveyor.experts import find_experts
from conveyor.experts.shard import shard_experts
from tests.parallel.test_experts import tiny_moe

pytest.importorskip("transformers")


@pytest.fixture
def ep_mesh() -> Iterator[object]:
    """The ``ep`` mesh of a fake world of 2, this process rank 0."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))["ep"]
    finally:
        dist.destroy_process_group()


def test_experts_frozen_before_ep_shards_them_stay_frozen(ep_mesh: object) -> None:
    model = tiny_moe("mixtral", 2)
    collections = find_experts(model.named_modules())
    assert len(collections) == 2
    frozen = collections[0][1]
    for p in frozen.parameters(recurse=False):
        p.requires_grad_(False)
    whole = {
        (name, key): p.detach().clone()
        for name, module in collections
        for key, p in module.named_parameters(recurse=False)
    }
    assert shard_experts(collections, ep_mesh, timeout=10.0) == [n for n, _ in collections]
    for name, module in collections:
        params = dict(module.named_parameters(recurse=False))
        assert params, name
        for key, p in params.items():
            assert p.requires_grad == (module is not frozen), f"{name}.{key}: {p.requires_grad}"
            local = p.to_local()  # type: ignore[attr-defined]
            value = whole[(name, key)]
            assert torch.equal(local, value[: value.shape[0] // 2]), f"{name}.{key}"
