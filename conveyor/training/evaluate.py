"""Evaluation: outputs on the last stage, metrics there, the values on every rank."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from conveyor.errors import ConfigError
from conveyor.losses import output_field
from conveyor.pipeline import Pipeline
from conveyor.training.data import Batches

Metric = Callable[[Any, Any], Any]


def logits_of(output: Any) -> torch.Tensor:
    """The prediction tensor of a model's output: ``output.logits``, ``output["logits"]``,
    the first element of a tuple, or the output itself."""
    if isinstance(output, torch.Tensor):
        return output
    found = output_field(output, "logits")
    if found is not None:
        return found
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ConfigError(
        f"cannot find the predictions in a {type(output).__name__} output; give a metric "
        f"function (output, targets) -> number that reads them"
    )


def accuracy(output: Any, targets: Any) -> torch.Tensor:
    """The share of samples whose largest output is the target class.

    Args:
        output: Class scores ``(batch, classes)`` (or an output with ``.logits``).
        targets: Class indices ``(batch,)``.

    Returns:
        The accuracy, a scalar tensor in [0, 1].
    """
    scores = logits_of(output)
    right: torch.Tensor = scores.argmax(dim=-1) == torch.as_tensor(targets, device=scores.device)
    return right.float().mean()


BUILTIN: dict[str, Metric] = {"accuracy": accuracy}


def resolve(metrics: Mapping[str, Metric | str] | Sequence[str] | None) -> dict[str, Metric]:
    """``fit(metrics=...)`` as ``{name: function}``.

    Args:
        metrics: ``None``, ``{name: function or built-in name}``, or built-in names.

    Returns:
        The metric functions by name.

    Raises:
        ConfigError: An unknown built-in name, a value that is not a function, or the
            reserved name ``loss`` / ``step``.
    """
    if metrics is None:
        return {}
    if isinstance(metrics, str):
        metrics = [metrics]
    items = list(metrics.items()) if isinstance(metrics, Mapping) else [(n, n) for n in metrics]
    out: dict[str, Metric] = {}
    for name, fn in items:
        if name in ("loss", "step"):
            raise ConfigError(
                f"metric name {name!r} is taken (every evaluation reports the loss and the "
                f"step); call your metric something else"
            )
        if isinstance(fn, str):
            if fn not in BUILTIN:
                raise ConfigError(
                    f"unknown metric {fn!r}; use one of {sorted(BUILTIN)} or pass a function "
                    f"(output, targets) -> number, e.g. metrics={{'f1': my_f1}}"
                )
            fn = BUILTIN[fn]
        if not callable(fn):
            raise ConfigError(
                f"metric {name!r} must be a function (output, targets) -> number or a "
                f"built-in name ({sorted(BUILTIN)}), got {type(fn).__name__}"
            )
        out[str(name)] = fn
    return out


def _loss(pipe: Pipeline, output: Any, targets: Any, size: int) -> tuple[float, float]:
    """The batch's loss from its output on the last stage, as (total, count): a pair
    ``loss_fn`` gives them, a scalar mean counts the rows (``size``)."""
    if pipe.loss_fn is not None:
        result = pipe.loss_fn(output, targets)
        if isinstance(result, tuple):  # (total, count): token-weighted over the whole set
            total, count = result
            return float(total), float(count)
        return float(result) * size, float(size)
    loss = output if isinstance(output, torch.Tensor) and output.dim() == 0 else None
    if loss is None:
        loss = output_field(output, "loss")
    if loss is None:
        return float("nan"), float(size)
    if loss.dim() == 0:
        return float(loss) * size, float(size)
    # One loss per micro-batch: weigh each by its rows, as train_step weighs a mean.
    parts = torch.tensor([len(p) for p in torch.tensor_split(torch.arange(size), len(loss))])
    return float((loss.detach().double().cpu() * parts).sum()), float(size)


@contextlib.contextmanager
def evaluation_mode(pipe: Pipeline) -> Iterator[None]:
    """Dropout and batch norm in evaluation mode, then back as they were."""
    was = pipe.training
    pipe.eval()
    try:
        yield
    finally:
        pipe.train(was)


def evaluate(pipe: Pipeline, batches: Batches, metrics: dict[str, Metric]) -> dict[str, float]:
    """Run ``batches`` through ``pipe`` and compute the loss and ``metrics``.

    Outputs exist on the rank holding the last stage (of each replica); there each metric is
    averaged over the samples and the loss as ``train_step`` combines it (a pair loss's
    totals over its counts, a mean weighted by rows), then one all-reduce over the world
    gives every rank the values over the whole evaluation data.

    Args:
        pipe: The pipeline.
        batches: The evaluation batches (``evaluating=True``).
        metrics: Metric functions by name.

    Returns:
        ``{"loss": ..., name: ...}``, the same on every rank.
    """
    ctx = pipe.context
    # [samples, loss total, loss count, metric sums...]
    sums = torch.zeros(3 + len(metrics), dtype=torch.float64)
    with evaluation_mode(pipe):
        for inputs, targets, _ in batches.epoch(0):
            output = pipe.predict(inputs)
            if output is None:
                continue
            truth = targets if targets is not None else inputs
            size = len(logits_of(output)) if truth is None else _batch_size(truth)
            total, count = _loss(pipe, output, targets, size)
            values = [float(fn(output, truth)) for fn in metrics.values()]
            sums[0] += size
            sums[1] += total
            sums[2] += count
            sums[3:] += torch.tensor(values, dtype=torch.float64) * size
    if ctx.distributed:
        if ctx.tp_rank != 0:  # tensor-parallel ranks of the last stage hold the same outputs
            sums.zero_()
        buf = sums.to(ctx.device)
        dist.all_reduce(buf)
        sums = buf.cpu()
    samples, counted = float(sums[0]), float(sums[2])
    out = {"loss": float(sums[1]) / counted if counted else float("nan")}
    for i, name in enumerate(metrics):
        out[name] = float(sums[i + 3]) / samples if samples else float("nan")
    return out


def _batch_size(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0])
    if isinstance(value, Mapping):
        return _batch_size(next(iter(value.values())))
    if isinstance(value, (tuple, list)):
        return _batch_size(value[0])
    raise ConfigError(f"cannot count the samples of a {type(value).__name__} batch")
