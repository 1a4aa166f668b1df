"""``Hardware.measure()`` as the estimate uses it: measured once and cached, a measured
link's latency and bandwidth taken as they are (no NCCL latencies, no derate), element-wise
rates by the bytes an operation moves, and every kernel timed on operands cycled beyond the
cache."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from conveyor.planning import PRESETS, Hardware, machine
from conveyor.planning.collectives import all_gather, all_reduce, p2p

MEASURED = dataclasses.replace(
    PRESETS["h100-sxm"], gpus_per_node=2, intra_node_gbps=2.0, inter_node_gbps=2.0,
    latency_s=1e-4, matmul_table=((64, 256, 0.1),), attention_table=((128, 0.05),),
    bandwidth_table=((1e5, 40.0), (4e5, 20.0)),
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


def test_an_operation_moves_its_bytes_at_the_measured_rate_for_its_size() -> None:
    # 40 GB/s at 100 kB, 20 at 400 kB: log-linear between (30 at 200 kB), flat beyond
    assert MEASURED.memory_seconds(1e5) == pytest.approx(1e5 / 40e9)
    assert MEASURED.memory_seconds(2e5) == pytest.approx(2e5 / 30e9)
    assert MEASURED.memory_seconds(1e3) == pytest.approx(1e3 / 40e9)
    assert MEASURED.memory_seconds(1e9) == pytest.approx(1e9 / 20e9)
    sheet = PRESETS["h100-sxm"]  # no table: HBM's achievable rate
    assert sheet.memory_seconds(1e9) == pytest.approx(1e9 / (sheet.memory_efficiency * 3350e9))


def test_each_timing_cycles_through_operands_beyond_the_cache() -> None:
    made: list[list[torch.Tensor]] = []
    used: list[int] = []

    def make() -> list[torch.Tensor]:
        made.append([torch.empty(1 << 18)])  # 1 MiB
        return made[-1]

    call = machine.cycling(lambda t: used.append(id(t)), make)
    assert len(made) == machine.POOL_BYTES // (1 << 20)  # together the pool's bytes
    for _ in range(2 * len(made)):
        call()
    assert len(set(used)) == len(made)  # every set in turn, none twice running
    assert all(a != b for a, b in itertools.pairwise(used))
    assert used[: len(made)] == used[len(made) :]
    made.clear()
    machine.cycling(lambda t: None, lambda: made.append([torch.empty(1)]) or made[-1])
    assert len(made) == machine.MAX_SETS  # tiny operands: as many sets as it allows
    made.clear()
    machine.cycling(lambda t: None, lambda: made.append([torch.empty(1 << 25)]) or made[-1])
    assert len(made) == 2  # 128 MiB each: two still alternate
