"""Data x pipeline parallelism: average each step's gradients over the pipeline replicas.

With ``conveyor.init(pp=P, dp=D)`` the world is D replicas of one P-rank pipeline; replica
r trains on its own shard of the global batch. Each replica's losses are already divided
by the global batch (:mod:`conveyor.runtime.step_loss`), so the global batch's gradient is
the plain sum of the replicas' gradients.

A stage's gradients are final once the last backward (or W) of that stage has run on this
rank, usually well before the pipeline has drained: the engine reports every action to
:meth:`DataParallel.after_action`, which then flattens those gradients into one buffer per
dtype and starts an asynchronous all-reduce in the ``dp`` group, overlapping the rest of
the step; :meth:`DataParallel.wait` finishes them at the end of the step.

With expert parallelism (``conveyor.init(ep=E)``) an expert shard's gradient is summed
over the ``dp / E`` replicas holding the same experts instead
(:func:`~conveyor.runtime.expert_grads.reduction_group`): those parameters get buckets of their own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from conveyor.context import Context
from conveyor.runtime.expert_grads import is_expert_parameter, reduction_group
from conveyor.runtime.program import RankProgram
from conveyor.runtime.sharding import local_shard as _local
from conveyor.runtime.step_sync import StepSync
from conveyor.runtime.transport import collective, wait_bounded
from conveyor.schedules import Action

T = TypeVar("T", bound=torch.Tensor)


@dataclass
class _Bucket:
    """Parameters whose gradients are final when all of ``stages`` are done."""

    stages: frozenset[int]
    params: list[nn.Parameter]
    # In flight, per dtype/device: (all-reduce work, its group, flat buffer, the buffer's
    # parameters); work and group None where this rank alone holds them.
    pending: list[
        tuple[dist.Work | None, dist.ProcessGroup | None, torch.Tensor, list[nn.Parameter]]
    ] = field(default_factory=list)
    launched: bool = False


class DataParallel(StepSync):
    """Sums one pipeline rank's gradients of each step over the data-parallel replicas.

    Works on the step's own gradients: the caller puts earlier ones aside before
    :meth:`begin` and adds them back after :meth:`finish`
    (:class:`~conveyor.runtime.step_grads.StepGradients`). Tied parameters need no care
    here: their cross-rank sum (``SharedParameters``) and this sum are both linear in the
    step's gradient, so run that sum after :meth:`finish`.
    """

    def __init__(self, stages: dict[int, nn.Module], ctx: Context) -> None:
        """``stages``: this rank's stages by index, and any units beside them (keys no
        action has: their gradients are summed at the step's end)."""
        if not ctx.distributed or ctx.replica_group is None:
            raise ValueError("DataParallel needs a distributed context with replicas")
        self._ctx = ctx
        users: dict[int, set[int]] = {}
        params: dict[int, nn.Parameter] = {}
        for s in sorted(stages):
            for p in stages[s].parameters():
                if p.requires_grad:
                    users.setdefault(id(p), set()).add(s)
                    params.setdefault(id(p), p)
        # Expert shards are summed over their own replicas: a bucket per kind.
        by_stages: dict[tuple[frozenset[int], bool], list[nn.Parameter]] = {}
        for key, p in params.items():
            by_stages.setdefault((frozenset(users[key]), is_expert_parameter(p)), []).append(p)
        self._buckets = [_Bucket(s, ps) for (s, _), ps in by_stages.items()]
        # The step's program: each stage's last backward / W ends its gradients.
        self._program: RankProgram | None = None
        self._done: set[int] = set()

    # ----------------------------------------------------------------- one step
    def begin(self, program: RankProgram) -> None:
        """Start a training step."""
        self._program = program
        self._done = set()
        for bucket in self._buckets:
            bucket.pending, bucket.launched = [], False

    def after_action(self, action: Action) -> None:
        """Engine hook: after a stage's last backward / W, start reducing what is final."""
        if self._program is None:
            return
        stage = self._program.closing.get(action)
        if stage is None:
            return
        self._done.add(stage)
        for bucket in self._buckets:
            if not bucket.launched and bucket.stages <= self._done:
                self._launch(bucket)

    @torch.no_grad()
    def _launch(self, bucket: _Bucket) -> None:
        bucket.launched = True
        for params in _by_dtype(bucket.params):
            p0 = params[0]
            n = sum(_numel(p) for p in params)
            # This step's gradients, then one flag per parameter: did it get a gradient?
            flat = torch.empty(n + len(params), dtype=p0.dtype, device=_local(p0).device)
            offset = 0
            for p in params:
                part = flat[offset : offset + _numel(p)]
                if p.grad is None:
                    part.zero_()
                else:
                    part.copy_(_local(_placed_as(p.grad, p)).reshape(-1))
                offset += _numel(p)
            # Set on the device: a host tensor copied in would sync per bucket on CUDA.
            flat[n:].fill_(1.0)
            for i, p in enumerate(params):
                if p.grad is None:
                    flat[n + i].zero_()
            for p in params:
                p.grad = None  # now in the buffer; finish() puts the sum back
            work = None
            # Looked up at each launch and kept only until finish(): the exit hook must be
            # able to free the group.
            group = _summed_over(reduction_group(p0, self._ctx))
            if group is not None:
                work = dist.all_reduce(flat, group=group, async_op=True)
                assert work is not None
            bucket.pending.append((work, group, flat, params))

    @torch.no_grad()
    def finish(self) -> None:
        """Finish the reductions: each ``.grad`` is this step's sum over the replicas."""
        self._program = None
        for bucket in self._buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self._buckets:
            for work, group, flat, params in bucket.pending:
                if work is not None:
                    doing = "averaging gradients over the data-parallel replicas"
                    self._collective(work, doing, group)
                n = flat.numel() - len(params)
                had = flat[n:].tolist()
                offset = 0
                for p, flag in zip(params, had, strict=True):
                    if flag != 0:  # some replica produced a gradient for p
                        p.grad = _like(p, flat[offset : offset + _numel(p)])
                    offset += _numel(p)
            bucket.pending = []

    def abort(self) -> None:
        """After a failed step: drop the reductions in flight."""
        self._program = None
        for bucket in self._buckets:
            bucket.pending = []

    def _collective(
        self, work: dist.Work | None, what: str, group: dist.ProcessGroup | None = None
    ) -> None:
        assert work is not None
        ctx = self._ctx
        ranks = dist.get_process_group_ranks(group or ctx.replica_group)
        suspect = f"a rank among {ranks} (or another replica)"
        wait_bounded(work, self._ctx.timeout, f"rank {self._ctx.rank}: {what}", suspect)


