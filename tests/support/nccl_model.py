"""Replay what each rank posted under NCCL's rules and say whether it can deadlock.

Pure Python (no torch): the records come from :mod:`tests.support.nccl_record` (real gloo runs) or
are built by hand. The rules (DESIGN.md, "On GPUs: NCCL's rules"):

* every operation runs on one stream per communicator and rank, in posting order; the head
  item of a stream is *active*;
* point-to-point messages match per communicator and ordered (src, dst) pair in FIFO order,
  tags ignored; numel and dtype must agree;
* a receive holds its stream until its matching send is active; a send completes when its
  receive is active (``sends="blocking"``) or as soon as it is active (``"buffered"``);
* the operations of one ``batch_isend_irecv`` are one item that progresses together;
* a collective completes when every member's corresponding collective is active;
* a ``Work.wait`` keeps its rank from posting anything later until the awaited ops are done
  (on CUDA later NCCL work is ordered after the stream that waited).

Communicators: collectives and batched point-to-point ops use their process group's own
communicator; a single send or receive uses a lazily created per-pair communicator
(``streams="pair"``, torch's default) or the group's communicator (``streams="rank"``, eager
init with ``device_id``). As in ProcessGroupNCCL, in ``"pair"`` mode a batched op never
matches a single one: they run on different communicators.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Streams = Literal["pair", "rank"]
Sends = Literal["blocking", "buffered"]
MODES: tuple[tuple[Streams, Sends], ...] = (
    ("rank", "blocking"),
    ("pair", "blocking"),
    ("rank", "buffered"),
    ("pair", "buffered"),
)
# Collectives whose tensor must have the same numel and dtype on every member.
SAME_SIZE = frozenset(
    {
        "broadcast",
        "all_reduce",
        "reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "_all_gather_base",
        "_reduce_scatter_base",
        "_c10d_functional.broadcast",
        "_c10d_functional.broadcast_",
        "_c10d_functional.all_reduce",
        "_c10d_functional.all_reduce_",
        "_c10d_functional.all_gather_into_tensor",
        "_c10d_functional.all_gather_into_tensor_out",
        "_c10d_functional.reduce_scatter_tensor",
        "_c10d_functional.reduce_scatter_tensor_out",
    }
)


@dataclass(frozen=True)
class Record:
    """One thing a rank posted: an op (``send``/``recv``/``collective``) or a ``wait``."""

    rank: int  # global rank that posted it
    seq: int  # posting index on that rank
    kind: str  # "send" | "recv" | "collective" | "wait"
    name: str = ""  # API called: "isend", "batch_isend_irecv", "all_reduce", "wait", ...
    peer: int | None = None  # global rank of the other side (p2p); -1: any source
    group: str = ""  # process group name (the communicator's identity)
    members: tuple[int, ...] = ()  # the group's global ranks
    numel: int | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    tag: int | None = None  # recorded, never used for matching (NCCL has no tags)
    batch: int | None = None  # batch_isend_irecv call id: same id = one group
    waits_on: tuple[int, ...] = ()  # wait: the seqs it waits for
    timeout_given: bool = False  # wait: a time-out was passed
    where: str = ""  # innermost library frame: "conveyor/...py:123 in fn"
    caller: str = ""  # innermost frame outside torch
    stack: tuple[str, ...] = ()  # library frames, innermost first (a few)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (every field is an int, a string, None or a tuple of them: a
        shallow copy, which ``dataclasses.asdict``'s deep copy of each costs ~20x)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Record:
        """Inverse of :meth:`to_dict` (lists back to tuples)."""
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
        }
        return cls(**fields)

    def location(self) -> str:
        """The library line that posted it and the line that called that (the next library
        frame, else the caller outside the library)."""
        outer = self.stack[1] if len(self.stack) > 1 else self.caller
        if self.where and outer and outer != self.where:
            return f"{self.where} <- {outer}"
        return self.where or self.caller or "?"


@dataclass(frozen=True)
class Result:
    """The outcome of one replay: ``ok``, or a deadlock and/or errors with a report."""

    streams: Streams
    sends: Sends
    deadlock: bool
    errors: tuple[str, ...]  # mismatches and operations that are never matched
    report: str  # empty when ok

    @property
    def ok(self) -> bool:
        return not self.deadlock and not self.errors


Comm = tuple[str, str]  # (group name, "main" or "lo-hi" for a per-pair communicator)
Key = tuple[Any, ...]  # ("send"|"recv", comm, src, dst) or ("collective", comm, k)


@dataclass(eq=False)
class _Op:
    rec: Record
    key: Key
    index: int  # FIFO position under key (p2p) or the k in the key (collective)
    item: _Item
    started: bool = False
    done: bool = False


@dataclass(eq=False)
class _Item:
    """What occupies a stream: one op, or all ops of one batch_isend_irecv."""

    rank: int
    comm: Comm
    ops: list[_Op] = field(default_factory=list)
    active: bool = False
    left: int = 0


def _comm_of(rec: Record, streams: Streams) -> Comm:
    if rec.kind == "collective" or rec.batch is not None or streams == "rank":
        return (rec.group, "main")
    lo, hi = sorted((rec.rank, rec.rank if rec.peer is None else rec.peer))
    return (rec.group, f"{lo}-{hi}")


def _p2p_key(rec: Record, comm: Comm) -> Key:
    peer = -1 if rec.peer is None else rec.peer
    src, dst = (rec.rank, peer) if rec.kind == "send" else (peer, rec.rank)
    return (rec.kind, comm, src, dst)


def _comm_name(comm: Comm) -> str:
    group, lane = comm
    return f"group {group}" if lane == "main" else f"group {group} pair {lane}"


def _size(rec: Record) -> str:
    shape = "" if rec.shape is None else f" {list(rec.shape)}"
    return f"{rec.numel} x {rec.dtype}{shape}"


def _ops_of(traces: Mapping[int, Sequence[Record]]) -> Iterator[Record]:
    for recs in traces.values():
        for rec in recs:
            if rec.kind != "wait":
                yield rec


class _Replay:
    def __init__(
        self, traces: Mapping[int, Sequence[Record]], streams: Streams, sends: Sends
    ) -> None:
        self.traces = {r: list(t) for r, t in traces.items()}
        self.mode: Streams = streams
        self.sends: Sends = sends
        self.ptr = dict.fromkeys(self.traces, 0)
        self.by_seq: dict[tuple[int, int], _Op] = {}
        self.streams: dict[tuple[int, Comm], deque[_Item]] = {}
        self.table: dict[Key, list[_Op]] = {}
        self.colls: dict[tuple[int, Comm], int] = {}  # collectives posted per rank and comm
        self.arrived: dict[Key, int] = {}
        self.waiters: dict[int, list[int]] = {}  # id(op) -> ranks blocked in a wait on it
        self.errors: list[str] = []
        self.to_post: deque[int] = deque(self.traces)
        self.to_activate: deque[_Item] = deque()

    # --- posting ---------------------------------------------------------------------
    def post(self, rank: int) -> None:
        recs = self.traces[rank]
        i = self.ptr[rank]
        while i < len(recs):
            rec = recs[i]
            if rec.kind == "wait":
                op = self.pending(rank, rec)
                if op is not None:
                    self.waiters.setdefault(id(op), []).append(rank)
                    break
                i += 1
                continue
            j = i + 1
            if rec.batch is not None:
                while j < len(recs) and recs[j].batch == rec.batch and recs[j].kind != "wait":
                    j += 1
            self.enqueue(rank, recs[i:j])
            i = j
        self.ptr[rank] = i

    def pending(self, rank: int, wait: Record) -> _Op | None:
        """The first op ``wait`` is still blocked on."""
        for seq in wait.waits_on:
            op = self.by_seq.get((rank, seq))
            if op is not None and not op.done:
                return op
        return None

    def enqueue(self, rank: int, recs: Sequence[Record]) -> None:
        comm = _comm_of(recs[0], self.mode)
        item = _Item(rank, comm)
        for rec in recs:
            if rec.kind == "collective":  # the k-th on this communicator, on every member
                index = self.colls.get((rank, comm), 0)
                self.colls[(rank, comm)] = index + 1
                key: Key = ("collective", comm, index)
            else:
                key = _p2p_key(rec, comm)
                index = len(self.table.get(key, ()))
            ops = self.table.setdefault(key, [])
            op = _Op(rec, key, index, item)
            ops.append(op)
            item.ops.append(op)
            self.by_seq[(rank, rec.seq)] = op
            self.check(op)
        item.left = len(item.ops)
        stream = self.streams.setdefault((rank, comm), deque())
        stream.append(item)
        if len(stream) == 1:
            self.to_activate.append(item)

    def partner(self, op: _Op) -> _Op | None:
        kind, comm, src, dst = op.key
        ops = self.table.get(("recv" if kind == "send" else "send", comm, src, dst), [])
        return ops[op.index] if op.index < len(ops) else None

    def check(self, op: _Op) -> None:
        """Report a size, dtype or name mismatch with the counterpart posted before."""
        rec = op.rec
        if rec.kind == "collective":
            a, b = self.table[op.key][0].rec, rec
            if a is b:
                return
            if a.name != b.name:
                self.errors.append(
                    f"collective mismatch (#{op.index} on {_comm_name(op.key[1])}): rank "
                    f"{a.rank} posted {a.name} at {a.location()}; rank {b.rank} posted "
                    f"{b.name} at {b.location()}"
                )
            elif a.name in SAME_SIZE and (a.numel, a.dtype) != (b.numel, b.dtype):
                self.errors.append(
                    f"size mismatch in {a.name} (#{op.index} on {_comm_name(op.key[1])}): "
                    f"rank {a.rank} has {_size(a)} at {a.location()}; rank {b.rank} has "
                    f"{_size(b)} at {b.location()}"
                )
            return
        if rec.kind == "recv" and (rec.peer is None or rec.peer < 0):
            self.errors.append(
                f"rank {rec.rank} receives from any source at {rec.location()}: NCCL has "
                f"no any-source receive"
            )
            return
        other = self.partner(op)
        if other is None:
            return
        s, r = (rec, other.rec) if rec.kind == "send" else (other.rec, rec)
        if (s.numel, s.dtype) != (r.numel, r.dtype):
            self.errors.append(
                f"size mismatch (message #{op.index} from rank {s.rank} to rank {r.rank} on "
                f"{_comm_name(op.key[1])}): rank {s.rank} sends {_size(s)} at "
                f"{s.location()}; rank {r.rank} receives {_size(r)} at {r.location()}"
            )

    # --- progress --------------------------------------------------------------------
    def activate(self, item: _Item) -> None:
        if item.active or self.streams[(item.rank, item.comm)][0] is not item:
            return
        item.active = True
        for op in item.ops:
            op.started = True
        for op in item.ops:
            if op.rec.kind == "collective":
                self.arrived[op.key] = self.arrived.get(op.key, 0) + 1
                if self.arrived[op.key] >= len(op.rec.members):
                    for member_op in self.table[op.key]:
                        self.complete(member_op)
                continue
            if op.rec.kind == "send" and self.sends == "buffered":
                self.complete(op)
            other = self.partner(op)
            if other is not None and other.started:
                self.complete(op)
                self.complete(other)

    def complete(self, op: _Op) -> None:
        if op.done:
            return
        op.done = True
        item = op.item
        item.left -= 1
        if item.left == 0:
            stream = self.streams[(item.rank, item.comm)]
            stream.popleft()
            if stream:
                self.to_activate.append(stream[0])
        self.to_post.extend(self.waiters.pop(id(op), []))

    def run(self) -> None:
        while self.to_post or self.to_activate:
            while self.to_activate:
                self.activate(self.to_activate.popleft())
            if self.to_post:
                self.post(self.to_post.popleft())

    # --- the verdict -----------------------------------------------------------------
    def unmatched(self) -> list[str]:
        """Messages or collectives that can never be matched, from the whole traces."""
        out: list[str] = []
        counts: dict[Key, list[Record]] = {}
        for rec in _ops_of(self.traces):
            comm = _comm_of(rec, self.mode)
            if rec.kind == "collective":
                counts.setdefault(("collective", comm, rec.rank), []).append(rec)
            elif rec.peer is not None and rec.peer >= 0:
                counts.setdefault(_p2p_key(rec, comm), []).append(rec)
        lanes: dict[tuple[str, int, int], set[str]] = {}  # (group, src, dst) -> lanes used
        for key in counts:
            if key[0] != "collective":
                lanes.setdefault((key[1][0], key[2], key[3]), set()).add(key[1][1])
        for key, recs in counts.items():
            if key[0] in ("send", "recv"):
                other = counts.get(("recv" if key[0] == "send" else "send", *key[1:]), [])
                if len(other) < len(recs):
                    mixed = len(lanes[(key[1][0], key[2], key[3])]) > 1
                    out.append(self.leftover(recs[len(other)], len(recs), len(other), key, mixed))
            else:
                _, comm, rank = key
                for member in recs[0].members:
                    theirs = counts.get(("collective", comm, member), [])
                    if len(theirs) < len(recs):
                        first = recs[len(theirs)]
                        out.append(
                            f"unmatched: rank {rank} posts {len(recs)} collective(s) on "
                            f"{_comm_name(comm)}, rank {member} only {len(theirs)}; first "
                            f"without a counterpart: {first.name} at {first.location()}"
                        )
        return out

    def leftover(self, first: Record, mine: int, theirs: int, key: Key, mixed: bool) -> str:
        kind, comm, src, dst = key
        verb, other = ("sends", "receives") if kind == "send" else ("receives", "sends")
        me, them = (src, dst) if kind == "send" else (dst, src)
        text = (
            f"unmatched: rank {me} {verb} {mine} message(s) {'to' if kind == 'send' else 'from'}"
            f" rank {them} on {_comm_name(comm)}, rank {them} {other} {theirs}; first never "
            f"matched: {first.name} ({_size(first)}) at {first.location()}"
        )
        if mixed:
            text += " (in 'pair' mode single and batched p2p ops use different communicators)"
        return text

    def describe(self, op: _Op) -> str:
        rec = op.rec
        comm = _comm_name(op.item.comm)
        if rec.kind == "collective":
            what = f"{rec.name} #{op.index} on {comm} ({_size(rec)})"
        elif rec.kind == "send":
            what = f"{rec.name} to rank {rec.peer} #{op.index} on {comm} ({_size(rec)})"
        else:
            what = f"{rec.name} from rank {rec.peer} #{op.index} on {comm} ({_size(rec)})"
        if len(op.item.ops) > 1:
            what += f" [in a batch of {len(op.item.ops)}]"
        return f"{what}, posted at {rec.location()}"

    def rank_state(self, rank: int) -> str:
        if rank not in self.traces:
            return f"there is no trace of rank {rank}"
        recs = self.traces[rank]
        i = self.ptr[rank]
        if i < len(recs):
            return f"rank {rank} is blocked in the wait at {recs[i].location()}"
        if any(s for (r, _), s in self.streams.items() if r == rank):
            return f"rank {rank} has posted everything it ever posts"
        return f"rank {rank} has finished"

    def why(self, op: _Op, depth: int = 0) -> tuple[list[str], int | None]:
        """Why ``op`` cannot complete, and the rank that holds it up (if another)."""
        item = op.item
        if not item.active and depth < 4:
            head = self.streams[(item.rank, item.comm)][0]
            blocker = next(o for o in head.ops if not o.done)
            lines, rank = self.why(blocker, depth + 1)
            return [f"queued behind {self.describe(blocker)}", *lines], rank
        rec = op.rec
        if rec.kind == "collective":
            here = {o.rec.rank: o for o in self.table[op.key]}
            missing = [m for m in rec.members if m not in here or not here[m].started]
            lines = []
            for m in missing[:3]:
                if m not in here:
                    lines.append(
                        f"needs rank {m}'s {rec.name} #{op.index}: not posted; {self.rank_state(m)}"
                    )
                else:
                    theirs = self.streams[(m, here[m].item.comm)][0].ops[0]
                    lines.append(
                        f"needs rank {m}'s {rec.name} #{op.index}: queued behind "
                        f"{self.describe(theirs)}"
                    )
            if len(missing) > 3:
                lines.append(f"... and {len(missing) - 3} more members")
            return lines, (missing[0] if missing else None)
        other = self.partner(op)
        peer = -1 if rec.peer is None else rec.peer
        want = "receive" if rec.kind == "send" else "send"
        if other is None:
            return [
                f"needs rank {peer}'s matching {want} #{op.index}: never posted so far; "
                f"{self.rank_state(peer)}"
            ], peer
        if not other.started:
            head = self.streams[(peer, other.item.comm)][0]
            theirs = next(o for o in head.ops if not o.done)
            return [
                f"needs rank {peer}'s matching {other.rec.name} #{op.index} (posted at "
                f"{other.rec.location()}), queued on its stream behind "
                f"{self.describe(theirs)}"
            ], peer
        return ["(waits for its batch to complete)"], None

    def stuck(self) -> dict[int, tuple[list[str], int | None]]:
        out: dict[int, tuple[list[str], int | None]] = {}
        for rank, recs in self.traces.items():
            i = self.ptr[rank]
            if i < len(recs):
                wait = recs[i]
                op = self.pending(rank, wait)
                assert op is not None
                timeout = " (with a time-out)" if wait.timeout_given else ""
                head = f"rank {rank} waits{timeout} at {wait.location()} for {self.describe(op)}"
            else:
                heads = [s[0] for (r, _), s in self.streams.items() if r == rank and s]
                if not heads:
                    continue
                op = next(o for o in heads[0].ops if not o.done)
                head = f"rank {rank} posted everything; its stream is stuck at {self.describe(op)}"
            lines, blocker = self.why(op)
            out[rank] = ([head, *lines], blocker)
        return out

    def result(self) -> Result:
        errors = list(dict.fromkeys(self.errors + self.unmatched()))
        stuck = self.stuck()
        if not stuck and not errors:
            return Result(self.mode, self.sends, False, (), "")
        lines = [f"NCCL model, streams={self.mode!r}, sends={self.sends!r}:"]
        if stuck:
            lines.append(f"DEADLOCK: {len(stuck)} rank(s) stuck ({_chain(stuck)})")
            for text, _ in stuck.values():
                lines.append(f"  {text[0]}")
                lines.extend(f"    -> {t}" for t in text[1:])
        for error in errors:
            lines.append(f"  {error}")
        return Result(self.mode, self.sends, bool(stuck), tuple(errors), "\n".join(lines))


def _chain(stuck: Mapping[int, tuple[list[str], int | None]]) -> str:
    """The cycle of ranks waiting on each other, else the longest chain."""
    best: list[int] = []
    for start in stuck:
        path = [start]
        while (nxt := stuck[path[-1]][1]) is not None and nxt in stuck:
            if nxt in path:
                cycle = [*path[path.index(nxt) :], nxt]
                return "cycle: " + " -> ".join(f"rank {r}" for r in cycle)
            path.append(nxt)
        if nxt is not None:
            path.append(nxt)
        if len(path) > len(best):
            best = path
    return "chain: " + " -> ".join(f"rank {r}" for r in best)


def replay(traces: Mapping[int, Sequence[Record]], *, streams: Streams, sends: Sends) -> Result:
    """Replay ``traces`` (global rank -> its records in posting order) under NCCL's rules."""
    run = _Replay(traces, streams, sends)
    run.run()
    return run.result()


def check(traces: Mapping[int, Sequence[Record]]) -> None:
    """Replay under all four (streams, sends) modes; raise AssertionError with the first
    failing mode's report (naming the other modes that fail too)."""
    results = [replay(traces, streams=s, sends=b) for s, b in MODES]
    failed = [r for r in results if not r.ok]
    if failed:
        also = ", ".join(f"{r.streams}/{r.sends}" for r in failed[1:])
        raise AssertionError(failed[0].report + (f"\n(also fails: {also})" if also else ""))
