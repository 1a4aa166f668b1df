"""Vocabulary passes in schedules (E, S, T, G): placement, checks, merged order, and their
simulation (barriers that occupy every rank), text and picture timelines, the CLI."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conveyor.cli.command import main, parse_vocab
from conveyor.errors import ConfigError, ScheduleError
from conveyor.schedules import (
    SCHEDULE_NAMES,
    Action,
    Schedule,
    from_table,
    get_schedule,
    to_table,
    validate,
)
from conveyor.schedules.core import B, F, Pass, dependencies
from conveyor.schedules.vocab import check_vocab, merged_order, vocab_collectives, with_vocab
from conveyor.simulate import SimResult, ascii_timeline, normalize_vocab, simulate

NAMES = [name for name in SCHEDULE_NAMES if name != "auto"]
COSTS = [(1.0, 1.0, 1.0), (1.0, 2.0, 0.0), (2.0, 1.0, 0.5)]
FAST = settings(max_examples=40, deadline=None)


@functools.cache
def _base(name: str, p: int, m: int) -> Schedule | None:
    """The named schedule, or None where the generator refuses the sizes."""
    try:
        return get_schedule(name, p, m)
    except ConfigError:
        return None


@functools.cache
def _placed(name: str, p: int, m: int, cost: tuple[float, float, float]) -> Schedule:
    """The named schedule with its passes placed for ``cost``."""
    base = _base(name, p, m)
    assert base is not None
    return with_vocab(base, cost)


@st.composite
def cases(draw: st.DrawFn) -> tuple[Schedule, Schedule, tuple[float, float, float]]:
    """A named schedule (p 1..4, m up to 12), the same with passes, and the placing cost."""
    name = draw(st.sampled_from(NAMES))
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 12))
    base = _base(name, p, m)
    assume(base is not None)
    assert base is not None
    cost = draw(st.sampled_from(COSTS))
    return base, _placed(name, p, m, cost), cost


def _index(schedule: Schedule, action: Action) -> tuple[int, int]:
    """The rank that runs ``action`` and its index in that rank's program."""
    rank = schedule.placement[action.stage]
    return rank, schedule.actions[rank].index(action)


def _slot(schedule: Schedule, kind: str, m: int, rank: int) -> int:
    """Where ``rank`` runs pass ``kind`` of micro-batch ``m``."""
    return schedule.vocab_slots[rank][schedule.vocab.index(Pass(kind, m))]


def _with_slots(schedule: Schedule, rank: int, row: list[int]) -> Schedule:
    """``schedule`` with ``rank``'s slots replaced by ``row``."""
    slots = list(schedule.vocab_slots)
    slots[rank] = tuple(row)
    return dataclasses.replace(schedule, vocab_slots=tuple(slots))


# --- placement ------------------------------------------------------------------------


@FAST
@given(cases())
def test_placed_schedules_validate_and_post_one_sequence(
    case: tuple[Schedule, Schedule, tuple[float, float, float]],
) -> None:
    base, s, _ = case
    assert validate(s) is s
    assert s.actions == base.actions and s.pairs == ()
    assert len(s.vocab) == 4 * s.microbatches and len(s.vocab_slots) == s.ranks
    expected = vocab_collectives(s)
    for r, row in enumerate(s.vocab_slots):
        assert list(row) == sorted(row)
        assert all(0 <= i <= len(s.actions[r]) for i in row)
        # What rank r posts, walking its program and running the passes at their slots.
        posted = sorted(range(len(s.vocab)), key=lambda k: (row[k], k))
        names = {"E": ("reduce",), "S": ("broadcast", "all_gather"), "T": ("reduce",),
                 "G": ("broadcast",)}  # fmt: skip
        seq = [(c, s.vocab[k].microbatch) for k in posted for c in names[s.vocab[k].kind]]
        assert seq == expected


@FAST
@given(cases())
def test_passes_sit_where_their_data_is(
    case: tuple[Schedule, Schedule, tuple[float, float, float]],
) -> None:
    _, s, _ = case
    last = s.stages - 1
    order = [str(v) for v in s.vocab]
    for m in range(s.microbatches):
        ks = [order.index(f"{kind}{m}") for kind in "ESTG"]
        assert ks == sorted(ks)
        assert ks[2] == ks[1] + 1  # S and T of a micro-batch back to back
        rank, i = _index(s, Action(F, 0, m))
        assert _slot(s, "E", m, rank) <= i
        rank, i = _index(s, Action(F, last, m))
        assert _slot(s, "S", m, rank) > i
        rank, i = _index(s, Action(B, last, m))
        assert _slot(s, "T", m, rank) <= i
        rank, i = _index(s, Action(B, 0, m))
        assert _slot(s, "G", m, rank) > i


