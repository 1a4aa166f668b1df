"""The one walk of a schedule (conveyor.schedules.order): typed instructions, each rank's
program in order, pairs as one unit, passes as barriers, one deadlock message; the one
dependency rule; the tables that carry every field; the stage lookup of copies."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conveyor.errors import ConfigError, ScheduleError
from conveyor.schedules import (
    SCHEDULE_NAMES,
    Action,
    Compute,
    Pass,
    Schedule,
    default_chunks,
    execution_order,
    from_table,
    get_schedule,
    paired,
    to_table,
    validate,
    walk,
)
from conveyor.schedules.core import requires
from conveyor.schedules.order import instructions
from conveyor.schedules.pairs import paired_with_vocab
from conveyor.schedules.vocab import merged_order, with_vocab

FAST = settings(max_examples=60, deadline=None)


@functools.cache
def _named(name: str, p: int, m: int, pairs: bool, vocab: bool) -> Schedule | None:
    """A named schedule, paired or not, with vocabulary passes or not (None where the
    generator refuses the sizes)."""
    try:
        schedule = get_schedule(name, p, m, default_chunks(name))
    except ConfigError:
        return None
    if pairs:
        schedule = paired(schedule)
    if vocab:
        schedule = paired_with_vocab(with_vocab(schedule, (1.0, 2.0, 1.0)), schedule.pairs)
    return schedule


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    """Every generator at p 1..4 and m 1..9, paired or not, with passes or not."""
    name = draw(st.sampled_from(SCHEDULE_NAMES))
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 9))
    schedule = _named(name, p, m, draw(st.booleans()), draw(st.booleans()))
    assume(schedule is not None)
    assert schedule is not None
    return schedule


def _rank_of(step: Compute | Pass, schedule: Schedule) -> list[int]:
    return list(range(schedule.ranks)) if isinstance(step, Pass) else [step.rank]


@FAST
@given(schedules())
def test_the_walk_runs_each_program_in_order_pairs_as_units_and_passes_as_barriers(
    schedule: Schedule,
) -> None:
    steps = walk(schedule)
    assert len(steps) == len(set(steps))
    computes = [s for s in steps if isinstance(s, Compute)]
    assert [s for s in steps if isinstance(s, Pass)] == list(schedule.vocab)
    # Each rank's instructions, in its program's order: its actions, a pair grouped.
    for rank in range(schedule.ranks):
        mine = [s for s in steps if rank in _rank_of(s, schedule)]
        assert tuple(mine) == instructions(schedule, rank)
        assert [a for s in computes if s.rank == rank for a in s.actions] == list(
            schedule.actions[rank]
        )
        units = [s.actions for s in computes if s.rank == rank and s.paired is not None]
        program = schedule.actions[rank]
        assert units == [program[i : i + 2] for i in sorted(schedule.pair_starts(rank))]
    # Every action after what it needs (a pair's two after the needs of both).
    at = {a: k for k, s in enumerate(steps) if isinstance(s, Compute) for a in s.actions}
    for step in computes:
        for a in step.actions:
            assert schedule.placement[a.stage] == step.rank
            assert all(at[d] < at[a] for d in requires(a, schedule.stages))
    assert sum(len(s.actions) for s in computes) == sum(map(len, schedule.actions))
    # A pass after every action before its slot on every rank, before every one after.
    where = {s: k for k, s in enumerate(steps)}
    for k, v in enumerate(schedule.vocab):
        for rank, row in enumerate(schedule.vocab_slots):
            assert all(at[a] < where[v] for a in schedule.actions[rank][: row[k]])
            assert all(at[a] > where[v] for a in schedule.actions[rank][row[k] :])
    # The flat views are the walk's order.
    assert execution_order(schedule) == [(s.rank, a) for s in computes for a in s.actions]
    flat = [x for s in steps for x in (s.actions if isinstance(s, Compute) else (s,))]
    assert merged_order(schedule) == flat


@pytest.mark.parametrize(
    ("action", "needs"),
    [
        (Action("F", 0, 3), ()),
        (Action("F", 2, 3), (Action("F", 1, 3),)),
        (Action("B", 3, 1), (Action("F", 3, 1),)),  # the last stage
        (Action("B", 2, 1), (Action("F", 2, 1), Action("B", 3, 1))),
        (Action("B", 0, 0), (Action("F", 0, 0), Action("B", 1, 0))),
        (Action("W", 1, 2), (Action("B", 1, 2),)),
    ],
)
def test_the_dependency_rule(action: Action, needs: tuple[Action, ...]) -> None:
    assert requires(action, 4) == needs


def test_a_pair_waits_for_the_dependencies_of_both_its_actions() -> None:
    # Rank 0: F0,0 F0,1 B0,0 B0,1 with F0,1+B0,0 paired: the pair waits for B1,0 (its B's
    # need), so F0,1 runs after rank 1's B1,0, which is not so without the pair.
    base = get_schedule("1f1b", 2, 2)
    both = dataclasses.replace(base, pairs=((1,), ()))
    assert validate(both).pairs == ((1,), ())
    alone = execution_order(base)
    together = execution_order(both)
    assert alone.index((0, Action("F", 0, 1))) < alone.index((1, Action("B", 1, 0)))
    assert together.index((0, Action("F", 0, 1))) > together.index((1, Action("B", 1, 0)))
    assert Compute(0, Action("F", 0, 1), Action("B", 0, 0)) in walk(both)


def _vocab_1f1b() -> Schedule:
    return with_vocab(get_schedule("1f1b", 2, 1))


def test_one_deadlock_message_names_ranks_waiting_at_a_pass() -> None:
    # rank 0: E0 F0,0 S0 T0 B0,0 G0 -> E0 S0 T0 F0,0 B0,0 G0; rank 1: E0 F1,0 S0 T0 B1,0 G0.
    # Rank 1 needs F0,0 before S0; rank 0 now runs it after S0.
    placed = _vocab_1f1b()
    assert placed.vocab_slots == ((0, 1, 1, 2), (0, 1, 1, 2))
    bad = dataclasses.replace(placed, vocab_slots=((0, 0, 0, 2), (0, 1, 1, 2)))
    with pytest.raises(ScheduleError) as error:
        validate(bad)
    assert str(error.value) == (
        "schedule '1f1b' deadlocks: rank 0 waits at the pass S0 for every rank; rank 1 at "
        "F1,0 waits for F0,0 on rank 0; reorder the actions or the passes so every wait is "
        "on work that can finish first"
    )


def test_a_pass_inside_a_pair_is_refused_by_validate_and_by_the_table() -> None:
    # Rank 0 of 1F1B (p 2, m 3) with passes: F0,0 F0,1 S0 T0 B0,0 ...; 1F1B's pair
    # F0,1+B0,0 would hold S0 inside it.
    schedule = with_vocab(get_schedule("1f1b", 2, 3))
    assert paired(get_schedule("1f1b", 2, 3)).pairs == ((1, 3), ())
    assert schedule.vocab_slots[0][schedule.vocab.index(Pass("S", 0))] == 2
    split = dataclasses.replace(schedule, pairs=((1,), ()))
    message = "rank 0 runs the pass S0 inside its pair F0,1\\+B0,0; run the pass before or after"
    with pytest.raises(ScheduleError, match=message):
        validate(split)
    with pytest.raises(ScheduleError, match="to_table cannot write schedule '1f1b'"):
        to_table(split)
    assert paired_with_vocab(schedule, ((1, 3), ())).pairs == ((3,), ())  # 1 left apart


# --- tables carry every field ---------------------------------------------------------------

NAMES = (
    st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1, max_size=12)
    .map(str.strip)
    .filter(bool)
)


@FAST
@given(schedules(), NAMES)
def test_tables_carry_every_field(schedule: Schedule, name: str) -> None:
    schedule = dataclasses.replace(schedule, name=name)
    text = to_table(schedule)
    back = from_table(text)
    for field in dataclasses.fields(Schedule):
        if field.compare:
            assert getattr(back, field.name) == getattr(schedule, field.name), field.name
    assert back == schedule and to_table(back) == text
    for v in schedule.vocab:
        assert f" {v}" in text  # each pass written on the rank lines


def test_a_table_writes_passes_where_each_rank_runs_them() -> None:
    text = to_table(with_vocab(get_schedule("1f1b", 2, 1)))
    assert "rank 0: E0 F0,0 S0 T0 B0,0 G0\n" in text
    assert "rank 1: E0 F1,0 S0 T0 B1,0 G0\n" in text
    with pytest.raises(ScheduleError, match="rank 1 lists other vocabulary passes than rank 0"):
        from_table(text.replace("rank 1: E0 F1,0 S0 T0", "rank 1: E0 F1,0 T0 S0"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": "two\nlines"}, "to_table cannot write schedule 'two\\\\nlines'"),
        ({"name": " padded"}, "its name ' padded' would read back as 'padded'"),
        ({"pairs": ((5,), ())}, "rank 0's pairs or vocabulary slots do not fit its program"),
        ({"pairs": ((-1,), ())}, r"its pairs \(\(-1,\), \(\)\) would read back as \(\)"),
        ({"vocab_slots": ()}, "rank 0's pairs or vocabulary slots do not fit its program"),
    ],
)
def test_to_table_refuses_what_it_cannot_carry(change: dict[str, object], message: str) -> None:
    schedule = _vocab_1f1b() if "vocab_slots" in change else get_schedule("1f1b", 2, 3)
    with pytest.raises(ScheduleError, match=message):
        to_table(dataclasses.replace(schedule, **change))  # type: ignore[arg-type]


def test_no_pair_on_any_rank_is_stored_as_no_pairs() -> None:
    schedule = dataclasses.replace(get_schedule("1f1b", 2, 3), pairs=((), ()))
    assert schedule.pairs == () and from_table(to_table(schedule)) == schedule


# --- the stage lookup follows the placement -------------------------------------------------


def test_a_copy_with_another_placement_looks_up_its_own_stages() -> None:
    schedule = get_schedule("1f1b", 2, 2)
    assert schedule.stages_of(0) == (0,) and schedule.stages_of(1) == (1,)
    swapped = dataclasses.replace(
        schedule,
        placement=(1, 0),
        actions=tuple(
            tuple(Action(a.kind, 1 - a.stage, a.microbatch) for a in program)
            for program in schedule.actions
        ),
    )
    assert swapped.stages_of(0) == (1,) and swapped.stages_of(1) == (0,)
    assert schedule.stages_of(0) == (0,)  # the original is untouched
    assert swapped.stages_of(2) == ()


def test_schedules_stay_pure_python() -> None:
    # Every module of conveyor.schedules imported in a fresh interpreter loads no torch.
    code = (
        "import importlib, pkgutil, sys\n"
        "import conveyor.schedules as s\n"
        "for m in pkgutil.iter_modules(s.__path__):\n"
        "    importlib.import_module('conveyor.schedules.' + m.name)\n"
        "print(sorted(n for n in sys.modules if n == 'torch' or n.startswith('torch.')))\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env,
        timeout=120, check=True,
    )  # fmt: skip
    assert done.stdout.strip() == "[]"
