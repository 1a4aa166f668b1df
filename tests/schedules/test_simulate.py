"""The simulator: closed forms, memory, costs, comm, and the text timeline."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.errors import ConfigError
from conveyor.schedules import (
    Action,
    dependencies,
    get_schedule,
    interleaved_1f1b,
    make_schedule,
    validate,
)
from conveyor.simulate import ascii_timeline, simulate

COSTS = [(1.0, 2.0, 0.0), (1.0, 1.0, 1.0), (2.0, 1.0, 0.5)]
ranks = st.integers(1, 8)
microbatches = st.integers(1, 32)
costs = st.sampled_from(COSTS)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b"]), ranks, microbatches, costs)
def test_gpipe_and_1f1b_makespan_closed_form(
    name: str, p: int, m: int, cost: tuple[float, float, float]
) -> None:
    result = simulate(get_schedule(name, p, m), cost)
    assert result.makespan == pytest.approx((m + p - 1) * sum(cost))
    assert result.span == pytest.approx(result.makespan)
    assert result.bubble == pytest.approx(1 - m * sum(cost) / result.makespan)
    assert result.bubble == pytest.approx((p - 1) / (m + p - 1))


@settings(max_examples=100, deadline=None)
@given(ranks, microbatches)
def test_gpipe_holds_every_microbatch(p: int, m: int) -> None:
    assert simulate(get_schedule("gpipe", p, m)).peak_activations == (float(m),) * p


@settings(max_examples=100, deadline=None)
@given(ranks, microbatches)
def test_1f1b_peak_is_p_minus_rank(p: int, m: int) -> None:
    peaks = simulate(get_schedule("1f1b", p, m)).peak_activations
    assert peaks == tuple(float(min(p - i, m)) for i in range(p))
    if m >= p:
        assert peaks == tuple(float(p - i) for i in range(p))


@settings(max_examples=150, deadline=None)
@given(ranks, st.integers(1, 6), st.integers(1, 4), costs)
def test_interleaved_makespan_closed_form(
    p: int, groups: int, v: int, cost: tuple[float, float, float]
) -> None:
    m = p * groups
    # The generator itself: with v = 1 (which the name refuses) it is 1F1B's form.
    result = simulate(validate(interleaved_1f1b(p, m, v)), cost)
    assert result.makespan == pytest.approx(m * sum(cost) + (p - 1) * sum(cost) / v)


@settings(max_examples=150, deadline=None)
@given(ranks, st.integers(0, 31), st.integers(2, 4), costs)
def test_interleaved_keeps_the_closed_form_when_ranks_do_not_divide_microbatches(
    p: int, extra: int, v: int, cost: tuple[float, float, float]
) -> None:
    # Stronger than Megatron, which refuses these sizes: any m >= p.
    m = p + extra
    result = simulate(get_schedule("interleaved-1f1b", p, m, v), cost)
    assert result.makespan == pytest.approx(m * sum(cost) + (p - 1) * sum(cost) / v)


def test_interleaved_peak_counts_a_chunk_as_one_over_v() -> None:
    # Rank r holds Megatron's warm-up + 1 chunk-activations: (2(p-r-1) + (v-1)p + 1) / v.
    result = simulate(get_schedule("interleaved-1f1b", 4, 8, 2))
    assert result.peak_activations == (5.5, 4.5, 3.5, 2.5)


# The JSON example in DESIGN.md: 1F1B, 4 ranks, 8 micro-batches, F = B = W = 1.
DESIGN_EXAMPLE = {
    "schedule": "1f1b",
    "ranks": 4,
    "chunks": 1,
    "microbatches": 8,
    "cost": [1.0, 1.0, 1.0],
    "comm": 0.0,
    "makespan": 33.0,
    "span": 33.0,
    "bubble": 0.2727,
    "peak_activations": [4.0, 3.0, 2.0, 1.0],
}


def test_example_from_design() -> None:
    result = simulate(get_schedule("1f1b", 4, 8), (1, 1, 1))
    assert result.to_json_dict() == DESIGN_EXAMPLE


@settings(max_examples=100, deadline=None)
@given(ranks, microbatches, costs, st.sampled_from([0.1, 0.5, 2.0]))
def test_gpipe_with_comm_pays_each_hop_twice(
    p: int, m: int, cost: tuple[float, float, float], comm: float
) -> None:
    result = simulate(get_schedule("gpipe", p, m), cost, comm=comm)
    assert result.makespan == pytest.approx((m + p - 1) * sum(cost) + 2 * (p - 1) * comm)


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]),
    st.integers(2, 8),
    microbatches,
    st.integers(1, 3),
)
def test_comm_increases_makespan_and_events_respect_dependencies(
    name: str, p: int, m: int, v: int
) -> None:
    chunks = {"1f1b": 1, "interleaved-1f1b": v + 1}.get(name, v)  # interleaved: 2 or more
    schedule = get_schedule(name, p, m, chunks)
    base = simulate(schedule, (1, 2, 0))
    slow = simulate(schedule, (1, 2, 0), comm=0.5)
    assert slow.makespan > base.makespan
    assert slow.bubble > base.bubble
    end = {e.action: e.end for e in slow.events}
    for rank in range(p):
        mine = [e for e in slow.events if e.rank == rank]
        assert [e.action for e in mine] == list(schedule.actions[rank])
        for before, after in itertools.pairwise(mine):
            assert after.start >= before.end
    for event in slow.events:
        for dep in dependencies(schedule, event.action):
            hop = 0.5 if schedule.placement[dep.stage] != event.rank else 0.0
            assert event.start >= end[dep] + hop - 1e-9


def test_per_stage_costs() -> None:
    schedule = get_schedule("gpipe", 2, 1)
    result = simulate(schedule, [(1.0, 2.0, 0.5), (3.0, 4.0, 1.0)])
    # F0, F1, B1 (B+W), B0 (B+W) run one after another.
    assert result.makespan == 1.0 + 3.0 + 5.0 + 2.5
    assert result.bubble == pytest.approx(1 - (3.5 + 8.0) / (2 * 11.5))
    assert result.to_json_dict()["cost"] == [[1.0, 2.0, 0.5], [3.0, 4.0, 1.0]]


def test_uniform_per_stage_costs_equal_the_per_rank_share() -> None:
    schedule = get_schedule("interleaved-1f1b", 3, 5, 2)
    share = simulate(schedule, (1.0, 2.0, 1.0))
    stages = simulate(schedule, [(0.5, 1.0, 0.5)] * 6)
    assert stages.makespan == pytest.approx(share.makespan)
    assert stages.bubble == pytest.approx(share.bubble)


def test_split_backward_pays_b_and_w_separately_and_holds_until_w() -> None:
    programs = [
        [Action(*a) for a in [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)]],
        [Action(*a) for a in [("F", 1, 0), ("B", 1, 0), ("W", 1, 0), ("F", 1, 1), ("B", 1, 1)]],
    ]
    programs[0] += [Action("W", 0, 0), Action("W", 0, 1)]
    programs[1] += [Action("W", 1, 1)]
    schedule = validate(make_schedule("split", 2, 2, (0, 1), programs, split_backward=True))
    result = simulate(schedule, (1.0, 2.0, 3.0))
    durations = {(e.action.kind): e.end - e.start for e in result.events}
    assert durations == {"F": 1.0, "B": 2.0, "W": 3.0}
    assert result.peak_activations == (2.0, 1.0)
    # Rank 1: F at 1, B at 2..4, W 4..7, F 7..8, B 8..10, W 10..13; rank 0 B0,1 waits.
    assert result.makespan == 18.0


@pytest.mark.parametrize(
    ("cost", "comm", "pattern"),
    [
        ((1.0, 2.0), 0.0, "three numbers"),
        ((1.0, -1.0, 0.0), 0.0, ">= 0"),
        ((1.0, float("nan"), 0.0), 0.0, ">= 0"),
        ([(1.0, 1.0, 1.0)] * 3, 0.0, "costs for 3 stages, but the schedule has 4"),
        ((1.0, 1.0, 1.0), -1.0, "comm must be"),
    ],
)
def test_bad_costs_are_rejected(cost: object, comm: float, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        simulate(get_schedule("1f1b", 4, 4), cost, comm=comm)  # type: ignore[arg-type]


def test_ascii_timeline_of_1f1b() -> None:
    text = ascii_timeline(simulate(get_schedule("1f1b", 2, 2), (1.0, 1.0, 0.0)))
    assert text.splitlines() == [
        "one cell = 0.333 time units; F/B/W + micro-batch; '.' = idle",
        "rank  0 |F0 F1 ...B0 ...B1 |",
        "rank  1 |...F0 B0 F1 B1 ...|",
    ]


def test_ascii_timeline_marks_chunks_and_fits_the_width() -> None:
    result = simulate(get_schedule("interleaved-1f1b", 2, 2, 2), (1.0, 1.0, 1.0))
    wide = ascii_timeline(result, width=200).splitlines()
    assert len(wide) == 3
    assert "letter = chunk" in wide[0]
    assert wide[1].startswith("rank  0 |F0a ") and "F0b" in wide[1] and "B0b" in wide[1]
    assert len({len(line) for line in wide[1:]}) == 1
    narrow = ascii_timeline(simulate(get_schedule("gpipe", 4, 32)), width=60).splitlines()
    assert all(len(line) <= 60 for line in narrow[1:])
    # 105 time units in 50 cells: rank 3's 3 idle units take 1 cell.
    assert narrow[4].startswith("rank  3 |.FFFF") and narrow[1].startswith("rank  0 |FFFF")


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8)])
def test_bubble_is_over_the_makespan_not_the_span(p: int, m: int) -> None:
    # DESIGN.md: bubble = 1 - M(F+B+W)/makespan, makespan from the first start to the last
    # end over all ranks. Under zb-h2 every rank runs without a gap once started, so span
    # (one rank's busy stretch, M(F+B+W)) is shorter than the makespan by the late start of
    # the last rank.
    cost = (1.0, 1.0, 1.0)
    result = simulate(get_schedule("zb-h2", p, m), cost)
    starts = {r: min(e.start for e in result.events if e.rank == r) for r in range(p)}
    ends = {r: max(e.end for e in result.events if e.rank == r) for r in range(p)}
    makespan = max(ends.values()) - min(starts.values())
    span = max(ends[r] - starts[r] for r in range(p))
    assert span == m * sum(cost) and makespan > span  # the case this test is for
    assert result.makespan == makespan and result.span == span
    assert result.bubble == pytest.approx(1 - m * sum(cost) / makespan)
    assert result.bubble > 0
    # By hand: the last rank starts after p - 1 forwards and then never waits.
    assert makespan == (p - 1) * cost[0] + m * sum(cost)


def test_zb_h2_bubble_by_hand() -> None:
    # 2 ranks, 4 micro-batches: rank 0 busy 0..12, rank 1 busy 1..13 (it starts after F0,0).
    result = simulate(get_schedule("zb-h2", 2, 4), (1.0, 1.0, 1.0))
    assert (result.makespan, result.span) == (13.0, 12.0)
    assert result.bubble == pytest.approx(1 / 13)
    assert result.to_json_dict()["bubble"] == 0.0769
    # 4 ranks, 8 micro-batches: makespan 27, span 24, bubble 3/27.
    assert simulate(get_schedule("zb-h2", 4, 8), (1.0, 1.0, 1.0)).bubble == pytest.approx(1 / 9)
