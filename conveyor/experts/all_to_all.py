"""The all-to-all that carries tokens to their experts and back, as torch custom ops.

``conveyor::all_to_all(x, out_splits, in_splits, group_name, timeout)`` sends rows
``in_splits[r]`` of ``x`` (in order) to rank ``r`` of the group and returns the rows
received, ``out_splits[r]`` from rank ``r``, concatenated; splits may be uneven and zero.
Its gradient is the same op with the splits swapped (registered with
``torch.library.register_autograd``), so the backward all-to-alls come from autograd, in
the reverse order of the forward ones on every rank.

Being custom ops, ``torch.compile`` puts them in its graphs as opaque calls (dynamo does not
trace into ``torch.distributed``) with a fake implementation for shapes; the split sizes
are Python ints read from the exchanged counts, which is where a compiled MoE layer breaks
its graph (or uses unbacked sizes with ``capture_scalar_outputs``).

Each op posts one ``torch.distributed.all_to_all_single`` on the group and waits for it at
most ``timeout`` seconds, naming the group's ranks when a peer dies or stalls. Inside an
overlapped pair (:mod:`conveyor.runtime.overlap`) the other action computes meanwhile.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group

from conveyor.runtime.overlap import exchange
from conveyor.runtime.transport import guarded, wait_bounded


def _group_text(group_name: str) -> tuple[dist.ProcessGroup, str]:
    group = _resolve_process_group(group_name)  # type: ignore[arg-type]
    ranks = dist.get_process_group_ranks(group)
    return group, f"a rank among {ranks} (the expert-parallel group)"


@torch.library.custom_op("conveyor::all_to_all", mutates_args=())
def _all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str, timeout: float
) -> torch.Tensor:
    group, suspect = _group_text(group_name)
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    send = x.contiguous()

    def start() -> Any:
        return dist.all_to_all_single(out, send, out_splits, in_splits, group=group, async_op=True)

    doing = f"rank {dist.get_rank()}: the all-to-all of tokens to and from their experts"
    _post_and_wait(start, timeout, doing, suspect)
    return out


def _post_and_wait(start: Any, timeout: float, doing: str, suspect: str) -> None:
    """Post the all-to-all and wait at most ``timeout`` seconds; inside an overlapped pair
    the other action computes during the wait (:func:`~conveyor.runtime.overlap.exchange`)."""
    exchange(
        lambda: guarded(start, doing, suspect),
        lambda work: wait_bounded(work, timeout, doing, suspect),
    )


@_all_to_all.register_fake
def _all_to_all_fake(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str, timeout: float
) -> torch.Tensor:
    return x.new_empty((sum(out_splits), *x.shape[1:]))


def _setup(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:  # type: ignore[type-arg]
    _, out_splits, in_splits, group_name, timeout = inputs
    ctx.splits = (list(out_splits), list(in_splits))  # type: ignore[attr-defined]
    ctx.group = (group_name, timeout)  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:  # type: ignore[type-arg]
    out_splits, in_splits = ctx.splits  # type: ignore[attr-defined]
    group_name, timeout = ctx.group  # type: ignore[attr-defined]
    back = _all_to_all(grad.contiguous(), in_splits, out_splits, group_name, timeout)
    return back, None, None, None, None


_all_to_all.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("conveyor::all_to_all_counts", mutates_args=())
def _all_to_all_counts(counts: torch.Tensor, group_name: str, timeout: float) -> torch.Tensor:
    group, suspect = _group_text(group_name)
    out = torch.empty_like(counts)

    def start() -> Any:
        return dist.all_to_all_single(out, counts.contiguous(), group=group, async_op=True)

    doing = f"rank {dist.get_rank()}: exchanging how many tokens go to each expert"
    _post_and_wait(start, timeout, doing, suspect)
    return out


@_all_to_all_counts.register_fake
def _all_to_all_counts_fake(counts: torch.Tensor, group_name: str, timeout: float) -> torch.Tensor:
    return torch.empty_like(counts)


def all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    timeout: float,
) -> torch.Tensor:
    """Send ``x``'s rows to the group's ranks and return those they send here.

    Args:
        x: ``[sum(in_splits), ...]``, the rows for rank 0 first.
        out_splits: rows received from each rank of the group.
        in_splits: rows sent to each rank of the group.
        group: the process group (every member calls this with matching splits).
        timeout: seconds to wait before raising a ``PipelineError`` naming the group.

    Returns:
        ``[sum(out_splits), ...]``; differentiable (the gradient goes back by the reverse
        all-to-all).
    """
    return torch.ops.conveyor.all_to_all(x, out_splits, in_splits, group.group_name, timeout)  # type: ignore[no-any-return]


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup, timeout: float) -> torch.Tensor:
    """Equal-split all-to-all of ``counts`` (e.g. tokens per expert): block ``r`` of
    ``counts`` goes to rank ``r``; returns the blocks received, rank 0's first."""
    return torch.ops.conveyor.all_to_all_counts(counts, group.group_name, timeout)  # type: ignore[no-any-return]