@FAST
@given(cases())
def test_merged_order_runs_everything_once_in_dependency_order(
    case: tuple[Schedule, Schedule, tuple[float, float, float]],
) -> None:
    _, s, _ = case
    steps = merged_order(s)
    actions = [a for a in steps if isinstance(a, Action)]
    passes = [v for v in steps if isinstance(v, Pass)]
    assert sorted(actions) == sorted(a for _, a in s) and len(steps) == len(set(steps))
    assert passes == list(s.vocab) and len(actions) + len(passes) == len(steps)
    at = {step: k for k, step in enumerate(steps)}
    for a in actions:
        assert all(at[d] < at[a] for d in dependencies(s, a))
    for r, program in enumerate(s.actions):
        assert [a for a in actions if s.placement[a.stage] == r] == list(program)
        for k, v in enumerate(s.vocab):
            slot = s.vocab_slots[r][k]
            assert all(at[a] < at[v] for a in program[:slot])
            assert all(at[a] > at[v] for a in program[slot:])


@FAST
@given(cases(), st.data())
def test_check_vocab_rejects_broken_schedules(
    case: tuple[Schedule, Schedule, tuple[float, float, float]], data: st.DataObject
) -> None:
    _, s, _ = case
    check_vocab(s)
    m = data.draw(st.integers(0, s.microbatches - 1))
    # A dropped pass.
    k = data.draw(st.integers(0, len(s.vocab) - 1))
    dropped = dataclasses.replace(
        s,
        vocab=s.vocab[:k] + s.vocab[k + 1 :],
        vocab_slots=tuple(row[:k] + row[k + 1 :] for row in s.vocab_slots),
    )
    with pytest.raises(ScheduleError, match="lacks"):
        validate(dropped)
    # A micro-batch's S and T in the wrong order.
    order = list(s.vocab)
    i, j = order.index(Pass("S", m)), order.index(Pass("T", m))
    order[i], order[j] = order[j], order[i]
    with pytest.raises(ScheduleError, match="out of order"):
        check_vocab(dataclasses.replace(s, vocab=tuple(order)))
    # Swapped slots: stage 0's rank runs the first pass (E0) after the last (a G).
    rank = s.placement[0]
    row = list(s.vocab_slots[rank])
    row[0], row[-1] = row[-1], row[0]
    with pytest.raises(ScheduleError, match="never decreasing"):
        check_vocab(_with_slots(s, rank, row))
    # S moved before its data (the last stage's forward), earlier passes along with it.
    last_rank, i = _index(s, Action(F, s.stages - 1, m))
    k = s.vocab.index(Pass("S", m))
    row = [min(slot, i) if q <= k else slot for q, slot in enumerate(s.vocab_slots[last_rank])]
    with pytest.raises(ScheduleError, match="must run after"):
        check_vocab(_with_slots(s, last_rank, row))
    # E moved after its consumer (stage 0's forward), later passes along with it.
    rank, i = _index(s, Action(F, 0, m))
    k = s.vocab.index(Pass("E", m))
    row = [max(slot, i + 1) if q >= k else slot for q, slot in enumerate(s.vocab_slots[rank])]
    with pytest.raises(ScheduleError, match="must run before"):
        check_vocab(_with_slots(s, rank, row))


# --- simulation -----------------------------------------------------------------------


def _busy(result: SimResult) -> float:
    """Busy time of every rank: actions and passes."""
    actions = sum(e.end - e.start for e in result.events)
    return actions + sum(e.end - e.start for e in result.vocab_events)


