"""Parameters that several ranks hold copies of (tied weights): keep the copies equal."""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor._groups import Held
from conveyor.context import Context
from conveyor.runtime.sharding import local_shard
from conveyor.runtime.step_sync import StepSync
from conveyor.runtime.transport import collective


class SharedParameters(StepSync):
    """Sums, over the ranks holding a copy, each step's gradient of a shared parameter.

    ``shared`` lists each tied parameter as its name in each stage using it, and those
    stages; ``local`` are this process's stages, where the copies are looked up by name.

    Every rank builds the same partition, so every rank creates the same process groups in
    the same order (``new_group`` is collective over the world): for each set of pipeline
    ranks sharing a parameter, one group per data-parallel replica and tensor-parallel
    rank, holding that pipeline's ranks of the set. Gradients are summed within it only.
    """

    def __init__(
        self,
        shared: list[tuple[dict[int, str], list[int]]],
        placement: tuple[int, ...],
        local: dict[int, nn.Module],
        ctx: Context,
    ) -> None:
        # Groups through handles the exit hook releases (conveyor/_groups.py says why).
        self._entries: list[tuple[torch.Tensor, Held[dist.ProcessGroup], int]] = []
        self._where: list[tuple[int, str]] = []  # (local stage, name) of each entry's copy
        self._rank = ctx.rank
        self._timeout = ctx.timeout
        if not ctx.distributed:
            return  # one process: the stages share the very same Parameter object
        timeout = datetime.timedelta(seconds=ctx.timeout)
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for names, stages in shared:
            ranks = tuple(sorted({placement[s] for s in stages}))
            if len(ranks) < 2:
                continue
            if ranks not in groups:
                for replica in range(ctx.dp_size):
                    for part in range(ctx.cp_size):
                        for shard in range(ctx.tp_size):
                            members = [ctx.rank_at(replica, r, shard, part) for r in ranks]
                            group = dist.new_group(members, timeout=timeout)
                            if (replica, part, shard) == (ctx.dp_rank, ctx.cp_rank, ctx.tp_rank):
                                assert group is not None
                                groups[ranks] = group
            mine = [s for s in stages if s in local]
            if mine:
                param = dict(local[mine[0]].named_parameters())[names[mine[0]]]
                held = Held(groups[ranks])
                self._entries.append((param, held, ctx.global_rank(ranks[0])))
                self._where.append((mine[0], names[mine[0]]))

    def __len__(self) -> int:
        return len(self._entries)

    def rebind(self, local: dict[int, nn.Module]) -> None:
        """Look this rank's copies up again: tensor parallelism and FSDP replace a stage's
        parameters with sharded ones."""
        self._entries = [
            (dict(local[s].named_parameters())[name], group, src)
            for (s, name), (_, group, src) in zip(self._where, self._entries, strict=True)
        ]

    def links(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """Each local copy with the global ranks of the group holding the copies, in the
        same global order on every rank."""
        return [
            (param, tuple(dist.get_process_group_ranks(held.get())))
            for param, held, _ in self._entries
        ]

    def copies(self) -> set[int]:
        """``id`` of each local parameter whose first copy lives on another rank (to count a
        tied parameter once in a norm over the whole model)."""
        return {id(p) for p, _, src in self._entries if src != self._rank}

    @torch.no_grad()
    def make_equal(self) -> None:
        """Copy each shared parameter from its lowest rank, so the copies start equal."""
        for param, held, src in self._entries:
            group = held.get()
            self._run(
                functools.partial(dist.broadcast, param.data, src, group=group, async_op=True),
                f"copying tied weights from rank {src}",
                group,
            )

    def finish(self) -> None:
        """The step's gradients are final here: sum the tied ones (see :meth:`reduce`)."""
        self.reduce()

    @torch.no_grad()
    def reduce(self) -> None:
        """Sum this step's gradient of each shared parameter over its copies (the caller
        keeps earlier gradients aside: :class:`~conveyor.runtime.step_grads.StepGradients`)."""
        for param, held, _ in self._entries:
            group = held.get()
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            # FSDP / tensor-parallel copies are sharded alike: the shards add up.
            self._run(
                functools.partial(
                    dist.all_reduce, local_shard(param.grad), group=group, async_op=True
                ),
                "summing the gradients of tied weights",
                group,
            )

    def _run(self, start: Callable[[], dist.Work | None], what: str, group: Any) -> None:
        ranks = dist.get_process_group_ranks(group)
        others = [r for r in ranks if r != self._rank]
        suspect = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}"
        collective(start, self._timeout, f"rank {self._rank}: {what}", suspect)
