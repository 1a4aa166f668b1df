"""The simulator's fast path (:mod:`conveyor.schedules.fast_sim`): the reference walk's
timeline bit for bit on every schedule it takes (the registry's and random valid ones,
random costs and link), and every schedule it cannot take left to the reference; and
``validate``'s deadlock check through it says what the walk says."""

from __future__ import annotations

import dataclasses
import gc
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.errors import ScheduleError
from conveyor.schedules import (
    SCHEDULE_NAMES,
    Action,
    Schedule,
    get_schedule,
    make_schedule,
    validate,
)
from conveyor.schedules.core import KINDS, loop_placement, requires, v_placement
from conveyor.schedules.fast_sim import plan_of
from conveyor.schedules.kept import PerSchedule
from conveyor.schedules.simulation import (
    _walked,
    action_durations,
    bubble,
    normalize_cost,
    peak_activations,
    simulate,
)
from conveyor.schedules.vocab import with_vocab

Costs = list[tuple[float, float, float]]


def _same_as_the_walk(schedule: Schedule, cost: Costs, comm: float) -> None:
    got = simulate(schedule, cost, comm)
    durations = action_durations(schedule, normalize_cost(schedule, cost))
    events, vocab, busy, first, last, span = _walked(
        schedule, durations, comm, (0.0, 0.0), (0.0, 0.0, 0.0, 0.0)
    )
    assert got.events == events  # every (rank, action, start, end), floats exactly
    assert got.vocab_events == vocab == ()
    assert (got.makespan, got.span) == (last - first, span)
    assert got.bubble == bubble(busy, first, last, schedule.ranks)
    assert got.peak_activations == peak_activations(schedule)


def _costs(rng: random.Random, stages: int) -> Costs:
    # Some zeros (an empty W, an idle stage) and ties among the rest.
    pick = [0.0, 0.5, 1.0, 1.0, 2.5, rng.random() * 3]
    return [(rng.choice(pick), rng.choice(pick), rng.choice(pick)) for _ in range(stages)]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_registered_schedule_simulates_as_the_walk(name: str) -> None:
    rng = random.Random(name)
    taken = 0
    for p in (1, 2, 3, 4, 6):
        for m in (1, 2, 3, 5, 8, 12):
            for v in (1, 2, 3):
                try:
                    schedule = get_schedule(name, p, m, v)
                except Exception:  # sizes or chunks the schedule does not run
                    continue
                taken += plan_of(schedule) is not None
                for _ in range(2):
                    comm = rng.choice([0.0, 0.25, rng.random()])
                    _same_as_the_walk(schedule, _costs(rng, schedule.stages), comm)
    assert taken > 0  # pairs without all-to-all time (interleaved, dualpipev) too


def _random_schedule(seed: int, p: int, m: int, v_shape: bool, split: bool) -> Schedule:
    """A random valid schedule: ranks pick any ready action of theirs, in a random order."""
    rng = random.Random(seed)
    chunks = 2 if v_shape else rng.choice([1, 2, 3])
    placement = v_placement(p) if v_shape else loop_placement(p, chunks)
    stages = len(placement)
    kinds = KINDS if split else KINDS[:2]
    left = {Action(k, s, mb) for k in kinds for s in range(stages) for mb in range(m)}
    done: set[Action] = set()
    programs: list[list[Action]] = [[] for _ in range(p)]
    while left:
        ready = [a for a in left if all(d in done for d in requires(a, stages))]
        action = rng.choice(sorted(ready))
        programs[placement[action.stage]].append(action)
        done.add(action)
        left.remove(action)
    name = "random-v" if v_shape else "random"
    return validate(make_schedule(name, p, m, placement, programs, split_backward=split))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 10**6),
    st.integers(1, 5),
    st.integers(1, 6),
    st.booleans(),
    st.booleans(),
    st.sampled_from([0.0, 0.1, 0.7]),
)
def test_random_schedules_and_costs_simulate_as_the_walk(
    seed: int, p: int, m: int, v_shape: bool, split: bool, comm: float
) -> None:
    schedule = _random_schedule(seed, p, m, v_shape, split)
    assert plan_of(schedule) is not None
    _same_as_the_walk(schedule, _costs(random.Random(seed), schedule.stages), comm)


def _program(text: str) -> list[Action]:
    return [Action(a[0], int(a[1:].split(",")[0]), int(a.split(",")[1])) for a in text.split()]


