"""How micro-batch and replica losses combine into the step's loss: the one place.

A ``loss_fn`` returns either a scalar, the mean over the micro-batch's rows, or a pair
``(total, count)``: the micro-batch's summed loss and how many items it summed (e.g. the
tokens that are not ``ignore_index``). Both are read as a pair: a scalar ``L`` over ``n``
rows is ``(L * n, n)``. The step's loss is ``sum(total) / sum(count)`` over every
micro-batch of every data-parallel replica, and the gradients are that loss's.

The arithmetic, in two halves that together make the division exact:

- Before each backward, a micro-batch's ``total`` is multiplied by :func:`loss_scale`:
  ``1 / rows``, the rows of the whole (global) batch, known from the batch at step start
  (times the replicas under FSDP, whose reduction averages where the others sum).
- After the step, the rank holding the last stage sends the summed totals, counts and
  rows (:func:`pack`) to every pipeline rank, and replicas add theirs up
  (:func:`sum_over_replicas`); the step's gradients are then multiplied by
  ``rows / count``. For a scalar loss count is rows, so that is exactly 1 and nothing
  runs; for a pair it turns the division by rows into the division by the count.

Counts are integers summed on the device (no host sync per micro-batch); the one host sync
of a step is :func:`combine`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from conveyor.context import Context
from conveyor.errors import ConfigError, PipelineError
from conveyor.losses import output_field
from conveyor.runtime.transport import collective


class LossTerm(NamedTuple):
    """One micro-batch's loss as a pair: its total, ``value * weight`` (``value``
    differentiable, float32 or wider; ``weight`` the rows of a mean over rows, the count
    of a model's token mean, 1 for a total), and ``items``, its count (an integer tensor,
    or a Python int). The total stays a product until it is used: one multiplication in
    the graph per micro-batch, not two."""

    value: torch.Tensor
    weight: int
    items: torch.Tensor | int
    pair: bool  # the loss_fn returned a pair (else a scalar weighted by rows)

    def root(self, scale: float) -> torch.Tensor:
        """What the micro-batch's backward starts from: its total times ``scale``."""
        return self.value * (self.weight * scale)

    def plus(self, other: LossTerm) -> LossTerm:
        """One term of this one and ``other``: their totals and their counts summed (the
        kind, pair or scalar, this one's)."""
        total = self.value * self.weight + other.value * other.weight
        return LossTerm(total, 1, self.items + other.items, self.pair)


def as_term(result: Any, rows: int) -> LossTerm:
    """A ``loss_fn`` (or model) result for a micro-batch of ``rows`` rows, as a pair.

    Raises:
        PipelineError: neither a scalar tensor nor a pair ``(total, count)`` with a scalar
            total and an integer count.
    """
    if isinstance(result, tuple):
        if len(result) != 2:
            raise PipelineError(
                f"loss_fn returned a tuple of {len(result)}; return a scalar (the mean over "
                f"the micro-batch's rows) or a pair (total, count)"
            )
        total, count = result
        _check_scalar(total, "the total of loss_fn's pair (total, count) must be a scalar tensor")
        if isinstance(count, torch.Tensor):
            if count.numel() != 1 or count.dtype.is_floating_point or count.is_complex():
                raise PipelineError(
                    f"the count of loss_fn's pair (total, count) must be an integer, got a "
                    f"{count.dtype} tensor of shape {tuple(count.shape)}; count items with an "
                    f"integer tensor, e.g. (labels != ignore_index).sum()"
                )
            count = count.reshape(())
        elif isinstance(count, bool) or not isinstance(count, int):
            raise PipelineError(
                f"the count of loss_fn's pair (total, count) must be an integer, got "
                f"{count!r}; count items with an int or an integer tensor, e.g. "
                f"(labels != ignore_index).sum()"
            )
        return LossTerm(_wide(total.reshape(())), 1, count, True)
    _check_scalar(
        result,
        "loss_fn must return a scalar tensor (the mean loss of the micro-batch) or a pair "
        "(total, count)",
    )
    return LossTerm(_wide(result.reshape(())), rows, rows, False)