@FAST
@given(cases(), st.sampled_from([0.25, 1.0, 3.0]))
def test_passes_are_barriers_that_occupy_every_rank(
    case: tuple[Schedule, Schedule, tuple[float, float, float]], c: float
) -> None:
    base, s, cost = case
    p, m = s.ranks, s.microbatches
    without = simulate(base, cost)
    free = simulate(s, cost)  # no pass cost: barriers only
    paid = simulate(s, cost, vocab=c)
    # Barriers only add waits; the work is the same.
    assert free.makespan >= without.makespan - 1e-9
    assert _busy(free) == pytest.approx(_busy(without))
    # Every pass occupies every rank: the busy time grows by exactly p * 4 * m * c, and
    # (no comm) the makespan by exactly 4 * m * c: no action runs during a pass, and
    # cutting the passes out of the timeline leaves a valid run with free passes.
    assert _busy(paid) == pytest.approx(_busy(free) + p * 4 * m * c)
    assert paid.makespan == pytest.approx(free.makespan + 4 * m * c)
    assert paid.makespan >= without.makespan + 4 * m * c - 1e-9
    assert paid.bubble == pytest.approx(1 - _busy(paid) / (p * paid.makespan))
    assert len(paid.vocab_events) == p * 4 * m
    for k, v in enumerate(s.vocab):
        same = [e for e in paid.vocab_events if e.action == v]
        assert sorted(e.rank for e in same) == list(range(p))
        assert len({(e.start, e.end) for e in same}) == 1
        start, end = same[0].start, same[0].end
        assert end - start == pytest.approx(c)
        for r in range(p):
            slot = s.vocab_slots[r][k]
            mine = [e for e in paid.events if e.rank == r]
            assert all(e.end <= start + 1e-9 for e in mine[:slot])
            assert all(e.start >= end - 1e-9 for e in mine[slot:])
    assert paid.peak_activations == without.peak_activations


@FAST
@given(cases(), st.sampled_from([0.5, 2.0]), st.sampled_from([(0.0, 1.0, 2.0, 0.0), 0.5]))
def test_with_comm_the_passes_cost_at_most_their_time(
    case: tuple[Schedule, Schedule, tuple[float, float, float]],
    comm: float,
    vocab: float | tuple[float, ...],
) -> None:
    _, s, cost = case
    free = simulate(s, cost, comm=comm)
    paid = simulate(s, cost, comm=comm, vocab=vocab)
    total = s.microbatches * sum(normalize_vocab(vocab))
    assert free.makespan - 1e-9 <= paid.makespan <= free.makespan + total + 1e-9


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(COSTS), st.integers(1, 4), st.integers(1, 12))
def test_free_passes_cost_gpipe_nothing(cost: tuple[float, float, float], p: int, m: int) -> None:
    # GPipe's ranks all switch actions on one grid, so a barrier there waits for nobody.
    base = get_schedule("gpipe", p, m)
    assert simulate(with_vocab(base, cost), cost).makespan == pytest.approx(
        simulate(base, cost).makespan
    )


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 4), st.integers(1, 12), st.sampled_from([2.0, 4.0, 8.0]))
def test_vocab_parallel_1f1b_beats_an_output_layer_on_the_last_stage(
    p: int, m: int, output: float
) -> None:
    # Each stage costs (1, 1, 1); the output layer (output, output, output) on one rank.
    base = get_schedule("1f1b", p, m)
    heavy = [(1.0, 1.0, 1.0)] * (p - 1) + [(1.0 + output,) * 3]
    on_last = simulate(base, heavy)
    spread = simulate(
        with_vocab(base, (1.0, 1.0, 1.0)), (1.0, 1.0, 1.0), vocab=(0, output / p, 2 * output / p, 0)
    )
    assert spread.makespan < on_last.makespan


def test_vocab_cost_needs_passes_and_valid_numbers() -> None:
    base = get_schedule("1f1b", 2, 4)
    assert simulate(base, vocab=0).vocab_events == ()
    assert simulate(base, vocab=None).to_json_dict().keys() == simulate(base).to_json_dict().keys()
    with pytest.raises(ConfigError, match="no vocabulary passes"):
        simulate(base, vocab=1.0)
    assert normalize_vocab(None) == (0.0,) * 4
    assert normalize_vocab(2) == (2.0,) * 4
    assert normalize_vocab([1, 2, 3, 4]) == (1.0, 2.0, 3.0, 4.0)
    for bad in ((1, 2), -1.0, float("nan"), (1, 2, 3, "x"), True):
        with pytest.raises(ConfigError, match="vocab must be"):
            normalize_vocab(bad)  # type: ignore[arg-type]


