"""The NCCL-semantics model (tests/support/nccl_model.py) and its recorder
(tests/support/nccl_record.py).

Hand-built traces check each rule of the model. One 2-process gloo run then records real
programs: torch's own Schedule1F1B passes, a receive posted before the send on both ranks
(gloo runs it) is flagged and named by its lines here, and DTensor's tensor-parallel
collectives show up.
"""

from __future__ import annotations

import gc
import inspect
import json
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support import distributed
from tests.support.helpers import mse
from tests.support.nccl_model import MODES, Record, Result, check, replay
from tests.support.nccl_record import recording

Traces = dict[int, list[Record]]


class Rank:
    """Builds one rank's trace by hand; each op's ``where`` is ``r<rank>.py:<seq>``."""

    def __init__(self, rank: int, world: int = 2) -> None:
        self.rank = rank
        self.world = tuple(range(world))
        self.recs: list[Record] = []
        self.batches = 0

    def _add(self, kind: str, name: str, **fields: Any) -> int:
        seq = len(self.recs)
        fields.setdefault("group", "0")
        fields.setdefault("members", self.world)
        self.recs.append(
            Record(
                rank=self.rank,
                seq=seq,
                kind=kind,
                name=name,
                where=f"r{self.rank}.py:{seq} in step",
                **fields,
            )
        )
        return seq

    def send(self, peer: int, numel: int = 4, dtype: str = "float32", **kw: Any) -> int:
        return self._add("send", "isend", peer=peer, numel=numel, dtype=dtype, **kw)

    def recv(self, peer: int, numel: int = 4, dtype: str = "float32", **kw: Any) -> int:
        return self._add("recv", "irecv", peer=peer, numel=numel, dtype=dtype, **kw)

    def batch(self, *ops: tuple[str, int]) -> tuple[int, ...]:
        """One batch_isend_irecv of ("send" | "recv", peer) ops."""
        self.batches += 1
        return tuple(
            self._add(
                kind, "batch_isend_irecv", peer=peer, numel=4, dtype="float32", batch=self.batches
            )
            for kind, peer in ops
        )

    def collective(self, name: str = "all_reduce", numel: int = 4, **kw: Any) -> int:
        return self._add("collective", name, numel=numel, dtype="float32", **kw)

    def wait(self, *seqs: int) -> None:
        self._add("wait", "wait", waits_on=seqs)


def traces(*ranks: Rank) -> Traces:
    return {r.rank: r.recs for r in ranks}


def outcomes(t: Traces) -> dict[tuple[str, str], bool]:
    """(streams, sends) -> replay ok."""
    return {(s, b): replay(t, streams=s, sends=b).ok for s, b in MODES}


def every(ok: bool) -> dict[tuple[str, str], bool]:
    return dict.fromkeys(MODES, ok)


def crossing(batched: bool) -> Traces:
    """Each rank receives from and sends to the other, then waits for both."""
    a, b = Rank(0), Rank(1)
    for me, other in ((a, 1), (b, 0)):
        ops = (
            me.batch(("recv", other), ("send", other))
            if batched
            else (me.recv(other), me.send(other))
        )
        me.wait(*ops)
    return traces(a, b)


# --- the rules, on hand-built traces -----------------------------------------------------


def test_receive_posted_before_send_on_both_sides_deadlocks_in_every_mode() -> None:
    t = crossing(batched=False)
    assert outcomes(t) == every(False)
    result = replay(t, streams="pair", sends="buffered")
    assert result.deadlock
    assert "cycle: rank 0 -> rank 1 -> rank 0" in result.report
    # each stuck rank names its wait, the op and the peer's op in the way, by line
    assert "rank 0 waits at r0.py:2 in step for irecv from rank 1" in result.report
    assert "queued on its stream behind irecv from rank 0 #0" in result.report
    assert "r1.py:0 in step" in result.report


def test_the_same_ops_in_one_batch_pass() -> None:
    assert outcomes(crossing(batched=True)) == every(True)


def test_send_before_receive_needs_buffered_sends() -> None:
    a, b = Rank(0), Rank(1)
    for me, other in ((a, 1), (b, 0)):
        me.wait(me.send(other), me.recv(other))
    assert outcomes(traces(a, b)) == {
        ("rank", "blocking"): False,
        ("pair", "blocking"): False,
        ("rank", "buffered"): True,
        ("pair", "buffered"): True,
    }


