"""An error on one rank stops every rank within seconds: the failure board.

A step is collective, so a rank that raises (a bad batch, a stage, a ``loss_fn``) would
leave the others waiting until the time-out. So the failing rank posts its error on a
board every rank reaches (a key of a ``TCPStore`` client of the job's rendezvous store,
``$MASTER_ADDR:$MASTER_PORT``). A thread reads it once a :data:`SLICE` while this process
is in a step or a wait longer than one; on a new notice it breaks this process's groups,
so that whatever the main thread is blocked in fails, and the main thread raises a
``PipelineError`` naming the failed rank and its error. Shorter steps read nothing.

Breaking a group: NCCL's are aborted (``ProcessGroup.abort``). gloo's cannot be (its
``abort`` does nothing in torch 2.13), nor can a gloo wait be sliced (a point-to-point
``Work.wait(timeout)`` that times out closes every connection of its group). That closing
is the break: a receive nobody sends, waited a millisecond, fails every operation pending
on the group and tells its peers (their next operation with this rank fails at once).

An error every rank raises alike (a bad batch sent to all) is posted by each: the first
post wins, the others acknowledge it, the job can go on. A notice is acted on only if the
main thread is still in the same step a tick after it was read, so that a rank about to
raise that error itself is not broken for it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, Store

from conveyor.errors import ConfigError, PipelineError, one_line

SLICE = 1.0
"""Seconds a step or wait runs before the board is read (then once per slice)."""

TICK = 0.25
"""How often the listening thread looks at the main thread's state."""

_KEY, _NONE = "notice", "\0"  # _NONE: compare_set's expected value meaning "no key"
_BREAK_TAG = 0x3C0F_F1CE  # a receive nobody sends: waited a millisecond, it breaks the group


def _notice_error(text: str) -> PipelineError:
    """The error a rank raises for another rank's failure (marked: not posted again)."""
    error = PipelineError(text)
    error.conveyor_notice = True  # type: ignore[attr-defined]
    return error


def is_notice(error: BaseException | None) -> bool:
    """Whether ``error`` was raised for another rank's failure (:func:`_notice_error`)."""
    return getattr(error, "conveyor_notice", False) is True


Groups = Callable[[], Sequence[dist.ProcessGroup | None]]


