"""Point-to-point transfers between pipeline ranks, with bounded waits."""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch
import torch.distributed as dist

import conveyor._failure as failure
from conveyor.errors import PipelineError, one_line
from conveyor.runtime.watchdog import Watchdog

Work = dist.Work
Described = str | Callable[[], str]
"""What a transfer is, in words for its errors: a string, or a call that makes it (only
once an error needs it: a step posts and waits for many transfers)."""


def _text(what: Described) -> str:
    return what if isinstance(what, str) else what()


class Transport:
    """Grouped, order-matched sends and receives to other pipeline ranks (by pipeline rank).

    Operations are posted in groups with ``batch_isend_irecv`` and tag 0: messages match
    by their order between two ranks, as under NCCL (gloo, which could match by tag, is
    held to the same rule). On CPU every wait is bounded by ``timeout`` seconds; on CUDA
    waits are stream-ordered and a :class:`~conveyor.runtime.watchdog.Watchdog` names a
    transfer that does not finish in time. Either way a failure or time-out becomes a
    :class:`PipelineError` that names this rank, the peer and what was awaited, or, where
    another rank's step failed, that rank and its error (:mod:`conveyor._failure`).
    """

    def __init__(
        self, rank: int, to_global: Callable[[int], int], device: torch.device, timeout: float
    ) -> None:
        self.rank = rank
        self.to_global = to_global
        self.device = device
        self.timeout = timeout
        # Stream-ordered waits where the device allows them (CUDA); the environment
        # variable lets tests run that path on CPU.
        stream = device.type == "cuda" or os.environ.get("CONVEYOR_STREAM_WAITS") == "1"
        self.watchdog = Watchdog(timeout) if stream else None
        # Each send keeps its tensor alive until the transfer is done.
        self._sends: list[tuple[Work, torch.Tensor, Described, int]] = []
        self._global: dict[int, int] = {}  # pipeline rank -> global rank, as asked
        self._delta = datetime.timedelta(seconds=timeout)

    def post(self, ops: list[Op]) -> list[Work]:
        """Post ``ops`` as one group; returns their works in the same order. Sends are
        waited for by :meth:`flush`, receives by :meth:`wait`."""
        if not ops:
            return []
        if self.watchdog is not None:
            self.watchdog.check()
        works = self._post_now(ops)
        for op, work in zip(ops, works, strict=True):
            if op.send:
                self._sends.append((work, op.tensor, op.what, op.peer))
        return works

    def _post_now(self, ops: list[Op]) -> list[Work]:
        ranks, send, recv = self._global, dist.isend, dist.irecv
        batch = []
        for op in ops:
            peer = ranks.get(op.peer)
            if peer is None:
                peer = ranks[op.peer] = self.to_global(op.peer)
            batch.append(dist.P2POp(send if op.send else recv, op.tensor, peer))
        try:
            works = dist.batch_isend_irecv(batch)
        except Exception as exc:
            peers = ", ".join(sorted({self.name(op.peer) for op in ops}))
            doing = f"{self.name(self.rank)}: posting transfers with {peers}"
            failure.reraise(exc, doing)
            raise PipelineError(
                f"{doing} failed ({one_line(exc, 200)}); a peer may have died"
            ) from exc
        if len(works) != len(ops):  # NCCL: one work for the whole coalesced group
            works = [works[0]] * len(ops)
        return works

    def wait(self, work: Work, peer: int, what: Described) -> None:
        """Wait for ``work`` (see the class doc), naming ``what`` if it fails."""
        self._wait(work, peer, what, "from")

    def _wait(self, work: Work, peer: int, what: Described, direction: str) -> None:
        """Wait for a transfer ``direction`` (``from`` / ``to``) pipeline rank ``peer``."""

        def describe() -> tuple[str, str]:
            them = self.name(peer)
            return f"{self.name(self.rank)}: {_text(what)} {direction} {them}", them

        if self.watchdog is None:  # in a step, whose region the failure board watches
            _settle(work, self._delta, self.timeout, describe)
            return
        doing, suspect = describe()
        self.watchdog.watch(work, doing, suspect)
        try:
            work.wait()  # on CUDA: the current stream waits, the CPU does not
        except Exception as exc:
            self.watchdog.check()
            failure.reraise(exc, doing)
            raise PipelineError(
                f"{doing} failed ({one_line(exc, 200)}); {suspect} may have died or stalled"
            ) from exc

    def name(self, rank: int) -> str:
        """``rank N`` for pipeline rank ``rank``; with data parallelism, the global rank
        and the pipeline rank (``rank 3 (pipeline rank 1)``)."""
        index = self.to_global(rank)
        return f"rank {rank}" if index == rank else f"rank {index} (pipeline rank {rank})"

    def flush(self) -> None:
        """Wait for every send posted since the last flush (a coalesced group's one work
        once)."""
        sends, self._sends = self._sends, []
        done: set[int] = set()
        for work, _, what, peer in sends:
            if id(work) not in done:
                done.add(id(work))
                self._wait(work, peer, what, "to")

    def prune(self) -> None:
        """Forget sends that already completed, so their buffers can be freed early."""
        if len(self._sends) > 8:
            self._sends = [s for s in self._sends if not s[0].is_completed()]