def test_ring_of_blocking_sends() -> None:
    ranks = [Rank(r, world=3) for r in range(3)]
    for me in ranks:  # dist.send to the next, then dist.recv from the previous
        me.wait(me.send((me.rank + 1) % 3))
        me.wait(me.recv((me.rank - 1) % 3))
    t = traces(*ranks)
    result = replay(t, streams="pair", sends="blocking")
    assert result.deadlock
    assert "cycle: rank 0 -> rank 1 -> rank 2 -> rank 0" in result.report
    assert outcomes(t)[("rank", "buffered")] and outcomes(t)[("pair", "buffered")]


def test_size_and_dtype_mismatches_name_both_lines() -> None:
    a, b = Rank(0), Rank(1)
    a.wait(a.send(1, numel=4))
    b.wait(b.recv(0, numel=8))
    a.wait(a.send(1, dtype="bfloat16"))
    b.wait(b.recv(0, dtype="float32"))
    result = replay(traces(a, b), streams="pair", sends="blocking")
    assert not result.deadlock and len(result.errors) == 2
    assert "rank 0 sends 4 x float32 at r0.py:0" in result.errors[0]
    assert "rank 1 receives 8 x float32 at r1.py:0" in result.errors[0]
    assert "4 x bfloat16" in result.errors[1]


def test_a_send_never_received_is_reported() -> None:
    a, b = Rank(0), Rank(1)
    a.send(1)
    result = replay(traces(a, b), streams="rank", sends="buffered")
    assert not result.deadlock
    assert result.errors[0].startswith("unmatched: rank 0 sends 1 message(s) to rank 1")
    assert not replay(traces(a, b), streams="rank", sends="blocking").ok


def test_collective_a_member_never_reaches_is_flagged() -> None:
    a, b = Rank(0), Rank(1)
    a.wait(a.collective())
    result = replay(traces(a, b), streams="pair", sends="buffered")
    assert result.deadlock
    assert "needs rank 1's all_reduce #0: not posted; rank 1 has finished" in result.report
    assert "unmatched: rank 0 posts 1 collective(s) on group 0, rank 1 only 0" in result.report


def test_collective_names_and_sizes_must_agree() -> None:
    a, b = Rank(0), Rank(1)
    a.wait(a.collective("all_reduce"))
    b.wait(b.collective("broadcast"))
    a.wait(a.collective("all_reduce", numel=3))
    b.wait(b.collective("all_reduce", numel=5))
    errors = replay(traces(a, b), streams="rank", sends="blocking").errors
    assert len(errors) == 2
    assert "rank 0 posted all_reduce at r0.py:0" in errors[0]
    assert "rank 1 posted broadcast at r1.py:0" in errors[0]
    assert "size mismatch in all_reduce" in errors[1]


def test_a_wait_blocks_later_postings() -> None:
    """Ops on two other groups' communicators: only the CPU waits order them."""
    a, b = Rank(0), Rank(1)
    a.wait(a.recv(1, group="x"))  # rank 0 waits for x before sending on y
    a.wait(a.send(1, group="y"))
    b.wait(b.recv(0, group="y"))  # rank 1 waits for y before sending on x
    b.wait(b.send(0, group="x"))
    result = replay(traces(a, b), streams="rank", sends="buffered")
    assert result.deadlock
    assert "rank 1 is blocked in the wait at r1.py:1" in result.report
    # the same ops with the waits at the end pass
    a, b = Rank(0), Rank(1)
    a.wait(a.recv(1, group="x"), a.send(1, group="y"))
    b.wait(b.recv(0, group="y"), b.send(0, group="x"))
    assert outcomes(traces(a, b)) == every(True)


