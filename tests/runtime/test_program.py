"""The per-rank programs the runtime walks: every message posted once on each side at the
same tick, in an order that a lock-step replay under NCCL's rules completes. Pure: no
processes (tests/parallel/test_nccl.py replays what real runs post)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.errors import ConfigError
from conveyor.runtime import program as program_module
from conveyor.runtime.program import (
    Message,
    ahead_ranks,
    producer_of,
    rank_program,
    single_process_program,
    ticks,
)
from conveyor.schedules import (
    SCHEDULE_NAMES,
    Action,
    F,
    Schedule,
    default_chunks,
    get_schedule,
    paired,
)
from conveyor.schedules.pairs import paired_with_vocab
from conveyor.schedules.vocab import with_vocab
from tests.support.nccl_model import Record, check


@st.composite
def schedules(draw: st.DrawFn) -> Schedule:
    name = draw(st.sampled_from(SCHEDULE_NAMES))
    p = draw(st.integers(1, 6))
    m = draw(st.integers(1, 16))
    chunks = default_chunks(name)
    if name in ("interleaved-1f1b", "looped-bfs"):
        chunks = draw(st.integers(2, 3))  # one chunk: the name is refused
    try:
        schedule = get_schedule(name, p, m, chunks)
    except ConfigError:  # e.g. dualpipev with too few micro-batches
        schedule = get_schedule(name, p, max(m, 2 * p), chunks)
    if draw(st.booleans()):  # vocabulary passes (rule 6), the pairs that run around them
        schedule = paired_with_vocab(with_vocab(schedule), paired(schedule).pairs)
    return schedule


@given(schedules(), st.booleans(), st.booleans(), st.booleans())
@settings(max_examples=150, deadline=None)
def test_every_message_is_posted_once_by_each_side_at_the_same_tick(
    schedule: Schedule, train: bool, join: bool, pairs: bool
) -> None:
    """Each side posts a message once, at its tick; with ``join`` a receive that would go
    ahead may join the last group the receiver posted (rule 4), never one with a group or a
    pass of its own between (its own tick's group, sends after the compute, may follow);
    without, every receive is posted at its tick. With ``pairs`` (rule 5) a tick may send
    two messages to one peer: both ends list them in the same order."""
    programs = [rank_program(schedule, r, train, join, pairs) for r in range(schedule.ranks)]
    tick_of = ticks(schedule, train, pairs)
    sent: Counter[tuple[int, Message]] = Counter()
    received: Counter[tuple[int, Message]] = Counter()
    send_order: dict[tuple[int, int, int], list[Message]] = {}
    recv_order: dict[tuple[int, int, int], list[Message]] = {}
    for rank, program in enumerate(programs):
        posting = [t.tick for t in program.ticks if t.sends or t.recvs]
        passes = [t.tick for t in program.ticks if t.boundary is not None]
        for step in program.ticks:
            assert step.rank == rank
            if not (pairs and train):
                # One message per peer in a group (a new description is read before its
                # tensors); only a pair's tick sends two to one peer.
                assert len({m.src for m in step.recvs}) == len(step.recvs)
            for message in step.sends:
                assert message.src == rank != message.dst
                sent[step.tick, message] += 1
                send_order.setdefault((step.tick, rank, message.dst), []).append(message)
            for message in step.recvs:
                recv_order.setdefault((tick_of[message.producer], message.src, rank), [])
                recv_order[tick_of[message.producer], message.src, rank].append(message)
                assert message.dst == rank != message.src
                at = tick_of[message.producer]
                assert join or step.tick == at
                if step.tick != at:  # joined: no group or pass of this rank between the
                    assert step.tick < at  # two, and none of the group's receives earlier
                    assert not [t for t in posting if step.tick < t < at], (rank, message)
                    assert not [t for t in passes if step.tick < t < at], (rank, message)
                    assert step.sends and tick_of[step.recvs[0].producer] == at
                received[at, message] += 1
    assert sent == received
    assert all(n == 1 for n in sent.values())
    assert send_order == recv_order
    # Every value that crosses ranks is a message; nothing else is.
    crossing = 0
    for action in ticks(schedule, train, pairs):
        producer = producer_of(action, schedule.stages)
        if producer is not None:
            crossing += schedule.placement[producer.stage] != schedule.placement[action.stage]
    assert len(sent) == crossing


@given(schedules(), st.booleans(), st.booleans())
@settings(max_examples=150, deadline=None)
def test_programs_keep_the_schedule_order_and_consume_after_producing(
    schedule: Schedule, train: bool, pairs: bool
) -> None:
    at = ticks(schedule, train, pairs)
    for rank in range(schedule.ranks):
        program = rank_program(schedule, rank, train, pairs=pairs)
        want = [a for a in schedule.actions[rank] if train or a.kind == F]
        assert program.actions == want
        tick_list = [s.tick for s in program.ticks]
        assert tick_list == sorted(set(tick_list))  # one step per tick, increasing
        # Rule 5: each of the rank's pairs is one tick (training only), F then B.
        together = [(t.action, t.paired) for t in program.ticks if t.paired is not None]
        starts = sorted(schedule.pair_starts(rank)) if pairs and train else []
        assert together == [schedule.actions[rank][i : i + 2] for i in starts]
        for step in program.ticks:
            for action in step.computed:
                producer = producer_of(action, schedule.stages)
                if producer is not None:
                    assert at[producer] < step.tick
            # The only messages sent at a tick are the outputs of that tick's actions.
            assert all(m.producer in step.computed for m in step.sends)


def test_one_process_program_runs_every_action_in_a_valid_order() -> None:
    for name in SCHEDULE_NAMES:
        schedule = get_schedule(name, 4, 8, default_chunks(name))
        program = single_process_program(schedule)
        seen = set()
        for step in program.ticks:
            assert step.action is not None and not step.sends and not step.recvs
            producer = producer_of(step.action, schedule.stages)
            assert producer is None or producer in seen
            seen.add(step.action)
        assert len(seen) == sum(len(a) for a in schedule.actions)
        assert set(program.first) == set(range(schedule.stages)) == set(program.final)


def _traces(
    schedule: Schedule, pairs: bool = False, join: bool = False
) -> dict[int, list[Record]]:
    """What each rank would post running its program, as the engine walks it: a tick
    ``ahead`` first posts its receives as one batch; then, before an action (a pair:
    both), a wait for each receive it consumes; after it, one batch of the tick's sends
    and (unless posted ahead) receives."""
    return {rank: _trace(schedule, rank, pairs, join) for rank in range(schedule.ranks)}


def _trace(schedule: Schedule, rank: int, pairs: bool, join: bool = False) -> list[Record]:
    out: list[Record] = []
    posted: dict[Action, int] = {}  # producer -> seq of its receive
    batches = 0

    def batch(ops: list[tuple[str, int, Message]]) -> None:
        nonlocal batches
        for kind, peer, message in ops:
            if kind == "recv":
                posted[message.producer] = len(out)
            out.append(
                Record(
                    rank, len(out), kind, "batch_isend_irecv", peer, "world", (), 1, "f",
                    batch=batches,
                )
            )
        batches += bool(ops)

    for step in rank_program(schedule, rank, pairs=pairs, join=join).ticks:
        if step.boundary is not None:  # a pass: collectives of every pipeline rank
            members = tuple(range(schedule.ranks))
            out.append(Record(rank, len(out), "collective", "all_reduce", None, "pp", members))
        recvs = [("recv", m.src, m) for m in step.recvs]
        if step.ahead:
            batch(recvs)
        for action in step.computed:
            producer = producer_of(action, schedule.stages)
            if producer is not None and producer in posted:
                seq = posted.pop(producer)
                out.append(Record(rank, len(out), "wait", "wait", waits_on=(seq,)))
        batch([*(("send", m.dst, m) for m in step.sends), *([] if step.ahead else recvs)])
    return out


@given(schedules(), st.booleans(), st.booleans())
@settings(max_examples=120, deadline=None)
def test_programs_replay_without_deadlock_under_nccl_rules(
    schedule: Schedule, pairs: bool, join: bool
) -> None:
    # Every (streams, sends) combination of the NCCL model (tests/support/nccl_model.py),
    # with the receives posted ahead of the compute where the program says (rules 3, 7).
    check(_traces(schedule, pairs, join))


@pytest.mark.parametrize("forward", [(), ("E", "S"), ("S",)])
@pytest.mark.parametrize("name", ["1f1b", "v-half"])
def test_a_forward_only_step_runs_the_passes_its_stage_ends_name(
    name: str, forward: tuple[str, ...]
) -> None:
    """Rule 6: a training step runs every pass, a forward-only one the kinds the stage ends
    list (``forward_passes``), in the schedule's order, at one tick of every rank."""
    schedule = with_vocab(get_schedule(name, 2, 3))
    for train in (True, False):
        want = [v for v in schedule.vocab if train or v.kind in forward]
        programs = [single_process_program(schedule, train, forward)] + [
            rank_program(schedule, r, train, join, forward_passes=forward)
            for r in range(schedule.ranks)
            for join in (False, True)
        ]
        for program in programs:
            assert [t.boundary for t in program.ticks if t.boundary is not None] == want
            assert all(not t.computed for t in program.ticks if t.boundary is not None)
        ticks_of = [[t.tick for t in p.ticks if t.boundary is not None] for p in programs[1:]]
        assert all(row == ticks_of[0] for row in ticks_of)


def test_receives_go_ahead_of_the_later_action_only() -> None:
    """Rule 7 on 1F1B over 2 ranks, whose steady state exchanges an F output for a B's
    input gradient at every tick: the rank computing the B (longer, ending with the F)
    posts its receive ahead, and rule 4 joins it to the group that rank posted after its
    previous B (one group per exchange, the receive two ticks early); the other rank posts
    its group after its F, as before; and without known descriptions nothing but receives
    alone goes ahead."""
    schedule = get_schedule("1f1b", 2, 8)
    ahead = ahead_ranks(schedule)
    first, last = rank_program(schedule, 0, join=True), rank_program(schedule, 1, join=True)
    at = ticks(schedule)
    exchanges = sorted(ahead)
    assert len(exchanges) == 6 and all(ahead[t] == {1} for t in exchanges)
    groups = [t for t in last.ticks if t.sends or t.recvs]
    for tick in exchanges:
        (own,) = [t for t in last.ticks if t.tick == tick]
        assert own.action is not None and own.action.kind == "B"
        assert own.sends and not own.ahead  # the B's gradient, after it
        assert all(at[m.producer] > tick for m in own.recvs)  # only a later tick's, joined
        (holder,) = [g for g in groups if any(at[m.producer] == tick for m in g.recvs)]
        assert holder.tick == tick - 2 and holder.action is not None
        assert holder.action.kind == "B" and holder.sends and not holder.ahead
    assert not any(t.ahead for t in last.ticks if t.sends)
    assert len(groups) == 2 + 8  # two receives alone, then one group per B (15 unjoined)
    assert not any(t.ahead for t in first.ticks if t.sends)
    for program in (rank_program(schedule, 0), rank_program(schedule, 1)):
        assert all(t.ahead == bool(t.recvs and not t.sends) for t in program.ticks)


def test_the_replay_catches_both_ends_of_an_exchange_receiving_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What rule 7 leaves out: both ranks of a 1F1B exchange post their receives ahead.
    schedule = get_schedule("1f1b", 2, 8)
    check(_traces(schedule, join=True))
    both = {tick: frozenset({0, 1}) for tick in ahead_ranks(schedule)}
    monkeypatch.setattr(program_module, "choose_ahead", lambda *args: both)
    with pytest.raises(AssertionError, match="DEADLOCK"):
        check(_traces(schedule, join=True))


def test_the_replay_catches_a_receive_posted_ahead_of_a_send() -> None:
    # The same programs with each tick's receives posted one tick early, as their own
    # group: the order the runtime used before (receive ahead) deadlocks at once.
    schedule = get_schedule("1f1b", 2, 4)
    traces = _traces(schedule)
    for rank, records in traces.items():
        recvs = [r for r in records if r.kind == "recv"]
        sends = [r for r in records if r.kind == "send"]
        early = [dataclasses.replace(r, batch=None) for r in recvs]
        # receives first (each alone), then the sends (each alone)
        traces[rank] = [
            dataclasses.replace(r, seq=i, batch=None)
            for i, r in enumerate([*early, *[dataclasses.replace(s, batch=None) for s in sends]])
        ]
    with pytest.raises(AssertionError, match="DEADLOCK"):
        check(traces)
