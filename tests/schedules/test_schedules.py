"""Schedule generators, validation and the text table (the registry: test_registry.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.errors import ScheduleError
from conveyor.schedules import (
    Action,
    Schedule,
    dependencies,
    execution_order,
    from_table,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    load_schedule,
    loop_placement,
    make_schedule,
    one_f_one_b,
    save_schedule,
    to_table,
    validate,
)
from conveyor.schedules.interleaved import megatron_warmup

ranks = st.integers(1, 8)
microbatches = st.integers(1, 32)
chunks = st.integers(1, 4)


@st.composite
def named_schedules(draw: st.DrawFn) -> Schedule:
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]))
    if name == "1f1b":
        v = 1
    elif name == "interleaved-1f1b":
        v = draw(st.integers(2, 4))  # one chunk: the name is refused (it would be 1F1B)
    else:
        v = draw(chunks)
    return get_schedule(name, draw(ranks), draw(microbatches), v)


def forwards_before_first_backward(program: tuple[Action, ...]) -> int:
    return next(i for i, a in enumerate(program) if a.kind == "B")


# --- generated schedules are valid --------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(named_schedules())
def test_generated_schedules_are_complete_and_in_dependency_order(schedule: Schedule) -> None:
    p, m, v = schedule.ranks, schedule.microbatches, schedule.chunks
    assert schedule.placement == loop_placement(p, v)
    assert not schedule.split_backward
    expected = {(k, s, mb) for k in "FB" for s in range(p * v) for mb in range(m)}
    seen = [a for _, a in schedule]
    assert len(seen) == len(expected) and set(seen) == expected
    for rank, program in enumerate(schedule.actions):
        assert all(schedule.placement[a.stage] == rank for a in program)
        position = {a: i for i, a in enumerate(program)}
        for i, action in enumerate(program):
            for dep in dependencies(schedule, action):
                assert position.get(dep, -1) < i
    order = execution_order(schedule)
    assert len(order) == len(expected)
    done: set[Action] = set()
    for _, action in order:
        assert all(d in done for d in dependencies(schedule, action))
        done.add(action)


@pytest.mark.slow  # an exhaustive sweep; the property tests cover it in the fast lane
def test_interleaved_is_valid_for_every_size_up_to_8_ranks_32_microbatches() -> None:
    # Exhaustive: this is where Megatron's own warm-up rule would deadlock.
    for p in range(1, 9):
        for m in range(1, 33):
            for v in range(1, 5):
                validate(interleaved_1f1b(p, m, v))


@settings(max_examples=100, deadline=None)
@given(ranks, microbatches, chunks)
def test_gpipe_runs_all_forwards_then_all_backwards(p: int, m: int, v: int) -> None:
    schedule = gpipe(p, m, v)
    for rank, program in enumerate(schedule.actions):
        kinds = "".join(a.kind for a in program)
        assert kinds == "F" * (m * v) + "B" * (m * v)
        stages = [c * p + rank for c in range(v) for _ in range(m)]
        assert [a.stage for a in program[: m * v]] == stages


@settings(max_examples=100, deadline=None)
@given(ranks, microbatches)
def test_1f1b_warms_up_with_p_minus_rank_forwards_then_alternates(p: int, m: int) -> None:
    schedule = one_f_one_b(p, m)
    for rank, program in enumerate(schedule.actions):
        warm = min(p - rank, m)
        assert forwards_before_first_backward(program) == warm
        steady = program[warm - 1 : warm - 1 + 2 * (m - warm + 1)]
        assert "".join(a.kind for a in steady) == "FB" * (m - warm + 1)
        assert [a.microbatch for a in program if a.kind == "F"] == list(range(m))
        assert [a.microbatch for a in program if a.kind == "B"] == list(range(m))


@settings(max_examples=100, deadline=None)
@given(ranks, microbatches)
def test_interleaved_with_one_chunk_is_1f1b(p: int, m: int) -> None:
    assert interleaved_1f1b(p, m, 1).actions == one_f_one_b(p, m).actions


@settings(max_examples=100, deadline=None)
@given(ranks, st.integers(1, 6), st.integers(2, 4))
def test_interleaved_matches_megatron_when_ranks_divide_microbatches(
    p: int, groups: int, v: int
) -> None:
    m = p * groups
    schedule = interleaved_1f1b(p, m, v)
    for rank, program in enumerate(schedule.actions):
        warm = megatron_warmup(p, v, rank)
        assert forwards_before_first_backward(program) == min(warm + 1, m * v)
        first = program[0]
        assert first == Action("F", rank, 0)
        # Megatron's order: groups of p micro-batches through chunk 0, 1, ...
        forwards = [(a.stage // p, a.microbatch) for a in program if a.kind == "F"]
        assert forwards[: p * v] == [(c, mb) for c in range(v) for mb in range(p)]
        backwards = [(a.stage // p, a.microbatch) for a in program if a.kind == "B"]
        assert backwards[: p * v] == [(c, mb) for c in reversed(range(v)) for mb in range(p)]


def test_megatron_warmup_formula() -> None:
    assert [megatron_warmup(4, 2, r) for r in range(4)] == [10, 8, 6, 4]
    assert [megatron_warmup(2, 3, r) for r in range(2)] == [6, 4]


def test_generating_and_validating_a_large_schedule_is_fast() -> None:
    start = time.process_time()
    get_schedule("1f1b", 64, 512)
    # About 0.2 s on a laptop; generous for loaded CI, but far below quadratic time.
    assert time.process_time() - start < 5.0


# --- hand-broken schedules are rejected with the rank and action ----------------------------


def one_f_one_b_programs(p: int = 3, m: int = 4) -> list[list[Action]]:
    return [list(program) for program in one_f_one_b(p, m).actions]


def build(programs: list[list[Action]], p: int = 3, m: int = 4) -> Schedule:
    return make_schedule("broken", p, m, loop_placement(p, 1), programs)


def test_missing_backward_is_rejected() -> None:
    programs = one_f_one_b_programs()
    programs[1].remove(Action("B", 1, 2))
    with pytest.raises(ScheduleError, match=r"rank 1: action B1,2 is missing"):
        validate(build(programs))


def test_backward_before_its_forward_is_rejected() -> None:
    programs = one_f_one_b_programs()
    i, j = programs[2].index(Action("F", 2, 0)), programs[2].index(Action("B", 2, 0))
    programs[2][i], programs[2][j] = programs[2][j], programs[2][i]
    with pytest.raises(ScheduleError, match=r"rank 2: action B2,0 comes before F2,0"):
        validate(build(programs))


def test_cyclic_wait_across_ranks_is_rejected() -> None:
    programs = [
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
        [Action("F", 1, 1), Action("F", 1, 0), Action("B", 1, 0), Action("B", 1, 1)],
    ]
    with pytest.raises(ScheduleError, match="deadlocks") as error:
        validate(build(programs, p=2, m=2))
    message = str(error.value)
    assert "rank 0 at B0,0 waits for B1,0 on rank 1" in message
    assert "rank 1 at F1,1 waits for F0,1 on rank 0" in message


def test_duplicated_action_is_rejected() -> None:
    programs = one_f_one_b_programs()
    programs[0].append(Action("F", 0, 3))
    with pytest.raises(ScheduleError, match=r"rank 0: action F0,3 appears twice"):
        validate(build(programs))


def test_action_on_the_wrong_rank_is_rejected() -> None:
    programs = one_f_one_b_programs()
    programs[1].remove(Action("F", 1, 0))
    programs[0].insert(0, Action("F", 1, 0))
    with pytest.raises(ScheduleError, match=r"rank 0: action F1,0 runs stage 1, .* on rank 1"):
        validate(build(programs))


def test_weight_action_without_split_backward_is_rejected() -> None:
    programs = one_f_one_b_programs()
    programs[0].append(Action("W", 0, 0))
    with pytest.raises(ScheduleError, match=r"rank 0: action W0,0 .*split_backward"):
        validate(build(programs))


# --- text table ----------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(named_schedules())
def test_table_round_trips(schedule: Schedule) -> None:
    text = to_table(schedule)
    assert from_table(text) == schedule
    assert to_table(from_table(text)) == text


def test_table_format() -> None:
    assert to_table(one_f_one_b(2, 2)) == (
        "# conveyor schedule\n"
        "name: 1f1b\n"
        "ranks: 2\n"
        "microbatches: 2\n"
        "placement: 0 1\n"
        "split_backward: false\n"
        "rank 0: F0,0 F0,1 B0,0 B0,1\n"
        "rank 1: F1,0 B1,0 F1,1 B1,1\n"
    )


def test_hand_written_table_with_comments_and_continued_rank_lines() -> None:
    text = """
    # my tweak of 1F1B: rank 0 runs both forwards first
    ranks: 2
    microbatches: 2
    placement: 0 1

    rank 1: F1,0 B1,0
    rank 0: F0,0 F0,1
    rank 0: B0,0 B0,1
    rank 1: F1,1 B1,1
    """
    schedule = from_table(text)
    assert schedule.name == "custom"
    assert schedule.actions == one_f_one_b(2, 2).actions


def test_split_backward_table_round_trips() -> None:
    programs = [
        [Action("F", 0, 0), Action("B", 0, 0), Action("W", 0, 0)],
        [Action("F", 1, 0), Action("B", 1, 0), Action("W", 1, 0)],
    ]
    schedule = validate(make_schedule("zb", 2, 1, (0, 1), programs, split_backward=True))
    text = to_table(schedule)
    assert "split_backward: true" in text
    assert from_table(text) == schedule


GOOD = "ranks: 2\nmicrobatches: 1\nplacement: 0 1\nrank 0: F0,0 B0,0\nrank 1: F1,0 B1,0\n"


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        (GOOD.replace("F1,0 B1,0", "F1,0 X1,0"), r"line 5: cannot read action 'X1,0'"),
        (GOOD.replace("F0,0 B0,0", "F0,0 B0"), r"line 4: cannot read action 'B0'"),
        (GOOD.replace("ranks: 2", "ranks: two"), r"line 1: ranks must be an integer"),
        (GOOD.replace("rank 1:", "rank 2:"), r"line 5: rank 2 is out of range 0..1"),
        (GOOD.replace("placement: 0 1", "stages: 0 1"), r"line 3: cannot read 'stages: 0 1'"),
        (GOOD + "ranks: 2\n", r"line 6: ranks is given twice"),
        ("rank 0: F0,0\n" + GOOD, r"line 1: 'ranks: N' must come before"),
        (GOOD.replace("placement: 0 1\n", ""), r"the 'placement:' line is missing"),
        (GOOD.replace("rank 1: F1,0 B1,0\n", ""), r"no line for rank 1"),
        (GOOD + "split_backward: maybe\n", r"line 6: split_backward must be true or false"),
    ],
)
def test_table_parse_errors_name_the_line(text: str, pattern: str) -> None:
    with pytest.raises(ScheduleError, match=pattern):
        from_table(text)


def test_table_that_parses_but_deadlocks_names_rank_and_action() -> None:
    text = GOOD.replace("rank 0: F0,0 B0,0", "rank 0: B0,0 F0,0")
    with pytest.raises(ScheduleError, match=r"rank 0: action B0,0 comes before F0,0"):
        from_table(text)


def test_save_and_load(tmp_path: Path) -> None:
    path = tmp_path / "sched.txt"
    schedule = interleaved_1f1b(3, 7, 2)
    save_schedule(schedule, path)
    assert load_schedule(path) == schedule
    path.write_text(to_table(schedule).replace("B3,6", "B3,x"))
    with pytest.raises(ScheduleError, match=rf"{path} line 7: cannot read action 'B3,x'"):
        load_schedule(path)


# --- a hand-edited table drives a real pipeline ---------------------------------------------

ZB_H1_RANK_0 = "rank 0: F0,0 F0,1 B0,0 W0,0 F0,2 B0,1 W0,1 F0,3 B0,2 W0,2 B0,3 W0,3"
# Micro-batch 0's weight gradient moved to the very end (a W may always run later).
EDITED_RANK_0 = "rank 0: F0,0 F0,1 B0,0 F0,2 B0,1 W0,1 F0,3 B0,2 W0,2 B0,3 W0,3 W0,0"
# The last forward before micro-batch 1's W (neither depends on the other).
ZB_H1_RANK_1, EDITED_RANK_1 = "B1,2 W1,1 F1,3 B1,3", "B1,2 F1,3 W1,1 B1,3"


def test_a_hand_edited_table_runs_in_a_pipeline_with_the_unsplit_gradients() -> None:
    import torch
    from torch import nn

    import conveyor
    from tests.support.helpers import assert_close, grads_of
    from tests.support.models import batch, mlp

    base = get_schedule("zb-h1", 2, 4)
    text = to_table(base)
    assert ZB_H1_RANK_0 in text and ZB_H1_RANK_1 in text
    edited = (
        text.replace(ZB_H1_RANK_0, EDITED_RANK_0)
        .replace(ZB_H1_RANK_1, EDITED_RANK_1)
        .replace("name: zb-h1", "name: mine")
    )
    schedule = from_table(edited)  # validates
    assert schedule.name == "mine" and schedule.split_backward
    assert schedule.actions[0][-1] == Action("W", 0, 0) and base.actions[0][3] == Action("W", 0, 0)
    for rank in range(2):
        assert schedule.actions[rank] != base.actions[rank]
        assert sorted(schedule.actions[rank]) == sorted(base.actions[rank])

    x, y = batch(10)
    model = mlp()
    want_loss = nn.functional.mse_loss(model(x), y)
    want_loss.backward()
    pipe = conveyor.Pipeline(
        mlp(),
        loss_fn=nn.functional.mse_loss,
        microbatches=4,
        schedule=schedule,
        context=conveyor.init(pp=2),
    )
    assert pipe.schedule == schedule
    loss = pipe.train_step(x, y)
    assert isinstance(loss, torch.Tensor)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-6)
    assert_close(
        grads_of(pipe.named_parameters()),
        grads_of(model.named_parameters()),
        "hand-edited zb-h1 grads",
    )
    # Each rank's actions ran in the edited order.
    timings = pipe.last_step_timings()
    ran = [tuple(Action(t[1], t[2], t[3]) for t in timings if t[0] == rank) for rank in range(2)]
    assert ran == list(schedule.actions)
