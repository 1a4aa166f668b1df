"""Moving blocks of keys and values around the cp ranks: after ``t`` moves rank ``r``
holds rank ``r - t``'s block; and each block's gradient back to its owner.

:class:`Ring` moves them between processes (point-to-point over the cp group: rank ``r``
sends to ``r + 1`` and receives from ``r - 1``, each move one ``batch_isend_irecv`` group of
one send and one receive, posted in the same order by every rank of the group: under
NCCL's rules the moves match by order and cannot deadlock); a block's gradient travels on
with it and is home after a full turn. :class:`Gathered` all-gathers the blocks once and
reduce-scatters their gradients once (Llama 3's choice: fewer, larger transfers, the whole
sequence's keys held at once). :class:`Stacked` is the world of one process, which holds
every cp rank's share stacked on a leading dimension: a move is a roll of that dimension.
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


class Turn(Protocol):
    """One attention call's turn of the blocks (forward or backward)."""

    def start(self, block: Tensor, what: str) -> Move:
        """Pass ``block`` (the one held at this step) on and get the next step's; ``what``
        names the transfer in a time-out."""

    def give(self, gradient: Tensor, last: bool) -> Move:
        """Hand on the gradient so far of the block held at this step; the move's result
        is the gradient so far of the next step's block, and after the ``last`` step the
        whole gradient of this rank's own block."""


class Rotation(Protocol):
    """How this process's cp ranks pass blocks on (module doc)."""

    size: int
    """The cp ranks (``cp``)."""

    ranks: tuple[int, ...]
    """The cp ranks this process computes, in the order of its stacked dimension."""

    def turn(self) -> Turn:
        """A new turn, for one attention call's forward or backward."""


class _Done:
    def __init__(self, value: Tensor) -> None:
        self.value = value

    def result(self) -> Tensor:
        return self.value


class Stacked:
    """Every cp rank in this process, stacked on dimension 0 (rank ``i`` at index ``i``)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.ranks: tuple[int, ...] = tuple(range(size))

    def turn(self) -> Stacked:
        """Itself: a roll needs no state."""
        return self

    def start(self, block: Tensor, what: str) -> Move:
        """Rank ``i`` gets rank ``i - 1``'s block at once."""
        return _Done(torch.roll(block, 1, dims=0))

    def give(self, gradient: Tensor, last: bool) -> Move:
        """The gradient goes on with its block."""
        return self.start(gradient, "")


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
        self.ranks: tuple[int, ...] = (rank,)
        self.next = (rank + 1) % self.size
        self.previous = (rank - 1) % self.size
        self.stream_waits = stream_waits

    def turn(self) -> Ring:
        """Itself: each move is posted and waited for on its own."""
        return self

    def give(self, gradient: Tensor, last: bool) -> Move:
        """The gradient goes on with its block, to the next rank."""
        return self.start(gradient, "key and value gradients")

    def start(self, block: Tensor, what: str) -> Move:
        """Post the send to the next rank and the receive from the previous one, as one group."""
        block = block.contiguous()
        buffer = torch.empty_like(block)
        ops = [
            dist.P2POp(dist.isend, block, self.members[self.next], self.group),
            dist.P2POp(dist.irecv, buffer, self.members[self.previous], self.group),
        ]
        return _Posted(dist.batch_isend_irecv(ops), buffer, block, self, what)


class Gathered:
    """The cp ranks' blocks all-gathered over ``group`` once per turn, their gradients
    reduce-scattered once (module doc); ``ring`` gives the ranks and the time-out."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.size = ring.size
        self.ranks: tuple[int, ...] = ring.ranks

    def turn(self) -> _GatheredTurn:
        """A turn that gathers at its first move."""
        return _GatheredTurn(self.ring)


class _GatheredTurn:
    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.step = 0
        self.blocks: Tensor | None = None
        self.gradients: list[Tensor] = []

    def _wait(self, work: dist.Work | None, what: str) -> None:
        ring = self.ring
        if work is None:
            return
        if ring.stream_waits:
            work.wait()
        else:
            wait_bounded(work, ring.timeout, f"cp rank {ring.rank}: {what}", "a cp rank")

    def start(self, block: Tensor, what: str) -> Move:
        """Gather every rank's block at the first move; later moves index into them."""
        ring = self.ring
        if self.blocks is None:
            block = block.contiguous()
            # every rank's block (a leading dimension of 1) after the other, on dimension 0
            shape = (ring.size * block.size(0), *block.shape[1:])
            self.blocks = torch.empty(shape, dtype=block.dtype, device=block.device)
            work = dist.all_gather_into_tensor(self.blocks, block, ring.group, async_op=True)
            self._wait(work, f"all-gathering {what}")
        self.step += 1
        source = (ring.rank - self.step) % ring.size
        return _Done(self.blocks.narrow(0, source, 1))

    def give(self, gradient: Tensor, last: bool) -> Move:
        """Keep each block's gradient; after the last, sum them into their owners'."""
        ring = self.ring
        self.gradients.append(gradient)
        if not last:
            return _Done(torch.zeros_like(gradient))
        # the gradient of the block held at step t belongs to rank r - t
        by_owner = [self.gradients[(ring.rank - owner) % ring.size] for owner in range(ring.size)]
        whole = torch.cat(by_owner).contiguous()
        own = torch.empty_like(gradient)
        work = dist.reduce_scatter_tensor(own, whole, group=ring.group, async_op=True)
        self._wait(work, "reduce-scattering key and value gradients")
        return _Done(own)