@torch.no_grad()
def make_replicas_equal(stages: dict[int, nn.Module], ctx: Context) -> None:
    """Copy the stages' parameters and buffers from replica 0 (before any sharding, but
    expert shards may be there already: those from the first replica holding the same
    experts), so all replicas start equal. Collective over the ``dp`` group (and the
    replicas of each expert shard)."""
    seen: set[int] = set()
    tensors: list[torch.Tensor] = []
    experts: list[torch.Tensor] = []
    for s in sorted(stages):
        for t in [*stages[s].parameters(), *stages[s].buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                (experts if is_expert_parameter(t) else tensors).append(t)
    src = ctx.rank_at(0, ctx.pp_rank, ctx.tp_rank, 0)  # this rank's counterpart in replica 0
    _broadcast(tensors, src, ctx.replica_group, ctx)
    group = ctx.expert_replica_group
    if experts and group is not None:
        _broadcast(experts, dist.get_process_group_ranks(group)[0], group, ctx)


def _broadcast(
    tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup | None, ctx: Context
) -> None:
    """Copy ``tensors`` (their local shards) from global rank ``src`` over ``group``."""
    for same in _by_dtype(tensors):
        flat = torch.cat([_local(t).detach().reshape(-1) for t in same])
        collective(
            functools.partial(dist.broadcast, flat, src, group=group, async_op=True),
            ctx.timeout,
            f"rank {ctx.rank}: copying the parameters of replica 0 (rank {src})",
            f"rank {src} or another replica",
        )
        offset = 0
        for t in same:
            local = _local(t)
            local.copy_(flat[offset : offset + local.numel()].view_as(local))
            offset += local.numel()


def _summed_over(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, or None when it is this rank alone (nothing to sum)."""
    return group if group is not None and dist.get_world_size(group) > 1 else None


def _numel(t: torch.Tensor) -> int:
    return _local(t).numel()


def _placed_as(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` placed as ``param`` is: tensor parallelism of an embedding sharded by
    rows gives it a replicated gradient (a local slice then, no transfer)."""
    placements = getattr(param, "placements", None)
    if placements is None or getattr(grad, "placements", placements) == placements:
        return grad
    placed: torch.Tensor = grad.redistribute(param.device_mesh, placements)  # type: ignore[attr-defined]
    return placed


def _like(param: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` (this rank's numbers) shaped as ``param``'s gradient."""
    local = _local(param)
    if local is param:
        return values.view_as(param)
    from torch.distributed.tensor import DTensor

    assert isinstance(param, DTensor)
    # The global shape given: an uneven Shard(0)'s would be guessed wrong.
    return DTensor.from_local(
        values.view_as(local),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _by_dtype(tensors: list[T]) -> list[list[T]]:
    """``tensors`` grouped by (dtype, device), in first-seen order."""
    groups: dict[tuple[torch.dtype, torch.device], list[T]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())