class Op(NamedTuple):
    """One send (``send=True``) or receive of ``tensor`` with pipeline rank ``peer``;
    ``what`` names it in errors."""

    send: bool
    tensor: torch.Tensor
    peer: int
    what: Described = ""


def wait_bounded(work: Work, timeout: float, doing: str, suspect: str) -> None:
    """Wait for ``work`` at most ``timeout`` seconds; a failure or time-out raises a
    :class:`PipelineError` saying that ``doing`` failed and ``suspect`` may have died or
    stalled, or, where another rank failed its step, that rank's error
    (:mod:`~conveyor._failure`: a wait longer than a second reads the board)."""
    with failure.board():
        _bounded(work, timeout, doing, suspect)


def _bounded(work: Work, timeout: float, doing: str, suspect: str) -> None:
    """:func:`wait_bounded` without entering the board's region (the caller is in one)."""
    _settle(work, datetime.timedelta(seconds=timeout), timeout, lambda: (doing, suspect))


def _settle(
    work: Work,
    delta: datetime.timedelta,
    timeout: float,
    describe: Callable[[], tuple[str, str]],
) -> None:
    """:func:`_bounded` with its words, ``(doing, suspect)``, made only for an error."""
    try:
        ok = work.wait(delta)
    except Exception as exc:
        doing, suspect = describe()
        failure.reraise(exc, doing)
        raise PipelineError(
            f"{doing} failed ({one_line(exc, 200)}); {suspect} may have died or stalled "
            f"(time-out {timeout:g} s, set with conveyor.init(timeout=...) or "
            f"$CONVEYOR_TIMEOUT)"
        ) from exc
    if ok is False:
        doing, suspect = describe()
        failure.reraise(None, doing)
        raise PipelineError(
            f"{doing} did not finish within {timeout:g} s; {suspect} may have died or stalled"
        )


def collective(start: Callable[[], Work | None], timeout: float, doing: str, suspect: str) -> None:
    """Run a collective started by ``start`` (``async_op=True``) and wait at most
    ``timeout`` seconds: a failure, time-out or error at the start raises a
    :class:`PipelineError` saying that ``doing`` failed and ``suspect`` may have died,
    stalled or not called it."""
    work = guarded(start, doing, suspect)
    if work is not None:
        wait_bounded(work, timeout, doing, suspect)


T = TypeVar("T")


def guarded(call: Callable[[], T], doing: str, suspect: str) -> T:
    """Run a blocking collective (the object collectives have no ``async_op``; the process
    group's time-out bounds them): a failure raises a :class:`PipelineError` naming what
    was done and who may have died, stalled or not called it, or another rank's failure
    (as :func:`wait_bounded`)."""
    try:
        with failure.board():
            return call()
    except Exception as exc:
        failure.reraise(exc, doing)
        raise PipelineError(
            f"{doing} failed ({one_line(exc, 200)}); {suspect} may have died, stalled or not "
            f"reached the same call"
        ) from exc