def test_pair_streams_and_rank_streams_differ() -> None:
    """A ring where each rank receives, then sends, as separate ops: per-pair streams let
    the send run beside the receive; one stream per rank puts it behind it."""
    ranks = [Rank(r, world=3) for r in range(3)]
    for me in ranks:
        me.wait(me.recv((me.rank + 1) % 3), me.send((me.rank + 2) % 3))
    t = traces(*ranks)
    assert outcomes(t) == {
        ("rank", "blocking"): False,
        ("pair", "blocking"): True,
        ("rank", "buffered"): False,
        ("pair", "buffered"): True,
    }
    assert "cycle:" in replay(t, streams="rank", sends="buffered").report


def test_batched_and_single_ops_use_different_communicators_in_pair_mode() -> None:
    a, b = Rank(0), Rank(1)
    a.wait(a.send(1))
    b.wait(*b.batch(("recv", 0)))
    assert outcomes(traces(a, b)) == {
        ("rank", "blocking"): True,
        ("pair", "blocking"): False,
        ("rank", "buffered"): True,
        ("pair", "buffered"): False,
    }
    text = replay(traces(a, b), streams="pair", sends="buffered").report
    assert "single and batched p2p ops use different communicators" in text


def test_check_raises_with_the_first_failing_mode() -> None:
    check(crossing(batched=True))
    with pytest.raises(AssertionError, match=r"streams='rank', sends='blocking'") as info:
        check(crossing(batched=False))
    assert "also fails: pair/blocking, rank/buffered, pair/buffered" in str(info.value)


def _ring_traces(steps: int) -> Any:
    ranks = [Rank(r, world=4) for r in range(4)]
    for step in range(steps):  # a ring exchange each step, an all-reduce every 100
        for me in ranks:
            me.wait(*me.batch(("send", (me.rank + 1) % 4), ("recv", (me.rank - 1) % 4)))
            if step % 100 == 0:
                me.wait(me.collective())
    return traces(*ranks)


def test_long_traces_replay_in_linear_time() -> None:
    short, long = _ring_traces(250), _ring_traces(1000)
    assert len(long[0]) >= 3000
    took = []
    gc.collect()
    gc.disable()  # a collection's pause lands in one replay or the other: noise
    try:
        for t in (short, long):
            # CPU time, not wall time: other processes on a busy machine do not count
            start = time.process_time()
            for streams, sends in MODES:  # 4 ranks x ~3000 records each
                result = replay(t, streams=streams, sends=sends)
                assert result.ok, result.report
            took.append(time.process_time() - start)
    finally:
        gc.enable()
    # 4x the records: about 4x the time (16x if the replay were quadratic); a ratio,
    # not a bound in seconds, so a loaded machine does not fail it
    assert took[1] < 8 * took[0] + 0.05, took
    assert took[1] < 5.0, took


def test_records_are_plain_data() -> None:
    a = Rank(0)
    a.wait(*a.batch(("send", 1)))
    for rec in a.recs:
        assert Record.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec


# --- real gloo runs ----------------------------------------------------------------------


def _torch_1f1b(rank: int) -> list[Record]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])
    stage = PipelineStage(layers[2 * rank : 2 * rank + 2], rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=mse)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    with recording() as trace:
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
    return trace


def _bad(rank: int) -> list[Record]:
    """Receive, then send, as two separate ops on both ranks: gloo runs it, NCCL hangs."""
    other, buf = 1 - rank, torch.zeros(4)
    with recording() as trace:
        got = dist.irecv(buf, other)
        sent = dist.isend(torch.ones(4), other)
        assert got is not None and sent is not None
        got.wait()
        sent.wait()
    return trace


def _tensor_parallel(rank: int) -> list[Record]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))
    mesh = init_device_mesh("cpu", (2,))
    with recording() as trace:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        model(torch.randn(3, 6, requires_grad=True)).sum().backward()
    return trace


def _one_work_per_group(rank: int) -> list[Record]:
    """A batch_isend_irecv group answered as NCCL answers it (one work), then a conveyor
    step, whose transport must take that one work for every op of each group."""
    import conveyor

    other = 1 - rank
    with recording() as trace:
        send = dist.P2POp(dist.isend, torch.ones(4), other)
        works = dist.batch_isend_irecv([send, dist.P2POp(dist.irecv, torch.zeros(4), other)])
        assert len(works) == 1, works
        works[0].wait()
        assert works[0].is_completed()
        ctx = conveyor.init(pp=2, timeout=45)
        torch.manual_seed(0)
        pipe = conveyor.Pipeline(
            nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]), loss_fn=mse, microbatches=4,
            schedule="1f1b", context=ctx,
        )  # fmt: skip
        pipe.train_step(torch.randn(8, 6), torch.randn(8, 6))
    return trace


