"""``Hardware.measure()`` as the estimate uses it: measured once and cached, and a
measured link's latency and bandwidth taken as they are (no NCCL latencies, no derate)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conveyor.planning import PRESETS, Hardware, machine
from conveyor.planning.collectives import all_gather, all_reduce, p2p

MEASURED = dataclasses.replace(
    PRESETS["h100-sxm"], gpus_per_node=2, intra_node_gbps=2.0, inter_node_gbps=2.0,
    latency_s=1e-4, matmul_table=((64, 256, 0.1),), attention_table=((128, 0.05),),
)  # fmt: skip


def test_a_measured_link_is_its_latency_per_step_and_its_bandwidth() -> None:
    assert p2p(MEASURED, 2e6, True) == pytest.approx(1e-4 + 2e6 / 2e9)
    # a ring of 2: one step each way for the gather, two for the all-reduce
    assert all_gather(MEASURED, 2e6, 2) == pytest.approx(1e-4 + 1e6 / 2e9)
    assert all_reduce(MEASURED, 2e6, 2) == pytest.approx(2e-4 + 2e6 / 2e9)


def test_the_machine_is_measured_once_and_cached_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[object] = []

    def fake(device: object) -> dict[str, object]:
        calls.append(device)
        return dataclasses.asdict(MEASURED)

    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    monkeypatch.setattr(machine, "_measure", fake)
    monkeypatch.setattr(machine, "_MEASURED", {})
    assert Hardware.measure() == MEASURED and len(calls) == 1
    assert Hardware.measure() == MEASURED and len(calls) == 1  # this process's copy
    (saved,) = tmp_path.glob("hardware-*.json")
    monkeypatch.setattr(machine, "_MEASURED", {})
    assert Hardware.measure() == MEASURED and len(calls) == 1  # the file's
    assert Hardware.measure(refresh=True) == MEASURED and len(calls) == 2
    assert saved.exists()