class Board:
    """This process's view of the failure board (see the module doc).

    Args:
        store: The board, or None: failures are not told (the others' time-outs tell).
        rank: This process's global rank.
        groups: The process groups to break when stopping for another rank's failure.
        hosts_store: The store lives in this process (rank 0 outside torchrun): a failed
            step waits, at most ``linger`` seconds, for the others to read the notice.
        linger: See ``hosts_store``.
    """

    def __init__(
        self,
        store: Store | None,
        rank: int,
        groups: Groups,
        hosts_store: bool = False,
        linger: float = 3.0,
    ) -> None:
        self.store = store
        self.rank = rank
        self.groups = groups
        self.hosts_store = hosts_store
        self.linger = linger
        self.seen = ""  # the last notice this process acknowledged ("": none)
        self.notice = ""  # the failure it stopped for, until a step finishes
        self.broken = False
        # Failed or stopped since the last step that finished: exit without the barrier.
        self.unresolved = False
        self.depth = 0  # nested steps and waits of the main thread
        self.since = 0.0  # when the outermost began
        self.region = 0  # which one (counts outermost ones)
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self._last_read = -SLICE
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None:
            self._thread = threading.Thread(target=self._listen, name="conveyor-board", daemon=True)
            self._thread.start()

    def __enter__(self) -> Board:
        with self._count:  # the overlapped pair's helper thread waits too
            if self.depth == 0:
                self.since = time.monotonic()
                self.region += 1
            self.depth += 1
        return self

    def __exit__(self, *_: object) -> None:
        with self._count:
            self.depth -= 1

    def post(self, error: BaseException) -> PipelineError | None:
        """Post this rank's ``error``. Returns another rank's notice that was there first
        (a new one), which this rank then acknowledges instead."""
        self.unresolved = True
        if self.store is None:
            return None
        token = uuid.uuid4().hex
        mine = f"{self.rank}\n{token}\n{one_line(error, 2000)}"
        with self._lock:
            got = _text_of(self._store_call(lambda s: s.compare_set(_KEY, self.seen, mine)))
        if got is None or got == self.seen:
            return None
        if got != mine:  # another rank posted first
            return self._take(got, "its step")
        self.seen = mine
        return None

    def settle(self) -> None:
        """Before a failed step's error leaves the process whose store is the board: wait
        until every other rank read the notice (at most ``linger`` seconds), since the
        board ends with this process (or already when the script destroys the default
        group)."""
        if not self.hosts_store or self.store is None or not self.seen:
            return
        token = self.seen.split("\n", 2)[1]
        world = dist.get_world_size() if dist.is_initialized() else 1
        end = time.monotonic() + self.linger
        while time.monotonic() < end:
            with self._lock:
                count = self._store_call(lambda s: s.add(f"read/{token}", 0))
            if not isinstance(count, int) or count >= world - 1:
                return
            time.sleep(0.05)

    def stopped(self, error: BaseException | None, doing: str) -> PipelineError | None:
        """In a wait's or a step's error path: the notice to raise instead of ``error``
        (the one this process stopped for, or a new one on the board), else None."""
        if is_notice(error):
            return None
        if self.notice and self.unresolved:  # stopped for it already: a consequence
            return _notice_error(self._text(doing))
        raw = self._read(force=True)
        return self._take(raw, doing) if raw is not None else None

    def claim(self, doing: str) -> PipelineError | None:
        """A new notice (read at most once a slice), taken as this process's stop while
        ``doing``: for a thread that then aborts the groups itself (the CUDA watchdog)."""
        raw = self._read(force=False)
        if raw is None:
            return None
        notice = self._take(raw, doing)
        self.broken = True
        return notice

    def _listen(self) -> None:
        pending: tuple[int, str] | None = None
        while not self._stop.wait(TICK):
            if self.depth == 0 or self.broken or time.monotonic() - self.since < SLICE:
                pending = None
                continue
            if pending is not None:
                region, raw = pending
                pending = None
                if region == self.region and self.depth > 0 and raw != self.seen:
                    self.stop(self._take(raw, "its step"))
                continue
            new = self._read(force=False)
            if new is not None:
                pending = (self.region, new)

    def stop(self, notice: PipelineError) -> None:
        """Stop for ``notice``: say so, and break the groups so that blocked calls return."""
        self.broken = True
        print(f"conveyor: {notice}", file=sys.stderr, flush=True)
        break_groups(self.groups())

    def close(self, leaving: bool = True) -> bool:
        """Stop listening; returns whether a failure is unresolved. ``leaving`` (at exit):
        then the groups are broken, so that no worker thread stays blocked on a peer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if leaving and self.unresolved and not self.broken:
            self.broken = True
            break_groups(self.groups())
        return self.unresolved

    def _read(self, force: bool) -> str | None:
        """The board's notice if it is one this process has not acknowledged (one round
        trip; unless ``force``, at most once a slice)."""
        if self.store is None:
            return None
        now = time.monotonic()
        if not force and now - self._last_read < SLICE:
            return None
        self._last_read = now
        with self._lock:
            raw = _text_of(self._store_call(lambda s: s.compare_set(_KEY, _NONE, _NONE)))
        if raw is None or raw in (_NONE, self.seen):
            return None
        return raw

    def _take(self, raw: str, doing: str) -> PipelineError:
        """Acknowledge the notice ``raw`` (once): this process stops for it."""
        rank, token, text = raw.split("\n", 2)
        with self._lock:
            new, self.seen, self.unresolved = raw != self.seen, raw, True
            self.notice = f"rank {rank} failed: {text}"
            if new:
                self._store_call(lambda s: s.add(f"read/{token}", 1))
        return _notice_error(self._text(doing))

    def _text(self, doing: str) -> str:
        """The notice as this rank raises it: ``rank 1 failed: ERROR; rank 0 stopped
        (WHAT IT WAITED FOR)`` (``doing`` names a wait as ``rank 0: ...``) or ``...;
        rank 0 stopped DOING``."""
        if doing.startswith("rank "):
            return f"{self.notice}; rank {self.rank} stopped ({doing.split(': ', 1)[-1]})"
        return f"{self.notice}; rank {self.rank} stopped {doing}"

    def _store_call(self, call: Callable[[Store], object]) -> object:
        """``call(store)``, or None once the store is gone (its host process ended): from
        then on this process tells and reads nothing."""
        store = self.store
        if store is None:
            return None
        try:
            return call(store)
        except Exception as exc:
            self.store = None
            print(f"conveyor: the failure board is gone ({one_line(exc, 200)})", file=sys.stderr)
            return None


def _text_of(value: object) -> str | None:
    return value.decode(errors="replace") if isinstance(value, bytes) else None


def break_groups(groups: Sequence[dist.ProcessGroup | None]) -> None:
    """Break ``groups`` (see the module doc): pending operations on them fail at once."""
    if not dist.is_initialized():
        return
    for group in groups:
        if group is None:
            continue
        with contextlib.suppress(Exception):
            group.abort()  # NCCL; nothing on torch 2.13's gloo
            if "gloo" in str(dist.get_backend(group)):
                _close_gloo(group)


def _close_gloo(group: dist.ProcessGroup) -> None:
    """Close every connection of a gloo ``group``: a receive from a peer, timed out after a
    millisecond, closes them all. A peer that closed its side already fails the receive
    at once instead (closing nothing), so the next peer is tried until one times out."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    for step in range(1, size):
        peer = dist.get_global_rank(group, (me + step) % size)
        try:
            work = dist.irecv(torch.empty(1), src=peer, group=group, tag=_BREAK_TAG)
            if work is not None:
                work.wait(datetime.timedelta(milliseconds=1))
        except Exception as exc:
            if "timed out" in str(exc).lower():
                return


