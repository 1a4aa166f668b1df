"""``conveyor.init(backend=...)`` where a default process group exists (as under
Lightning, or a script that made its own): the same backend, or none, is that group's;
another raises instead of being silently ignored."""

from __future__ import annotations

import torch.distributed as dist

import conveyor
from tests.support import distributed


def _backends(rank: int, made: str) -> dict[str, str]:
    dist.init_process_group(made)  # before conveyor.init, from the launch environment
    out: dict[str, str] = {}
    for asked in ("nccl", "gloo", None):
        try:
            ctx = conveyor.init(backend=asked)
            out[str(asked)] = f"ok {ctx.backend} {ctx.world_size}"
        except conveyor.ConfigError as e:
            out[str(asked)] = str(e)
    return out


def test_a_backend_the_existing_group_lacks_is_refused() -> None:
    (got,) = distributed.run(_backends, 1, "gloo", fork=True, timeout=60)
    assert got["nccl"] == (
        "backend='nccl' cannot be honoured: the default process group already exists with "
        "backend 'gloo' (made before conveyor.init, e.g. by Lightning or the script); pass "
        "backend='gloo' or none, or make the group with 'nccl'"
    )
    assert got["gloo"] == "ok gloo 1"
    assert got["None"] == "ok gloo 1"


def test_a_group_of_backends_per_device_honours_each() -> None:
    (got,) = distributed.run(_backends, 1, "cpu:gloo", fork=True, timeout=60)
    assert got["gloo"].startswith("ok "), got
    assert got["nccl"].startswith("backend='nccl' cannot be honoured"), got
