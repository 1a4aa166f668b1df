"""Zero-bubble family (ZB-H1, ZB-H2, ZB-V, auto), DualPipeV and looped BFS."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.cli.command import main
from conveyor.errors import ConfigError
from conveyor.schedules import (
    SCHEDULE_NAMES,
    Action,
    Schedule,
    W,
    default_chunks,
    dualpipev,
    get_schedule,
    gpipe,
    loop_placement,
    looped_bfs,
    v_placement,
    validate,
    zb_h1,
    zb_h2,
    zbv,
    zero_bubble_auto,
)
from conveyor.schedules.greedy import greedy_run
from conveyor.simulate import CostSpec, peak_activations, simulate

NEW = ("looped-bfs", "zb-h1", "zb-h2", "zb-late", "zbv", "dualpipev", "zb-auto")
V_SCHEDULES = ("zbv", "dualpipev")
SPLIT = ("zb-h1", "zb-h2", "zb-late", "zbv", "dualpipev", "zb-auto")
ranks = st.integers(1, 8)
microbatches = st.integers(1, 32)


def dualpipev_minimum(p: int) -> int:
    return 2 * p - 1


# --- every generated schedule is valid -----------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(NEW), ranks, microbatches)
def test_new_schedules_are_complete_valid_and_placed(name: str, p: int, m: int) -> None:
    v = default_chunks(name)
    if name == "dualpipev" and m < dualpipev_minimum(p):
        with pytest.raises(ConfigError, match=r"dualpipev needs microbatches >= 2\*ranks - 1"):
            get_schedule(name, p, m, v)
        return
    schedule = get_schedule(name, p, m, v)  # validates
    assert schedule.name == name
    assert schedule.split_backward == (name in SPLIT)
    placement = v_placement(p) if name in V_SCHEDULES else loop_placement(p, v)
    assert schedule.placement == placement
    kinds = "FBW" if schedule.split_backward else "FB"
    expected = {Action(k, s, mb) for k in kinds for s in range(p * v) for mb in range(m)}
    seen = [a for _, a in schedule]
    assert len(seen) == len(expected) and set(seen) == expected
    for rank, program in enumerate(schedule.actions):
        assert all(placement[a.stage] == rank for a in program)
        for kind in kinds:  # each stage's F, B (and W) run in micro-batch order
            for s in schedule.stages_of(rank):
                order = [a.microbatch for a in program if a.kind == kind and a.stage == s]
                assert order == sorted(order)


@pytest.mark.slow  # an exhaustive sweep; the property tests cover it in the fast lane
def test_zbv_and_zb_h1_are_valid_for_every_size_up_to_8_ranks_32_microbatches() -> None:
    # Exhaustive for the two cheap closed-form generators (ZB-V below m = 2p-1 drops the
    # actions of micro-batches that do not exist from the 2p-1 pattern).
    for p in range(1, 9):
        for m in range(1, 33):
            validate(zb_h1(p, m))
            validate(zbv(p, m))


def test_dualpipev_is_valid_from_2p_minus_1_microbatches() -> None:
    for p in range(1, 9):
        for m in range(dualpipev_minimum(p), 33):
            validate(dualpipev(p, m))
        if p > 1:
            with pytest.raises(ConfigError, match=rf"got microbatches={2 * p - 2} with ranks={p}"):
                dualpipev(p, 2 * p - 2)


# --- the issue's expected values (p=4, m=8, F=B=W=1, no transfer cost) ----------------------


def test_expected_values_from_the_issue() -> None:
    h1 = simulate(get_schedule("zb-h1", 4, 8))
    assert h1.makespan == 27.0
    # Counted whole until W, every rank holds p; the runtime holds 0.76 of one from B to W.
    assert peak_activations(get_schedule("zb-h1", 4, 8), w_memory=1.0) == (4.0,) * 4
    assert h1.peak_activations == (4.0, 3.76, 3.52, 3.28)
    assert simulate(get_schedule("zb-h2", 4, 8)).span == 24.0
    v = simulate(get_schedule("zbv", 4, 8, chunks=2))
    assert v.span == 24.0
    assert v.peak_activations == (4.0, 4.0, 4.0, 4.0)


@pytest.mark.parametrize(
    ("name", "chunks", "makespan", "span", "peaks"),
    [
        ("1f1b", 1, 33.0, 33.0, (4.0, 3.0, 2.0, 1.0)),
        ("looped-bfs", 2, 28.5, 28.5, (8.0, 8.0, 8.0, 8.0)),
        ("zb-h1", 1, 27.0, 27.0, (4.0, 3.76, 3.52, 3.28)),
        ("zb-h2", 1, 27.0, 24.0, (7.0, 6.52, 6.04, 5.56)),
        ("zbv", 2, 25.5, 24.0, (4.0, 4.0, 4.0, 4.0)),
        ("dualpipev", 2, 25.5, 25.5, (4.5, 4.5, 4.5, 4.5)),
        ("zb-auto", 1, 27.0, 27.0, (4.0, 3.76, 3.52, 3.28)),
    ],
)
def test_table_for_4_ranks_8_microbatches(
    name: str, chunks: int, makespan: float, span: float, peaks: tuple[float, ...]
) -> None:
    result = simulate(get_schedule(name, 4, 8, chunks))
    assert (result.makespan, result.span, result.peak_activations) == (makespan, span, peaks)


# --- ZB-H1 ---------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(ranks, microbatches)
def test_zb_h1_holds_1f1b_first_rank_peak_on_every_rank(p: int, m: int) -> None:
    schedule = zb_h1(p, m)
    assert peak_activations(schedule, w_memory=1.0) == (float(min(p, m)),) * p
    # What the runtime holds from B to W: never more, and the first rank's is 1F1B's.
    peaks = simulate(schedule).peak_activations
    assert peaks[0] == float(min(p, m)) and max(peaks) == peaks[0]


@settings(max_examples=150, deadline=None)
@given(ranks, st.integers(0, 24), st.sampled_from([0.5, 1.0, 2.0]))
def test_zb_h1_makespan_with_equal_costs(p: int, extra: int, t: float) -> None:
    m = p + extra
    assert simulate(zb_h1(p, m), (t, t, t)).makespan == pytest.approx((3 * m + p - 1) * t)
    assert simulate(get_schedule("1f1b", p, m), (t, t, t)).makespan == pytest.approx(
        3 * (m + p - 1) * t
    )


def test_zb_h1_keeps_1f1b_order_and_delays_w_by_rank() -> None:
    schedule = zb_h1(3, 4)
    text = [" ".join(str(a) for a in program) for program in schedule.actions]
    assert text[2] == "F2,0 B2,0 F2,1 B2,1 F2,2 B2,2 W2,0 F2,3 B2,3 W2,1 W2,2 W2,3"
    assert text[0] == "F0,0 F0,1 F0,2 B0,0 W0,0 F0,3 B0,1 W0,1 B0,2 W0,2 B0,3 W0,3"


# --- ZB-H2 ---------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(ranks, microbatches)
def test_zb_h2_memory_warmup_and_zero_bubble(p: int, m: int) -> None:
    schedule = zb_h2(p, m)
    result = simulate(schedule)
    assert max(result.peak_activations) <= min(2 * p - 1, m)
    for rank, program in enumerate(schedule.actions):
        first_b = next(i for i, a in enumerate(program) if a.kind == "B")
        assert first_b == min(2 * (p - rank) - 1, m)
    # With enough micro-batches to cover the warm-up, no rank ever idles in its span.
    assert (result.span == 3 * m) == (m >= 2 * p - 1)


# --- ZB-V ----------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(ranks, microbatches)
def test_zbv_zero_bubble_with_1f1b_memory(p: int, m: int) -> None:
    result = simulate(zbv(p, m))
    assert max(result.peak_activations) <= p
    if m >= 2 * p - 1:
        assert result.span == 3 * m
        # Rank r starts after r chunk forwards of 1/2 each; then nobody idles.
        assert result.makespan == 3 * m + (p - 1) / 2
        assert result.peak_activations == (float(p),) * p


def test_zbv_below_2p_minus_1_drops_missing_microbatches_from_the_pattern() -> None:
    full = zbv(3, 5)
    short = zbv(3, 2)
    for long_program, short_program in zip(full.actions, short.actions, strict=True):
        assert short_program == tuple(a for a in long_program if a.microbatch < 2)


# --- DualPipeV -----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(ranks, microbatches)
def test_dualpipev_makespan_and_peak(p: int, m: int) -> None:
    # Derived from the step structure (torch's ScheduleDualPipeV), F=B=W=1 so each chunk
    # action costs 1/2. Memory: rank r runs 2(p-r-1) chunk-0 forwards, then r+1 F0/F1
    # pairs (2p chunk activations held); from then on each overlapped pair F then B
    # adds one before its full backward (B+W) frees one, so the peak is 2p+1 chunks,
    # p + 1/2 micro-batches. Only with m = 2p-1 does rank 0 run no overlapped F0/B1
    # pair and stays at p. Time: every rank does 2m chunks x (F+B+W)/2 = 3m of work;
    # rank r waits r/2 for its first forward, and the V's turn costs rank 0 (p-1)/2 of
    # idle in the tail waiting for chunk-0 backwards, so all ranks end at 3m + (p-1)/2:
    # the same makespan as ZB-V, with half a micro-batch more memory and without ZB-V's
    # staggered starts (span = makespan).
    m = max(m, dualpipev_minimum(p))
    result = simulate(dualpipev(p, m))
    assert result.makespan == 3 * m + (p - 1) / 2
    assert result.span == result.makespan
    top = p + 0.5
    assert result.peak_activations == ((float(p) if m == 2 * p - 1 else top),) + (top,) * (p - 1)


def test_dualpipev_overlapped_pairs_are_consecutive_actions() -> None:
    program = dualpipev(2, 4).actions[1]  # rank 1: stages 1 and 2
    text = " ".join(str(a) for a in program)
    # Step 2: F0 F1 pairs; step 4: F0 then a full B1 (B, W), F1 then a full B0.
    assert text.startswith("F1,0 F2,0 F1,1 F2,1 F1,2 B2,0 W2,0 F2,2 B1,0 W1,0")
    # Step 6 switches to split backward half-way; step 8 runs the queued W's.
    assert text.endswith("B2,2 W2,2 B1,2 W1,2 B2,3 B1,3 W2,3 W1,3")


# --- looped BFS ----------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(ranks, microbatches, st.integers(1, 4))
def test_looped_bfs_is_gpipes_chunked_order(p: int, m: int, v: int) -> None:
    schedule = looped_bfs(p, m, v)
    assert schedule.actions == gpipe(p, m, v).actions
    assert schedule.name == "looped-bfs"
    for rank, program in enumerate(schedule.actions):
        forward_chunks = [a.stage // p for a in program if a.kind == "F"]
        assert forward_chunks == sorted(forward_chunks)
        backward_chunks = [a.stage // p for a in program if a.kind == "B"]
        assert backward_chunks == sorted(backward_chunks, reverse=True)
        assert all(a.stage % p == rank for a in program)


# --- the memory-bounded auto scheduler ----------------------------------------------------

stage_costs = st.tuples(*[st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0])] * 3)


@st.composite
def auto_cases(draw: st.DrawFn) -> tuple[int, int, CostSpec, float]:
    p = draw(st.integers(1, 6))
    m = draw(st.integers(1, 16))
    per_stage = draw(st.booleans())
    cost = draw(st.lists(stage_costs, min_size=p, max_size=p)) if per_stage else draw(stage_costs)
    comm = draw(st.sampled_from([0.0, 0.0, 0.25, 1.0]))
    return p, m, cost, comm


@settings(max_examples=120, deadline=None)
@given(auto_cases())
def test_auto_is_never_worse_than_zb_h1_at_cap_p(case: tuple[int, int, CostSpec, float]) -> None:
    p, m, cost, comm = case
    schedule = validate(zero_bubble_auto(p, m, cost, comm=comm))
    assert schedule.name == "zb-auto" and schedule.split_backward
    auto = simulate(schedule, cost, comm)
    h1 = simulate(zb_h1(p, m), cost, comm)
    assert auto.makespan <= h1.makespan + 1e-9
    assert max(auto.peak_activations) <= p


@settings(max_examples=120, deadline=None)
@given(auto_cases(), st.integers(1, 16))
def test_auto_respects_the_memory_cap(case: tuple[int, int, CostSpec, float], cap: int) -> None:
    p, m, cost, comm = case
    schedule = validate(zero_bubble_auto(p, m, cost, microbatch_cap=cap, comm=comm))
    assert max(simulate(schedule).peak_activations) <= cap


def test_auto_beats_zb_h1_when_the_last_stage_has_a_heavy_weight_gradient() -> None:
    # Stage 3's F and B are cheap and its W is expensive (say a large output projection):
    # ZB-H1's fixed W lag leaves bubbles; the greedy scheduler fills them with W's and
    # gets back to the uniform-cost makespan, at the same memory cap.
    cost = [(1.0, 1.0, 1.0)] * 3 + [(0.5, 0.5, 2.0)]
    auto = simulate(zero_bubble_auto(4, 8, cost), cost)
    h1 = simulate(zb_h1(4, 8), cost)
    assert (auto.makespan, h1.makespan) == (27.0, 29.0)
    assert max(auto.peak_activations) <= 4


def test_auto_trades_memory_for_time() -> None:
    times = [simulate(zero_bubble_auto(4, 8, microbatch_cap=cap)).makespan for cap in (1, 2, 3, 4)]
    # Cap 1: rank 0 takes the next micro-batch only after its W, so each micro-batch
    # costs 4 F + 4 B + 1 W in a row. Cap 4 = p: ZB-H1's 27.
    assert times == [72.0, 41.0, 33.0, 27.0]


@pytest.mark.parametrize("limit", [0, 0.5, -1, float("nan"), True, "4"])
def test_auto_rejects_bad_memory_limits(limit: object) -> None:
    with pytest.raises(ConfigError, match="microbatch_cap must be a number of micro-batches >= 1"):
        zero_bubble_auto(4, 8, microbatch_cap=limit)  # type: ignore[arg-type]


def test_auto_rejects_costs_for_the_wrong_number_of_stages() -> None:
    with pytest.raises(ConfigError, match="got costs for 3 stages, but the schedule has 4"):
        zero_bubble_auto(4, 8, [(1.0, 1.0, 1.0)] * 3)


def test_greedy_engine_with_uneven_costs_and_comm_is_a_valid_execution() -> None:
    placement = loop_placement(3, 1)
    run = greedy_run(placement, 5, [(1.0, 2.0, 0.5)] * 3, [2] * 3, comm=0.7)
    assert run is not None
    schedule = Schedule("g", 3, 5, placement, tuple(map(tuple, run.programs)), split_backward=True)
    assert max(simulate(validate(schedule)).peak_activations) <= 2
    with pytest.raises(ConfigError, match="fill must be one of"):
        greedy_run(placement, 5, [(1.0, 1.0, 1.0)] * 3, [2] * 3, fill="sometimes")


# --- command line ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_cli_simulates_every_name(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    v = default_chunks(name)
    argv = ["simulate", "--schedule", name, "--ranks", "4", "--microbatches", "8"]
    assert main([*argv, "--chunks", str(v), "--cost", "1,1,1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = simulate(get_schedule(name, 4, 8, v))
    assert data["schedule"] == name and data["chunks"] == v
    assert data["makespan"] == expected.makespan
    assert data["peak_activations"] == list(expected.peak_activations)


def test_cli_reports_a_v_schedule_without_chunks_in_one_sentence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--schedule", "zbv", "--ranks", "4", "--microbatches", "8", "--chunks", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "pass --chunks 2" in err and err.count("\n") == 1


@pytest.mark.slow
def test_generating_and_validating_large_zero_bubble_schedules_is_fast() -> None:
    for name, v in (("zb-h1", 1), ("zbv", 2)):
        start = time.process_time()
        get_schedule(name, 64, 512, v)
        # About 0.3 s (zb-h1) and 0.7 s (zbv, twice the actions) on a loaded 2-core box;
        # generous for CI, but far below quadratic time.
        assert time.process_time() - start < 4.0


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 32))
def test_zb_late_is_1f1b_then_every_w(p: int, m: int) -> None:
    sched = get_schedule("zb-late", p, m)
    base = get_schedule("1f1b", p, m)
    for rank in range(p):
        program = sched.actions[rank]
        assert program[: 2 * m] == base.actions[rank]  # 1F1B's F/B order, B now input-only
        assert program[2 * m :] == tuple(Action(W, rank, mb) for mb in range(m))
    result = simulate(sched)
    # Counted whole, every micro-batch is held until the W's at the end.
    assert peak_activations(sched, w_memory=1.0) == (float(m),) * p
    assert result.makespan == 2 * (m + p - 1) + m  # F=B=W=1: the 1F1B part, then m W's