def counted_term(mean: torch.Tensor, count: int) -> LossTerm:
    """A model's own loss averaged over ``count`` tokens (transformers' token losses), as
    a pair. A micro-batch without a counted token (its mean is NaN) adds nothing."""
    _check_scalar(mean, "the model's loss must be a scalar tensor")
    return LossTerm(torch.nan_to_num(_wide(mean.reshape(())), nan=0.0), count, count, True)


@dataclass(frozen=True)
class RouterLoss:
    """A transformers MoE model's router auxiliary loss in the step's loss
    (``output_router_logits=True``, ``loss_fn=None``): the one place its term is written,
    for every stage ends. Each micro-batch's ``aux_loss`` (an output field of the last
    stage) counts ``coef`` times over the step's count per micro-batch
    (:func:`router_weight`), so that the step's loss is the whole batch's token loss plus
    ``coef`` times the mean of the micro-batches' auxiliary losses."""

    coef: float

    def term(self, out: Any, aux_weight: float | None, counted: int = 0) -> LossTerm | None:
        """The term of the micro-batch whose last stage returned ``out`` (None: ``out``
        has no ``aux_loss``, or the step weighs none: ``aux_weight`` None). ``counted``:
        the weight the micro-batch's own loss already holds ``coef * aux`` at (a model's
        token mean adds it: its count), taken out here. A total, without items."""
        aux = output_field(out, "aux_loss")
        if aux is None or aux_weight is None:
            return None
        return LossTerm(_wide(aux.reshape(())) * (self.coef * (aux_weight - counted)), 1, 0, True)


def router_weight(counts: tuple[int, ...], ctx: Context, count: float | None = None) -> float:
    """What a micro-batch's router auxiliary loss is weighted by in the step's total (see
    :class:`RouterLoss`): the step's token count (``count`` if given, else the counts summed
    over the data-parallel replicas) over its micro-batches (every replica's). One
    collective over the replicas where there are some."""
    sums = torch.tensor([sum(counts), len(counts)], dtype=torch.int64, device=ctx.device)
    if ctx.distributed and ctx.replicas > 1:
        collective(
            lambda: dist.all_reduce(sums, group=ctx.replica_group, async_op=True),
            ctx.timeout,
            f"rank {ctx.rank}: exchanging the replicas' token counts (router auxiliary loss)",
            "another replica",
        )
    summed, microbatches = (int(v) for v in sums.tolist())
    return (summed if count is None else float(count)) / microbatches


def _check_scalar(value: Any, rule: str) -> None:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise PipelineError(f"{rule}, got {got}")


def _wide(loss: torch.Tensor) -> torch.Tensor:
    """A loss computed in a half type (autocast), in float32: micro-batch totals add up."""
    return loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss


class StepLoss:
    """The sums over this process's micro-batches of a step: total, count and rows."""

    def __init__(self) -> None:
        self.count: torch.Tensor | int = 0
        self.rows = 0
        self.pair: bool | None = None
        # Detached values and weights of the totals, summed once when read.
        self._values: list[torch.Tensor] = []
        self._weights: list[int] = []

    @property
    def total(self) -> torch.Tensor | None:
        """The summed totals (float64), None before the first micro-batch."""
        if not self._values:
            return None
        values = self._values
        if len({v.dtype for v in values}) > 1:
            values = [v.to(torch.float64) for v in values]
        weights = torch.tensor(self._weights, dtype=torch.float64, device=values[0].device)
        return torch.stack(values).to(torch.float64) @ weights

    def add(self, term: LossTerm, rows: int) -> None:
        """Add one micro-batch's term (detached).

        Raises:
            PipelineError: a pair on some micro-batches and a scalar on others.
        """
        if self.pair is not None and term.pair != self.pair:
            raise PipelineError(
                "loss_fn returned a pair (total, count) on some micro-batches and a scalar "
                "on others; return the same kind for every micro-batch"
            )
        self.pair = term.pair
        self._values.append(term.value.detach())
        self._weights.append(term.weight)
        self.count = self.count + term.items
        self.rows += rows


