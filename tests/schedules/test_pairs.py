"""Overlapped forward / backward pairs: as schedule data (paired, validate, tables) and
in the simulator, where expert all-to-all time (``a2a``) makes them matter."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.cli.command import main
from conveyor.errors import ConfigError, ScheduleError
from conveyor.schedules import (
    SCHEDULE_NAMES,
    Action,
    Schedule,
    default_chunks,
    dependencies,
    execution_order,
    from_table,
    get_schedule,
    paired,
    to_table,
    unpaired,
    validate,
)
from conveyor.schedules.pairs import forward_backward_pairs
from conveyor.simulate import SimResult, simulate

COSTS = [(1.0, 1.0, 1.0), (1.0, 2.0, 0.0), (2.0, 1.0, 0.5), (0.0, 1.0, 1.0)]
A2AS = [(1.0, 1.0), (0.5, 2.0), (3.0, 0.0), (0.0, 0.25)]


@st.composite
def any_schedule(draw: st.DrawFn) -> Schedule:
    """Every named generator at random sizes (dualpipev needs m >= 2p - 1)."""
    name = draw(st.sampled_from(SCHEDULE_NAMES))
    p = draw(st.integers(1, 5))
    low = 2 * p - 1 if name == "dualpipev" else 1
    m = draw(st.integers(low, max(low, 12)))
    return get_schedule(name, p, m, default_chunks(name))


def _timeline(result: SimResult) -> list[tuple[int, Action, float, float]]:
    return [(e.rank, e.action, e.start, e.end) for e in result.events]


# --- pairs as data ------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(any_schedule())
def test_paired_marks_valid_pairs_on_every_generator(schedule: Schedule) -> None:
    both = paired(schedule)
    assert validate(both) is both
    assert len(both.pairs) in (0, schedule.ranks)
    for rank, starts in enumerate(both.pairs):
        program = both.actions[rank]
        assert list(starts) == sorted(set(starts))
        assert set(starts) <= set(forward_backward_pairs(schedule)[rank])
        for i in starts:
            f, b = program[i], program[i + 1]
            assert (f.kind, b.kind) == ("F", "B") and f.microbatch != b.microbatch
            assert i + 1 not in starts  # no action in two pairs
    # Deadlock-free as units: every action runs, and a pair's two come out together.
    order = execution_order(both)
    assert len(order) == sum(map(len, both.actions))
    for k, (rank, action) in enumerate(order):
        i = both.actions[rank].index(action)
        if i in both.pair_starts(rank):
            assert order[k + 1] == (rank, both.actions[rank][i + 1])
    assert paired(both) == both  # marking is idempotent (it reads the programs only)
    assert unpaired(both).pairs == () and unpaired(both).actions == both.actions
    assert from_table(to_table(both)) == both  # pairs survive the table
    if both.pairs and any(both.pairs):
        assert "+B" in to_table(both)


def test_generators_that_overlap_return_paired_schedules() -> None:
    for name, p, m in [("interleaved-1f1b", 4, 8), ("dualpipev", 4, 10)]:
        schedule = get_schedule(name, p, m, default_chunks(name))
        assert schedule.pairs and schedule == paired(schedule), name
    assert get_schedule("gpipe", 4, 8).pairs == ()  # no F is ever followed by a B
    # 1F1B could pair (its steady state) but is generated without: there the pairs cost
    # more than they hide (test_1f1b_two_ranks_by_hand).
    assert get_schedule("1f1b", 4, 8).pairs == () and paired(get_schedule("1f1b", 4, 8)).pairs


def test_table_writes_a_pair_as_f_plus_b() -> None:
    table = to_table(paired(get_schedule("1f1b", 2, 3)))
    assert "rank 0: F0,0 F0,1+B0,0 F0,2+B0,1 B0,2" in table
    assert "rank 1: F1,0 B1,0 F1,1 B1,1 F1,2 B1,2" in table  # same micro-batch: no pair


# --- validate rejects bad pairs -------------------------------------------------------------

BASE = paired(get_schedule("1f1b", 2, 3))  # rank 0: F0,0 F0,1 B0,0 F0,2 B0,1 B0,2; pairs at 1, 3
NOT_A_PAIR = r"rank 0: pair at index {} is not an F followed by a B of another micro-batch"


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        (((0,), ()), NOT_A_PAIR.format(0)),  # F0,0 then F0,1: two forwards
        (((2,), ()), NOT_A_PAIR.format(2)),  # B0,0 then F0,2: a B first
        (((1, 2), ()), NOT_A_PAIR.format(2)),  # overlapping: B0,0 in two pairs
        (((3, 1), ()), NOT_A_PAIR.format(1)),  # not increasing
        (((5,), ()), NOT_A_PAIR.format(5)),  # the last action: no B after it
        (((-1,), ()), NOT_A_PAIR.format(-1)),
        (((), (0,)), r"rank 1: pair at index 0 is not an F followed by a B of another"),
        (((1,),), r"pairs has 1 entries for 2 ranks; give one tuple of indices per rank"),
    ],
)
def test_validate_rejects_a_bad_pair(pairs: tuple[tuple[int, ...], ...], message: str) -> None:
    # (1,) on rank 1 would be F1,0 B1,0: the same micro-batch, covered by ((), (0,)).
    with pytest.raises(ScheduleError, match=message):
        validate(dataclasses.replace(BASE, pairs=pairs))


def test_a_table_pair_of_one_microbatch_or_three_actions_is_refused() -> None:
    good = to_table(BASE)
    with pytest.raises(ScheduleError, match=NOT_A_PAIR.format(0).replace("rank 0", "rank 1")):
        from_table(good.replace("rank 1: F1,0 B1,0", "rank 1: F1,0+B1,0"))
    with pytest.raises(ScheduleError, match=r"line \d+: 'F0,2\+B0,1\+B0,2' joins more than two"):
        from_table(good.replace("F0,2+B0,1 B0,2", "F0,2+B0,1+B0,2"))


def test_a_pair_that_deadlocks_as_a_unit_is_refused() -> None:
    base = from_table(
        "ranks: 2\nmicrobatches: 2\nplacement: 0 1\n"
        "rank 0: F0,0 F0,1 B0,0 B0,1\nrank 1: F1,0 F1,1 B1,1 B1,0\n"
    )
    # Rank 0's pair F0,1+B0,0 waits for B1,0, the last on rank 1, after B1,1 and so after
    # F1,1, which needs F0,1: inside the pair that has not run.
    with pytest.raises(
        ScheduleError,
        match=r"deadlocks: rank 0 at F0,1\+B0,0 waits for B1,0 on rank 1; "
        r"rank 1 at F1,1 waits for F0,1 on rank 0; reorder the actions so",
    ):
        validate(dataclasses.replace(base, pairs=((1,), ())))
    assert paired(base).pairs == ()  # paired() leaves such a pair apart


# --- the simulator ----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(any_schedule(), st.sampled_from(COSTS), st.sampled_from([0.0, 0.5]))
def test_without_all_to_all_pairs_change_nothing(
    schedule: Schedule, cost: tuple[float, float, float], comm: float
) -> None:
    both, alone = paired(schedule), unpaired(schedule)
    result = simulate(both, cost, comm)
    assert _timeline(result) == _timeline(simulate(alone, cost, comm))
    assert _timeline(simulate(both, cost, comm, a2a=(0.0, 0.0))) == _timeline(result)
    assert result.a2a == (0.0, 0.0) and result.overlapped == 0
    assert "a2a" not in result.to_json_dict() and "pairs" not in result.to_json_dict()


@settings(max_examples=60, deadline=None)
@given(any_schedule(), st.sampled_from(COSTS), st.sampled_from(A2AS), st.sampled_from([0, 0.5]))
def test_all_to_all_alone_adds_to_each_f_and_b(
    schedule: Schedule,
    cost: tuple[float, float, float],
    a2a: tuple[float, float],
    comm: float,
) -> None:
    # Unpaired, an action waits for its all-to-all: the same as costs (F+aF, B+aB, W).
    f, b, w = cost
    alone = unpaired(schedule)
    result = simulate(alone, cost, comm, a2a=a2a)
    same = simulate(alone, (f + a2a[0], b + a2a[1], w), comm)
    got, want = _timeline(result), _timeline(same)
    assert [(r, a) for r, a, _, _ in got] == [(r, a) for r, a, _, _ in want]
    # times as floats, each within rounding (approx compares flat sequences only)
    assert [t for *_, s, e in got for t in (s, e)] == pytest.approx(
        [t for *_, s, e in want for t in (s, e)]
    )
    assert result.makespan == pytest.approx(same.makespan)


@settings(max_examples=60, deadline=None)
@given(any_schedule(), st.sampled_from(COSTS), st.sampled_from(A2AS), st.sampled_from([0, 0.5]))
def test_a_pair_takes_the_longer_of_compute_and_all_to_all(
    schedule: Schedule,
    cost: tuple[float, float, float],
    a2a: tuple[float, float],
    comm: float,
) -> None:
    both = paired(schedule)
    result = simulate(both, cost, comm, a2a=a2a)
    v = both.chunks
    f, b, w = (c / v for c in cost)
    b_alone = b if both.split_backward else b + w
    af, ab = a2a[0] / v, a2a[1] / v
    events = {e.action: e for e in result.events}
    ends = {e.action: e.end for e in result.events}
    assert result.overlapped == sum(map(len, both.pairs))
    for rank, program in enumerate(both.actions):
        mine = [e for e in result.events if e.rank == rank]
        assert [e.action for e in mine] == list(program)
        assert all(x.end <= y.start + 1e-9 for x, y in itertools.pairwise(mine))
        starts = both.pair_starts(rank)
        for i, action in enumerate(program):
            event = events[action]
            if i in starts:
                second = events[program[i + 1]]
                assert event.end == pytest.approx(second.start)
                assert second.end - event.start == pytest.approx(max(f + b_alone, af + ab))
                if f + b_alone > 0:
                    assert event.end - event.start == pytest.approx(
                        (second.end - event.start) * f / (f + b_alone)
                    )
                ends[action] = second.end  # the F's result leaves with the pair
            elif i - 1 not in starts:
                compute = {"F": f + af, "B": b_alone + ab, "W": w}[action.kind]
                assert event.end - event.start == pytest.approx(compute)
    for event in result.events:  # nothing starts before what it needs has arrived
        for dep in dependencies(both, event.action):
            far = both.placement[dep.stage] != event.rank
            assert event.start >= ends[dep] + (comm if far else 0.0) - 1e-9
    busy = sum(e.end - e.start for e in result.events)
    assert result.bubble == pytest.approx(1 - busy / (both.ranks * result.makespan))


def test_one_rank_by_hand() -> None:
    # One rank, two micro-batches: F0 F1+B0 B1, cost (1, 1, 0), a2a 1 (F and B).
    # Alone each action is compute 1 + all-to-all 1 = 2: 4 actions, 8.
    # Paired: F0 [0, 2]; F1+B0 takes max(1 + 1, 1 + 1) = 2, [2, 4] (F1 [2, 3], B0 [3, 4]);
    # B1 [4, 6]: 6.
    both = from_table("ranks: 1\nmicrobatches: 2\nplacement: 0\nrank 0: F0,0 F0,1+B0,0 B0,1\n")
    assert both.pairs == ((1,),)
    assert simulate(unpaired(both), (1, 1, 0), a2a=1).makespan == 8.0
    result = simulate(both, (1, 1, 0), a2a=1)
    assert result.makespan == 6.0
    assert [(e.start, e.end) for e in result.events] == [(0, 2), (2, 3), (3, 4), (4, 6)]
    # Unequal: cost (1, 2, 0), a2a (F, B) = (3, 1). Alone: F 4, B 3: 4 + 4 + 3 + 3 = 14.
    # Paired: F0 [0, 4]; the pair max(1 + 2, 3 + 1) = 4, [4, 8] split 1 : 2 (F1 ends at
    # 4 + 4/3); B1 [8, 11]: 11.
    assert simulate(unpaired(both), (1, 2, 0), a2a=(3, 1)).makespan == 14.0
    result = simulate(both, (1, 2, 0), a2a=(3, 1))
    assert result.makespan == 11.0
    assert result.events[1].end == pytest.approx(4 + 4 / 3)
    assert result.bubble == pytest.approx(0.0)  # one rank, never idle


def test_1f1b_two_ranks_by_hand() -> None:
    # 1f1b, p=2, m=4, cost (1, 1, 0) (B is the whole backward), a2a 1.
    # rank 0: F0 F1+B0 F2+B1 F3+B2 B3; rank 1: F0 B0 F1 B1 F2 B2 F3 B3 (no pair: each F
    # is followed by the B of its own micro-batch).
    #
    # Unpaired, every action takes 2 (1 compute + 1 all-to-all), like 1F1B with cost (2, 2):
    #   rank 0: F0 0-2, F1 2-4, B0 6-8, F2 8-10, B1 10-12, F3 12-14, B2 14-16, B3 18-20
    #   rank 1: F0 2-4, B0 4-6, F1 6-8, B1 8-10, F2 10-12, B2 12-14, F3 14-16, B3 16-18
    #   makespan 20 = (m + p - 1) * 4.
    # Paired, each pair of rank 0 takes max(1 + 1, 1 + 1) = 2, but it starts only when its
    # B may (B0 needs rank 1's B0), and its F's result leaves with the pair:
    #   rank 0: F0 0-2, F1+B0 6-8, F2+B1 12-14, F3+B2 18-20, B3 24-26
    #   rank 1: F0 2-4, B0 4-6, F1 8-10, B1 10-12, F2 14-16, B2 16-18, F3 20-22, B3 22-24
    #   makespan 26: in plain 1F1B a pair ties the next forward to the last backward, so
    #   the overlap costs more than it hides.
    assert get_schedule("1f1b", 2, 4).pairs == ()  # the generator does not pair it
    schedule = paired(get_schedule("1f1b", 2, 4))
    assert schedule.pairs == ((1, 3, 5), ())
    assert simulate(unpaired(schedule), (1, 1, 0), a2a=1).makespan == 20.0
    result = simulate(schedule, (1, 1, 0), a2a=1)
    assert result.makespan == 26.0
    rank0 = [(e.start, e.end) for e in result.events if e.rank == 0]
    assert rank0 == [(0, 2), (6, 7), (7, 8), (12, 13), (13, 14), (18, 19), (19, 20), (24, 26)]
    rank1 = [(e.start, e.end) for e in result.events if e.rank == 1]
    assert rank1 == [(2, 4), (4, 6), (8, 10), (10, 12), (14, 16), (16, 18), (20, 22), (22, 24)]
    assert simulate(schedule, (1, 1, 0)).makespan == 10.0  # no all-to-all: pairs ignored


def test_dualpipev_at_deepseeks_ratio_hides_the_all_to_all() -> None:
    # DeepSeek-V3's setting: the all-to-all as long as the compute. dualpipev p=4 m=10,
    # cost (1, 1, 1) per rank's share (two chunks of 0.5 each), a2a 1 (0.5 per chunk).
    schedule = get_schedule("dualpipev", 4, 10)
    compute = simulate(schedule, (1, 1, 1))
    alone = simulate(unpaired(schedule), (1, 1, 1), a2a=1)
    both = simulate(schedule, (1, 1, 1), a2a=1)
    assert compute.makespan == 31.5  # no all-to-all
    # Unpaired the all-to-all adds to every F and B: costs (2, 2, 1), a makespan of 54.5.
    assert alone.makespan == simulate(unpaired(schedule), (2, 2, 1)).makespan == 54.5
    # Paired, the 45 pairs take max(0.5 + 0.5, 0.5 + 0.5) = 1 instead of 2: 43.5, 11 time
    # units saved (20 %), 12 of the 23 that the all-to-all added.
    assert both.overlapped == 45 and both.makespan == 43.5
    assert both.to_json_dict()["pairs"] == 45 and both.to_json_dict()["a2a"] == [1.0, 1.0]


def test_a2a_must_be_one_or_two_numbers_at_least_zero() -> None:
    schedule = get_schedule("1f1b", 2, 2)
    for bad in (-1.0, float("nan"), (1.0, 2.0, 3.0), (), "1", (1.0, -0.5)):
        with pytest.raises(ConfigError, match="a2a must be a finite number >= 0, or a pair"):
            simulate(schedule, a2a=bad)  # type: ignore[arg-type]


# --- conveyor simulate --a2a ------------------------------------------------------------------

DUALPIPEV = ["simulate", "--schedule", "dualpipev", "--ranks", "4", "--microbatches", "10"]


def test_cli_a2a_with_and_without_overlap(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*DUALPIPEV, "--a2a", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["makespan"], data["a2a"], data["pairs"]) == (43.5, [1.0, 1.0], 45)
    assert main([*DUALPIPEV, "--a2a", "1", "--no-overlap", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["makespan"], data["a2a"], data["pairs"]) == (54.5, [1.0, 1.0], 0)
    assert main([*DUALPIPEV, "--a2a", "1", "--no-overlap"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("comm 0, a2a F,B = 1,1 (no-overlap)")
    assert lines[1].startswith("makespan 54.5  span 54.5")
    assert main([*DUALPIPEV, "--a2a", "0.5,2"]) == 0
    assert "a2a F,B = 0.5,2 (45 F+B pairs overlapped)" in capsys.readouterr().out
    assert main([*DUALPIPEV, "--json"]) == 0  # no --a2a: DESIGN's keys only
    assert "a2a" not in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("text", ["x", "1,2,3", "-1", "1,inf", ""])
def test_cli_rejects_a_bad_a2a(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*DUALPIPEV, "--a2a", text]) == 2
    assert "--a2a must be one number >= 0, or two as F,B (e.g. 1,2)" in capsys.readouterr().err
