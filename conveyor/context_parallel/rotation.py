"""Moving blocks of keys and values around the cp ranks: rank ``r`` sends to ``r + 1`` and
receives from ``r - 1``, so after ``t`` moves it holds rank ``r - t``'s block.

:class:`Ring` moves them between processes (point-to-point over the cp group, each move one
``batch_isend_irecv`` group of one send and one receive, posted in the same order by every
rank of the group: under NCCL's rules the moves match by order and cannot deadlock).
:class:`Stacked` is the world of one process, which holds every cp rank's share stacked on
a leading dimension: a move is a roll of that dimension.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from conveyor.runtime.transport import wait_bounded


class Move(Protocol):
    """A move in flight; :meth:`result` waits for it."""

    def result(self) -> Tensor:
        """The block received from the previous rank."""


class Rotation(Protocol):
    """How this process's cp ranks pass blocks on (module doc)."""

    size: int
    """The cp ranks (``cp``)."""

    ranks: tuple[int, ...]
    """The cp ranks this process computes, in the order of its stacked dimension."""

    def start(self, block: Tensor, what: str) -> Move:
        """Send ``block`` to the next rank and receive the previous rank's (same shape);
        ``what`` names the transfer in a time-out."""


class _Done:
    def __init__(self, value: Tensor) -> None:
        self.value = value

    def result(self) -> Tensor:
        return self.value


class Stacked:
    """Every cp rank in this process, stacked on dimension 0 (rank ``i`` at index ``i``)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ranks = tuple(range(size))

    def start(self, block: Tensor, what: str) -> Move:
        """Rank ``i`` gets rank ``i - 1``'s block at once."""
        return _Done(torch.roll(block, 1, dims=0))


class _Posted:
    """A move posted by a :class:`Ring`: its works, the receive's buffer and the sent
    tensor (kept alive until the move is waited for)."""

    def __init__(
        self, works: list[dist.Work], buffer: Tensor, sent: Tensor, ring: Ring, what: str
    ) -> None:
        self.works, self.buffer, self.sent, self.ring, self.what = works, buffer, sent, ring, what

    def result(self) -> Tensor:
        ring = self.ring
        for work in self.works:
            if ring.stream_waits:
                work.wait()  # the stream waits (CUDA); the CPU does not
            else:
                wait_bounded(
                    work,
                    ring.timeout,
                    f"cp rank {ring.rank}: {self.what} from cp rank {ring.previous}",
                    f"cp rank {ring.previous} (global rank {ring.members[ring.previous]})",
                )
        return self.buffer


class Ring:
    """This process is cp rank ``rank`` of ``members`` (global ranks by cp rank), talking
    over ``group``; on CPU a wait lasts at most ``timeout`` seconds, on CUDA
    (``stream_waits``) the stream waits and the CPU runs on."""

    def __init__(
        self,
        rank: int,
        members: tuple[int, ...],
        group: dist.ProcessGroup,
        timeout: float,
        stream_waits: bool = False,
    ) -> None:
        self.rank, self.members, self.group, self.timeout = rank, members, group, timeout
        self.size = len(members)
        self.ranks = (rank,)
        self.next = (rank + 1) % self.size
        self.previous = (rank - 1) % self.size
        self.stream_waits = stream_waits

    def start(self, block: Tensor, what: str) -> Move:
        """Post the send to the next rank and the receive from the previous one, as one group."""
        block = block.contiguous()
        buffer = torch.empty_like(block)
        ops = [
            dist.P2POp(dist.isend, block, self.members[self.next], self.group),
            dist.P2POp(dist.irecv, buffer, self.members[self.previous], self.group),
        ]
        return _Posted(dist.batch_isend_irecv(ops), buffer, block, self, what)