_QUIET = Board(None, 0, list)  # a world of one: tells and reads nothing
_board: Board | None = None
_key: tuple[str, ...] | None = None


def connect(rank: int, timeout: float, groups: Groups) -> None:
    """Connect this process to the job's board (:func:`conveyor.context.init`, once the
    default group exists); again after a new ``init``, keeping what it acknowledged."""
    global _board, _key
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = (str(address), str(port), restart, str(rank))
    if _board is not None and key == _key and _board.store is not None:
        with contextlib.suppress(Exception):  # still alive (not a destroyed group's)
            _board.store.check([_KEY])
            _board.groups = groups
            return
    seen = _board.seen if _board is not None and key == _key else ""  # the same store's
    if _board is not None:
        _board.close(leaving=False)
    store: Store | None = None
    if address and port:
        try:
            client = dist.TCPStore(  # type: ignore[attr-defined]  # torch.distributed's own
                address,
                int(port),
                is_master=False,
                timeout=datetime.timedelta(seconds=min(timeout, 10.0)),
                wait_for_workers=False,
            )
            store = PrefixStore(f"conveyor/failure/{restart}/", client)
        except Exception as exc:
            print(
                f"conveyor: no failure board ({one_line(exc, 200)}); an error on one rank "
                f"reaches the others at their time-out",
                file=sys.stderr,
            )
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    _board = Board(store, rank, groups, hosts_store=rank == 0 and not agent,
                   linger=min(3.0, timeout))  # fmt: skip
    _board.seen = seen
    _key = key


def board() -> Board:
    """This process's board (one that does nothing where there is none)."""
    return _board if _board is not None else _QUIET


def close() -> bool:
    """At exit: stop listening; whether a failure is unresolved (the groups are then
    broken: leave without the barrier)."""
    global _board, _key
    if _board is None:
        return False
    unresolved = _board.close()
    _board, _key = None, None
    return unresolved


def reraise(error: BaseException | None, doing: str) -> None:
    """In a wait's error path (``error``: what the wait raised, None for a time-out):
    raise another rank's notice instead if there is one (the one this process stopped
    for, or a new one on the board)."""
    notice = board().stopped(error, doing)
    if notice is not None:
        raise notice from error


class Step:
    """The error path of a step (``with Step():`` around it): this rank's own error is
    posted for the others; an error caused by stopping for another rank's is replaced by
    that rank's notice. A step that finishes resolves earlier failures."""

    __slots__ = ("_board",)

    def __enter__(self) -> Step:
        self._board = board().__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        b = self._board
        b.__exit__()
        if error is None:  # a finished step: earlier failures were resolved
            b.unresolved = b.broken
            b.notice = b.notice if b.broken else ""
            return
        b.unresolved = True
        if not isinstance(error, Exception):  # KeyboardInterrupt: every rank gets one
            return
        notice = None
        if b.broken:
            notice = b.stopped(error, "its step")
        elif not is_notice(error):
            other = b.post(error)
            # Another rank failed first: this rank's error is its consequence, unless
            # it is this rank's own bad argument (every rank may raise the same one).
            if not isinstance(error, ConfigError):
                notice = other
        b.settle()
        if notice is not None:
            raise notice from error


def abort_groups() -> None:
    """Break the groups of this process's board (the CUDA watchdog's abort, also on gloo)."""
    if _board is not None:
        break_groups(_board.groups())