ONE_F_ONE_B = ["F0,0 F0,1 B0,0 B0,1", "F1,0 B1,0 F1,1 B1,1"]


def _plain(programs: list[str], placement: tuple[int, ...] = (0, 1)) -> Schedule:
    return make_schedule("hand", len(programs), 2, placement, [_program(p) for p in programs])


@pytest.mark.parametrize(
    "why, schedule",
    [
        ("an action twice", _plain(["F0,0 F0,1 B0,0 B0,1 B0,1", ONE_F_ONE_B[1]])),
        ("on another rank", _plain(["F0,0 F0,1 B0,0", "F1,0 B1,0 F1,1 B1,1 B0,1"])),
        ("a stage out of range", _plain(["F0,0 F0,1 B0,0 B0,1", "F1,0 B1,0 F2,1"])),
        ("a missing need", _plain(["F0,0 F0,1 B0,0 B0,1", "F1,0 B1,0 B1,1"])),
        ("a need later on its rank", _plain(["F0,0 B0,0 B0,1 F0,1", ONE_F_ONE_B[1]])),
        ("a need later, one rank", _plain(["B0,0 F0,0 F0,1 B0,1"], placement=(0,))),
        ("ranks waiting on each other", _plain(["F0,0 B0,0 F0,1 B0,1", "F1,1 F1,0 B1,0 B1,1"])),
        ("more programs than ranks", dataclasses.replace(_plain(ONE_F_ONE_B), ranks=1)),
        ("vocabulary passes", with_vocab(get_schedule("1f1b", 2, 2))),
    ],
)
def test_what_the_plan_cannot_take_goes_to_the_walk(why: str, schedule: Schedule) -> None:
    assert plan_of(schedule) is None, why
    cost = [(1.0, 2.0, 0.5)] * schedule.stages
    try:
        expected = _walked(
            schedule,
            action_durations(schedule, normalize_cost(schedule, cost)),
            0.1,
            (0.0, 0.0),
            (0.0, 0.0, 0.0, 0.0),
        )
    except (ScheduleError, IndexError) as error:  # the walk's own verdict
        with pytest.raises(type(error), match=re.escape(str(error))):
            simulate(schedule, cost, 0.1)
        return
    assert simulate(schedule, cost, 0.1).events == expected[0]


def test_a_pair_that_deadlocks_as_a_unit_has_no_plan() -> None:
    # Rank 0's pair F0,1+B0,0 waits for B1,0, which rank 1 runs after F1,1, which needs
    # F0,1: inside the pair. Without the pair the ranks run it.
    plain = _plain(["F0,0 F0,1 B0,0 B0,1", "F1,0 F1,1 B1,1 B1,0"])
    assert plan_of(plain) is not None
    paired = dataclasses.replace(plain, pairs=((1,), ()))
    assert plan_of(paired) is None
    with pytest.raises(ScheduleError, match=r"rank 0 at F0,1\+B0,0 waits for B1,0"):
        simulate(paired, (1.0, 1.0, 0.0))


def test_validate_says_what_the_walk_says_of_a_deadlock() -> None:
    stuck = _plain(["F0,0 B0,0 F0,1 B0,1", "F1,1 F1,0 B1,0 B1,1"])
    with pytest.raises(ScheduleError) as error:
        validate(stuck)
    assert str(error.value) == (
        "schedule 'hand' deadlocks: rank 0 at B0,0 waits for B1,0 on rank 1; rank 1 at "
        "F1,1 waits for F0,1 on rank 0; reorder the actions so every wait is on work that "
        "can finish first"
    )
    with pytest.raises(ScheduleError, match="comes before F0,1, which it needs; swap them"):
        validate(_plain(["F0,0 B0,0 B0,1 F0,1", ONE_F_ONE_B[1]]))
    with pytest.raises(ScheduleError, match="B0,0 comes before F0,0, which it needs; swap"):
        validate(_plain(["B0,0 F0,0 F0,1 B0,1"], placement=(0,)))


def test_a_plan_is_kept_while_its_schedule_lives() -> None:
    made: list[int] = []
    per = PerSchedule(lambda s: made.append(s.microbatches) or len(made))
    one, two = get_schedule("1f1b", 2, 3), get_schedule("1f1b", 2, 3)
    assert (per(one), per(one), per(two), per(one)) == (1, 1, 2, 1)
    assert made == [3, 3] and len(per.kept) == 2
    del one
    gc.collect()
    assert len(per.kept) == 1 and per(two) == 2
