"""Point-to-point transfers between pipeline ranks, with bounded waits."""

from __future__ import annotations

import datetime
from collections.abc import Callable

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
        try:
            ok = work.wait(self._delta)
        except Exception as exc:
            raise PipelineError(
                f"rank {self.rank}: {what} from rank {peer} failed ({_short(exc)}); rank "
                f"{peer} may have died or stalled (time-out {self.timeout:g} s, set with "
                f"conveyor.init(timeout=...) or $CONVEYOR_TIMEOUT)"
            ) from exc
        if ok is False:
            raise PipelineError(
                f"rank {self.rank}: {what} from rank {peer} did not arrive within "
                f"{self.timeout:g} s; rank {peer} may have died or stalled"
            )

    def flush(self) -> None:
        """Wait for every send started since the last flush."""
        sends, self._sends = self._sends, []
        for work, _, what in sends:
            try:
                work.wait(self._delta)
            except Exception as exc:
                raise PipelineError(
                    f"rank {self.rank}: {what} failed ({_short(exc)}); the receiving rank may "
                    f"have died or stalled (time-out {self.timeout:g} s)"
                ) from exc

    def prune(self) -> None:
        """Forget sends that already completed, so their buffers can be freed early."""
        if len(self._sends) > 8:
            self._sends = [s for s in self._sends if not s[0].is_completed()]


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
