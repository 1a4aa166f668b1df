"""zb-auto, the memory-bounded zero-bubble scheduler: properties over random costs, caps
and shapes (one stage per rank, or a V), small cases checked by hand, and what it returns
under NCCL's rules and torch's own schedule check. Its results on the Zero Bubble paper's
settings are tests/schedules/test_papers.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining.schedules import _Action, _ComputationType, _validate_schedule

from conveyor.errors import ConfigError
from conveyor.schedules import (
    B,
    F,
    Schedule,
    get_schedule,
    validate,
    zb_h1,
    zb_h2,
    zero_bubble_auto,
)
from conveyor.simulate import CostSpec, peak_activations, simulate
from tests.runtime.test_program import _traces
from tests.support.nccl_model import check

STAGE_COST = st.tuples(*[st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 3.0])] * 3)
V_REFERENCES = ("zbv", "v-half", "v-min")


@st.composite
def cases(draw: st.DrawFn) -> tuple[int, int, int, CostSpec, float, float, float]:
    """(ranks, micro-batches, chunks, cost, comm, cap, w_memory)."""
    chunks = draw(st.sampled_from([1, 2]))
    p = draw(st.integers(1, 6))
    m = draw(st.integers(1, 16))
    if draw(st.booleans()):
        cost: CostSpec = draw(st.lists(STAGE_COST, min_size=p * chunks, max_size=p * chunks))
    else:
        cost = draw(STAGE_COST)
    comm = draw(st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0]))
    cap = draw(st.sampled_from([1.0, 1.5, p / 2, p, p + 0.5, 2 * p - 1, 2 * p, 3 * p]))
    share = draw(st.sampled_from([1.0, 1.0, 0.5, 0.3, 0.0]))
    return p, m, chunks, cost, comm, max(cap, 1.0), share


def _auto(case: tuple[int, int, int, CostSpec, float, float, float]) -> Schedule | None:
    p, m, chunks, cost, comm, cap, share = case
    try:
        return zero_bubble_auto(p, m, cost, cap, comm, chunks, w_memory=share)
    except ConfigError as error:  # a V under a cap below v-min's peak: said so
        assert chunks == 2 and "no V schedule" in str(error), error
        least = min(max(peak_activations(get_schedule(n, p, m), w_memory=share))
                    for n in V_REFERENCES)  # fmt: skip
        assert cap < least
        return None


@settings(max_examples=150, deadline=None)
@given(cases())
def test_every_action_once_in_dependency_order_within_the_cap(
    case: tuple[int, int, int, CostSpec, float, float, float],
) -> None:
    schedule = _auto(case)
    if schedule is None:
        return
    p, m, chunks, _, _, cap, share = case
    validate(schedule)  # every F, B and W of every stage and micro-batch once, in order
    assert (schedule.name, schedule.ranks, schedule.chunks) == ("zb-auto", p, chunks)
    assert schedule.split_backward and schedule.microbatches == m
    if chunks == 2:
        assert schedule.placement == get_schedule("zbv", p, m).placement
    assert max(peak_activations(schedule, w_memory=share)) <= min(cap, m) + 1e-9


@settings(max_examples=150, deadline=None)
@given(cases())
def test_never_slower_than_the_hand_made_schedules_that_fit_its_cap(
    case: tuple[int, int, int, CostSpec, float, float, float],
) -> None:
    schedule = _auto(case)
    if schedule is None:
        return
    p, m, chunks, cost, comm, cap, share = case
    ours = simulate(schedule, cost, comm).makespan
    hand_made = [zb_h1(p, m), zb_h2(p, m)] if chunks == 1 else [
        get_schedule(n, p, m) for n in V_REFERENCES]  # fmt: skip
    for other in hand_made:
        if max(peak_activations(other, w_memory=share)) <= cap:
            assert ours <= simulate(other, cost, comm).makespan + 1e-9, other.name


@settings(max_examples=60, deadline=None)
@given(cases())
def test_what_it_returns_replays_under_nccl_rules_and_passes_torchs_check(
    case: tuple[int, int, int, CostSpec, float, float, float],
) -> None:
    schedule = _auto(case)
    if schedule is None:
        return
    check(_traces(schedule))
    kinds = {F: _ComputationType.FORWARD, B: _ComputationType.BACKWARD_INPUT}
    actions: dict[int, list[_Action | None]] = {
        rank: [
            _Action(a.stage, kinds.get(a.kind, _ComputationType.BACKWARD_WEIGHT), a.microbatch)
            for a in program
        ]
        for rank, program in enumerate(schedule.actions)
    }
    _validate_schedule(actions, schedule.ranks, schedule.stages, schedule.microbatches)


def test_two_ranks_two_microbatches_by_hand() -> None:
    # Rank 1 starts after one F and then has 2 x (F + B + W) = 6 of work: 7 is the least.
    # Rank 0: F0 F1, waits 1 for B0, B0 W0, then B1 (back at 5) W1.
    schedule = zero_bubble_auto(2, 2, (1.0, 1.0, 1.0), microbatch_cap=2)
    assert simulate(schedule).makespan == 7.0
    assert [str(a) for a in schedule.actions[0]] == ["F0,0", "F0,1", "B0,0", "W0,0", "B0,1",
                                                     "W0,1"]  # fmt: skip
    # One micro-batch at a time on rank 0: it must run W0 before F1 can start.
    alone = zero_bubble_auto(2, 2, (1.0, 1.0, 1.0), microbatch_cap=1)
    assert simulate(alone).makespan == 10.0
    assert [str(a) for a in alone.actions[0]][:4] == ["F0,0", "B0,0", "W0,0", "F0,1"]


def test_what_w_holds_counts_against_the_cap_as_the_paper_counts_it() -> None:
    # With nothing held from B to W (the paper's M_W = 0), the same cap of 1 lets F1 start
    # right after B0 and W0 fill the wait for B1: 9 instead of 10.
    freed = zero_bubble_auto(2, 2, (1.0, 1.0, 1.0), microbatch_cap=1, w_memory=0.0)
    assert simulate(freed).makespan == 9.0
    assert [str(a) for a in freed.actions[0]][:3] == ["F0,0", "B0,0", "F0,1"]
    assert max(peak_activations(freed, w_memory=0.0)) == 1.0
    assert max(peak_activations(freed, w_memory=1.0)) == 2.0  # counted whole: no fit


def test_a_v_at_twice_zbvs_memory_beats_zbv() -> None:
    # A B twice an F: the list scheduler's V, holding 2p micro-batches, ends sooner.
    cost = (1.0, 2.0, 1.0)
    zbv = simulate(get_schedule("zbv", 4, 9), cost)
    auto = simulate(zero_bubble_auto(4, 9, cost, microbatch_cap=8, chunks=2), cost)
    assert auto.makespan < zbv.makespan
    assert (auto.makespan, zbv.makespan) == (37.5, 39.0)
    at_zbv_memory = zero_bubble_auto(4, 9, cost, microbatch_cap=4, chunks=2)
    assert simulate(at_zbv_memory, cost).makespan <= zbv.makespan


def test_bad_shapes_and_shares_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"zb-auto builds one stage per rank \(chunks=1\) or "
                       r"a V of two \(chunks=2\), got chunks=3"):  # fmt: skip
        zero_bubble_auto(4, 8, chunks=3)
    for share in (-0.1, 1.5, float("nan"), "0.5"):
        with pytest.raises(ConfigError, match=r"w_memory must be a share in \[0, 1\]"):
            zero_bubble_auto(4, 8, w_memory=share)  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError,
        match=r"no V schedule of 8 ranks fits microbatch_cap=1; v-min holds 4 micro-batches: "
        r"raise the cap to that, or use chunks=1",
    ):
        zero_bubble_auto(8, 16, microbatch_cap=1, chunks=2)


def test_one_warm_up_forward_more_than_fills_the_wait_is_a_candidate() -> None:
    # The paper's binary choice: run one more forward before the first B, though it may
    # delay that B. On this V it is the fastest setting: 34.5, against 35.5 without it.
    cost = (2.0, 3.0, 0.5)
    schedule = zero_bubble_auto(2, 6, cost, microbatch_cap=4, chunks=2)
    assert simulate(schedule, cost).makespan == 34.5
    assert simulate(get_schedule("zbv", 2, 6), cost).makespan > 34.5
