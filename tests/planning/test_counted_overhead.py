"""The runtime's cost per action as ``Hardware.measure()`` finds it and the counted
estimate uses it, and the CPU clock the machine's kernels are timed in."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from conveyor.planning import PRESETS, Hardware, Layout, estimate, machine
from conveyor.runtime.timing import Timing
from tests.support import distributed

transformers = pytest.importorskip("transformers")

CONFIG = transformers.LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
    tie_word_embeddings=False,
)  # fmt: skip
HW = dataclasses.replace(PRESETS["h100-sxm"], name="test")


def test_one_rank_s_seconds_per_action_leave_out_its_waits() -> None:
    # F 0-1 s, a wait 1-3 s, B 3-4 s, W 4-4.2 s, F 4.5-5 s: 5 s, 2 of them waiting, over
    # 3 actions F and B (W's time is the rank's time, W itself no F or B)
    actions = [Timing(0, "F", 0, 0, 0.0, 1.0), Timing(0, "B", 0, 0, 3.0, 4.0),
               Timing(0, "W", 0, 0, 4.0, 4.2), Timing(0, "F", 0, 1, 4.5, 5.0)]  # fmt: skip
    waits = [Timing(0, "B", 1, 0, 1.0, 3.0), Timing(0, "F", 1, 1, 5.0, 6.0)]  # last: after
    assert machine.per_action(actions, waits) == pytest.approx((5.0 - 2.0) / 3)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_every_f_and_b_of_the_estimate_costs_the_runtime_s_overhead(schedule: str) -> None:
    layout = Layout(2, schedule=schedule, chunks=2 if schedule == "zbv" else 1,
                    global_batch=8, seq=64, dtype="fp32", optimizer="sgd")  # fmt: skip
    plain = estimate(CONFIG, hardware=HW, layout=layout)
    slow = estimate(CONFIG, hardware=dataclasses.replace(HW, action_overhead=1e-3), layout=layout)
    assert slow.balance == plain.balance
    for (f0, b0, w0), (f1, b1, w1) in zip(plain.stage_times, slow.stage_times, strict=True):
        assert (f1 - f0, b1 - b0, w1 - w0) == pytest.approx((1e-3, 1e-3, 0.0))
    assert slow.step_s > plain.step_s


def test_a_cpu_s_kernels_are_timed_in_the_thread_s_cpu_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each call takes a millisecond of the thread's CPU; the wall clock runs a second per
    # reading (another process took the core): the timing is the CPU's.
    cpu = [0.0]
    wall = itertools.count(0.0, 1.0)
    monkeypatch.setattr(machine.time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(machine.time, "thread_time", lambda: cpu[0])

    def call() -> None:
        cpu[0] += 1e-3

    assert machine._seconds(call, torch.device("cpu"), least=0.004) == pytest.approx(1e-3)


def _overhead(rank: int) -> float:
    torch.set_num_threads(1)
    return machine.action_overhead(steps=3, warmup=1)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_runtime_s_cost_per_action_is_measured_on_a_tiny_pipeline() -> None:
    got = distributed.run(_overhead, 2, fork=True, timeout=240)
    assert got[0] == got[1]  # the two ranks' mean
    assert 1e-6 < got[0] < 5e-3, got  # a few hundred microseconds here, not a step


def test_the_measured_cost_per_action_is_the_cpu_hardware_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(machine, "_seconds", lambda *args, **kwargs: 1e-3)
    monkeypatch.setattr(machine, "_link", lambda: (1e-4, 2e9, 3e-4))
    hw = Hardware(**machine._measure(torch.device("cpu")))
    assert hw.action_overhead == 3e-4 and hw.latency_s == 1e-4 and hw.intra_node_gbps == 2.0