TABLE = """# conveyor schedule
name: 1f1b
ranks: 2
microbatches: 1
placement: 0 1
split_backward: false
rank 0: E0 F0,0 S0 T0 B0,0 G0
rank 1: E0 F1,0 S0 T0 B1,0 G0
"""
"""A table with passes as the documented format writes it."""


def test_a_table_with_passes_reads_and_writes_as_documented() -> None:
    schedule = from_table(TABLE)
    assert schedule == with_vocab(get_schedule("1f1b", 2, 1))
    assert schedule.vocab == tuple(Pass(k, 0) for k in "ESTG") and to_table(schedule) == TABLE
    # A pass of a kind no stage ends run reads as a pass, and validation names it.
    with pytest.raises(ScheduleError, match="its pass X0 is of no kind the schedule knows"):
        from_table(TABLE.replace("G0", "X0"))
    with pytest.raises(ScheduleError, match="cannot read action 'W0'"):
        from_table(TABLE.replace("G0", "W0"))


def test_json_and_text_timeline_show_the_passes() -> None:
    s = with_vocab(get_schedule("1f1b", 2, 3))
    result = simulate(s, vocab=(0.5, 1, 1, 0.5))
    data = result.to_json_dict()
    assert data["vocab"] == [0.5, 1.0, 1.0, 0.5]
    assert "a2a" not in data and list(data)[-1] == "vocab"
    text = ascii_timeline(result, width=400)
    assert "E/S/T/G = vocabulary passes" in text
    rows = [line for line in text.splitlines() if line.startswith("rank")]
    for row in rows:
        for v in s.vocab:
            assert str(v) in row


# --- command line ---------------------------------------------------------------------


SIMULATE = ["simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8"]


def test_cli_vocab_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SIMULATE, "--cost", "1,2,0", "--vocab", "0.1,0.5,1,0.1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = simulate(
        with_vocab(get_schedule("1f1b", 4, 8), (1, 2, 0)), (1, 2, 0), vocab=(0.1, 0.5, 1, 0.1)
    )
    assert data["vocab"] == [0.1, 0.5, 1.0, 0.1]
    assert data["makespan"] == pytest.approx(expected.makespan)
    assert main([*SIMULATE, "--json"]) == 0
    assert "vocab" not in json.loads(capsys.readouterr().out)


def test_cli_vocab_text_and_picture(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "v.png"
    argv = ["simulate", "--schedule", "zbv", "--ranks", "2", "--microbatches", "4"]
    assert main([*argv, "--vocab", "0.5", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "vocab E,S,T,G = 0.5,0.5,0.5,0.5" in out.splitlines()[0]
    assert "E/S/T/G = vocabulary passes" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_picture_names_every_pass(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from conveyor.observe.pictures import draw_timeline
    from conveyor.runtime.timing import Timing

    events = [(0, "E", -1, 0, 0.0, 1.0), (1, "E", -1, 0, 0.0, 1.0), (0, "F", 0, 0, 1.0, 2.0)]
    events += [(r, k, -1, 0, t, t + 1.0) for t, k in ((3.0, "S"), (4.0, "T")) for r in (0, 1)]
    events += [(1, "F", 1, 0, 2.0, 3.0), (1, "B", 1, 0, 5.0, 6.0), (0, "B", 0, 0, 6.0, 7.0)]
    events += [(r, "G", -1, 0, 7.0, 8.0) for r in (0, 1)]
    (axes,) = draw_timeline([Timing(*e) for e in events], tmp_path / "t.png").axes
    assert [t.get_text() for t in axes.get_legend().get_texts()] == [
        "F: forward",
        "B: backward",
        "E: embedding (vocabulary pass)",
        "S: output forward and loss (vocabulary pass)",
        "T: output backward (vocabulary pass)",
        "G: embedding gradient (vocabulary pass)",
    ]
    assert all(patch.get_alpha() == 1.0 for patch in axes.patches)


def test_cli_bad_vocab_is_one_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_vocab("1") == (1.0,) * 4
    assert parse_vocab("0,1,2,3") == (0.0, 1.0, 2.0, 3.0)
    for bad in ("1,2", "x", "-1", "inf", "1,2,3,4,5"):
        with pytest.raises(ConfigError, match="--vocab must be"):
            parse_vocab(bad)
    assert main([*SIMULATE, "--vocab", "1,2"]) != 0
    assert "--vocab must be one number >= 0" in capsys.readouterr().err