def loss_scale(rows: int, fsdp_replicas: int = 1) -> float:
    """What each micro-batch's total is multiplied by before its backward: one over the
    global batch's ``rows``, times the replicas FSDP's averaging divides by."""
    return fsdp_replicas / rows


def global_rows(rows: int, ctx: Context) -> int:
    """The rows of the global batch, from this replica's ``rows``: with replicas
    (``dp_size > 1``) a sum over the data-parallel group that every rank posts at the
    start of the step; without, ``rows`` itself.

    Raises:
        PipelineError: a replica with an empty shard.
    """
    if not ctx.distributed or ctx.replicas == 1:
        return rows
    sizes = torch.zeros(ctx.replicas, dtype=torch.int64, device=ctx.device)
    sizes[ctx.replica_rank] = rows
    collective(
        lambda: dist.all_reduce(sizes, group=ctx.replica_group, async_op=True),
        ctx.timeout,
        f"rank {ctx.rank}: exchanging the replicas' batch sizes",
        "another replica",
    )
    counts = [int(c) for c in sizes.tolist()]
    if min(counts) <= 0:
        raise PipelineError(
            f"rank {ctx.rank}: replica batch sizes {counts}; every replica needs a non-empty shard"
        )
    return sum(counts)


def pack(local: StepLoss | None, device: torch.device) -> torch.Tensor:
    """This process's loss sums as one float64 tensor ``[total, count, rows, pair]``
    (zeros where no last stage is held, or before its first micro-batch): what the rank
    holding the last stage sends to the other pipeline ranks at the end of a step."""
    buf = torch.zeros(4, dtype=torch.float64, device=device)
    total = local.total if local is not None else None
    if local is not None and total is not None:
        buf[0] = total
        buf[1] = local.count
        buf[2] = local.rows
        buf[3] = float(bool(local.pair))
    return buf


def sum_over_replicas(sums: torch.Tensor, ctx: Context) -> None:
    """Add up the replicas' :func:`pack` ed sums in place: a collective over the
    data-parallel group, posted by every rank after the step's actions."""
    collective(
        lambda: dist.all_reduce(sums, group=ctx.replica_group, async_op=True),
        ctx.timeout,
        f"rank {ctx.rank}: combining the replicas' losses",
        "another replica",
    )


class Combined(NamedTuple):
    """The step's loss on every rank, the factor its gradients still need, and whether a
    micro-batch of any replica returned a pair."""

    loss: torch.Tensor
    gradient_factor: float
    pair: bool


def combine(sums: torch.Tensor, count: float | None = None) -> Combined:
    """The step's loss, ``sum(total) / sum(count)`` over micro-batches and replicas, and
    ``rows / count``, what the step's gradients (scaled by one over the rows before each
    backward) must still be multiplied by; ``sums`` as :func:`pack` makes them, summed
    over the replicas. ``count``, if given, divides instead of the summed count (e.g. the
    items of every batch one optimizer step accumulates).

    Raises:
        ConfigError: the count is 0 (nothing to average over), on every rank.
    """
    total, summed, rows, pair = sums.tolist()  # the step's one host sync
    divisor = summed if count is None else float(count)
    if divisor <= 0:
        raise ConfigError(
            f"the step's loss divides by a count of {divisor:g}: no item to average over "
            f"(every target is ignore_index?); give batches with at least one counted item"
            if count is None
            else f"count must be > 0, got {count!r}"
        )
    loss = torch.tensor(total / divisor, dtype=torch.float32, device=sums.device)
    return Combined(loss, rows / divisor, pair > 0)
