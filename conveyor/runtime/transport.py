"""Point-to-point transfers between pipeline ranks, with bounded waits."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from conveyor.errors import PipelineError

Work = dist.Work


class Transport:
    """Asynchronous sends and receives to other pipeline ranks (by pipeline rank).

    Every wait is bounded by ``timeout`` seconds; a failure or time-out becomes a
    :class:`PipelineError` that names this rank, the peer and what was awaited.
    """

    def __init__(
        self, rank: int, to_global: Callable[[int], int], device: torch.device, timeout: float
    ) -> None:
        self.rank = rank
        self.to_global = to_global
        self.device = device
        self.timeout = timeout
        self._delta = datetime.timedelta(seconds=timeout)
        # Each send keeps its tensor alive until the transfer is done.
        self._sends: list[tuple[Work, torch.Tensor, str]] = []

    def send(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> None:
        """Start sending ``tensor`` to ``peer``; completion is checked by :meth:`flush`."""
        work = dist.isend(tensor, self.to_global(peer), tag=tag)
        if work is not None:
            self._sends.append((work, tensor, what))

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Post a receive into ``tensor`` from ``peer``; wait on it with :meth:`wait`."""
        work = dist.irecv(tensor, self.to_global(peer), tag=tag)
        assert work is not None
        return work

    def wait(self, work: Work, peer: int, what: str) -> None:
        """Wait for ``work`` at most ``timeout`` seconds, naming ``what`` if it fails."""
        them = self.name(peer)
        wait_bounded(work, self.timeout, f"{self.name(self.rank)}: {what} from {them}", them)

    def name(self, rank: int) -> str:
        """``rank N`` for pipeline rank ``rank``; with data parallelism, the global rank
        and the pipeline rank (``rank 3 (pipeline rank 1)``)."""
        index = self.to_global(rank)
        return f"rank {rank}" if index == rank else f"rank {index} (pipeline rank {rank})"

    def flush(self) -> None:
        """Wait for every send started since the last flush."""
        sends, self._sends = self._sends, []
        for work, _, what in sends:
            try:
                work.wait(self._delta)
            except Exception as exc:
                raise PipelineError(
                    f"{self.name(self.rank)}: {what} failed ({short_error(exc)}); the "
                    f"receiving rank may have died or stalled (time-out {self.timeout:g} s)"
                ) from exc

    def prune(self) -> None:
        """Forget sends that already completed, so their buffers can be freed early."""
        if len(self._sends) > 8:
            self._sends = [s for s in self._sends if not s[0].is_completed()]


def wait_bounded(work: Work, timeout: float, doing: str, suspect: str) -> None:
    """Wait for ``work`` at most ``timeout`` seconds; a failure or time-out raises a
    :class:`PipelineError` saying that ``doing`` failed and ``suspect`` may have died or
    stalled."""
    try:
        ok = work.wait(datetime.timedelta(seconds=timeout))
    except Exception as exc:
        raise PipelineError(
            f"{doing} failed ({short_error(exc)}); {suspect} may have died or stalled "
            f"(time-out {timeout:g} s, set with conveyor.init(timeout=...) or "
            f"$CONVEYOR_TIMEOUT)"
        ) from exc
    if ok is False:
        raise PipelineError(
            f"{doing} did not finish within {timeout:g} s; {suspect} may have died or stalled"
        )


def short_error(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, shortened at a word boundary to about
    ``limit`` characters."""
    text = str(exc).strip().splitlines()
    if not text:
        return type(exc).__name__
    line = text[0]
    if len(line) <= limit:
        return line
    cut = line.rfind(" ", 0, limit)
    return line[: cut if cut > limit // 2 else limit].rstrip(" ,;:") + " ..."


def collective(
    start: Callable[[], Work | None], timeout: float, doing: str, suspect: str
) -> None:
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
    was done and who may have died, stalled or not called it."""
    try:
        return call()
    except Exception as exc:
        raise PipelineError(
            f"{doing} failed ({short_error(exc)}); {suspect} may have died, stalled or not "
            f"reached the same call"
        ) from exc