def _programs(rank: int) -> dict[str, list[Record]]:
    dist.init_process_group("gloo")
    return {"1f1b": _torch_1f1b(rank), "bad": _bad(rank), "tp": _tensor_parallel(rank),
            "coalesced": _one_work_per_group(rank)}  # fmt: skip


@pytest.fixture(scope="module")
def recorded() -> dict[str, Traces]:
    runs = distributed.run(_programs, 2, fork=True)
    return {name: {r: run[name] for r, run in enumerate(runs)} for name in runs[0]}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torch_schedule_1f1b_passes(recorded: dict[str, Traces]) -> None:
    t = recorded["1f1b"]
    check(t)
    kinds = {(rec.kind, rec.batch is not None) for rec in t[0]}
    assert {("send", False), ("send", True), ("recv", True), ("wait", False)} <= kinds
    assert all(rec.rank == r for r, recs in t.items() for rec in recs)


def _line(fn: Any, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_recv_before_send_program_is_flagged_at_its_lines(
    recorded: dict[str, Traces],
) -> None:
    results: list[Result] = [replay(recorded["bad"], streams=s, sends=b) for s, b in MODES]
    assert all(r.deadlock for r in results)
    report = results[0].report
    irecv, isend = _line(_bad, "dist.irecv("), _line(_bad, "dist.isend(")
    assert (
        f"irecv from rank 1 #0 on group 0 (4 x float32 [4]), posted at "
        f"tests/parallel/test_nccl_model.py:{irecv} in _bad" in report
    )
    assert f"tests/parallel/test_nccl_model.py:{isend} in _bad" in report
    waits = _line(_bad, "got.wait()")
    assert f"rank 0 waits at tests/parallel/test_nccl_model.py:{waits} in _bad" in report


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tensor_parallel_collectives_are_recorded(recorded: dict[str, Traces]) -> None:
    t = recorded["tp"]
    check(t)
    names = [rec.name for rec in t[0]]
    # forward: the row-parallel output's all-reduce; backward: the input gradient's
    assert names.count("_c10d_functional.all_reduce") >= 2
    assert names.count("wait_tensor") >= 2
    assert "scatter" in names  # distributing the weights


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_work_per_batch_group_as_nccl_returns_it(recorded: dict[str, Traces]) -> None:
    """The recorder answers batch_isend_irecv with one work, as NCCL does, and a conveyor
    step runs through that: each group's ops are waited as one."""
    t = recorded["coalesced"]
    check(t)
    for recs in t.values():
        groups: dict[int, set[int]] = {}
        for rec in recs:
            if rec.batch is not None:
                groups.setdefault(rec.batch, set()).add(rec.seq)
        assert len(groups) >= 4  # the hand-made group, then the step's transfers
        waited = [set(rec.waits_on) for rec in recs if rec.kind == "wait"]
        for members in groups.values():  # each group waited for, and only as a whole
            assert members in waited
            assert all(w == members or w.isdisjoint(members) for w in waited)


def test_report_paths_do_not_depend_on_the_checkout_folders_name() -> None:
    # A checkout cloned into a folder named like the library (`git clone` makes
    # .../conveyor/conveyor/): its tests are not library frames, and paths are relative to
    # the checkout, whatever it is called.
    from types import SimpleNamespace

    from tests.support import nccl_record

    rec = nccl_record._Recorder("conveyor")
    rec.library, rec.root = "/src/conveyor/conveyor/", "/src/conveyor/"
    frame: Any = SimpleNamespace(f_lineno=7, f_code=SimpleNamespace(co_name="fn"))
    test_file = "/src/conveyor/tests/parallel/test_x.py"
    assert rec.format(frame, test_file) == "tests/parallel/test_x.py:7 in fn"
    assert (
        rec.format(frame, "/src/conveyor/conveyor/runtime/a.py") == "conveyor/runtime/a.py:7 in fn"
    )
    assert not test_file.startswith(rec.library)
