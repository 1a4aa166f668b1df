"""The FSDP2 internals conveyor reads (conveyor/runtime/fsdp_state.py) as each torch it
admits names them: a list of param groups (torch 2.13), one or none (earlier), neither (a
torch that renamed them: a ConfigError naming the versions that work)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conveyor.errors import ConfigError
from conveyor.runtime import fsdp_state


def test_param_groups_under_each_torchs_names() -> None:
    a, b = object(), object()
    assert fsdp_state.param_groups(SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]
    assert fsdp_state.param_groups(SimpleNamespace(_fsdp_param_group=a)) == [a]
    assert fsdp_state.param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
    with pytest.raises(ConfigError, match=r"use torch 2\.10 to 2\.13, or run without fsdp"):
        fsdp_state.param_groups(SimpleNamespace())


def test_the_reduction_runs_every_group_then_the_final_callback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    group = SimpleNamespace(post_backward=lambda: calls.append("group"))
    inner = SimpleNamespace(_fsdp_param_group=group)
    root = SimpleNamespace(
        _fsdp_param_groups=[group],
        _state_ctx=SimpleNamespace(all_states=[inner, inner]),
        _root_post_backward_final_callback=lambda: calls.append("final"),
    )
    monkeypatch.setattr(fsdp_state, "_state", lambda module: root)
    fsdp_state.reduce_gradients(None)  # type: ignore[arg-type]
    assert calls == ["group", "group", "final"]
    monkeypatch.setattr(fsdp_state, "_state", lambda module: SimpleNamespace())
    with pytest.raises(ConfigError, match="post-backward reduction"):
        fsdp_state.reduce_gradients(None)  # type: ignore[arg-type]


def test_a_real_fsdp_unit_has_its_groups_found() -> None:
    """On the installed torch: one FSDP unit over a one-rank mesh has one param group."""
    import os

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        unit = fully_shard(nn.Linear(4, 4), mesh=mesh)
        assert len(fsdp_state.unit_param_groups(unit)) == 1
        unit(torch.randn(2, 4)).sum().backward()
        assert unit.weight.grad is not None
    finally:
        dist.destroy_process_group()
