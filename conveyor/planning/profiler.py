"""Profile a model unit by unit: :func:`profile` and the units it measures (:func:`units`).

The model is cut into its smallest units with the same splitter the pipeline uses
(``split_model(model, n, [1] * n)``: a layer of a layer list, a step of an execution
sequence, a leaf-module call or parameter-reading operation of a traced graph), so a
balance over these units is exactly a ``balance=`` the pipeline accepts. Each unit runs on
one real micro-batch chained from the previous unit's output
(:func:`conveyor.planning.timing.measure_unit`); in a distributed world every rank
profiles at once and all take the mean.

A model on the meta device (:func:`conveyor.empty_weights`) is never made real: each unit
in turn is copied, given values on the device as a pipeline stage would be, timed on the
previous unit's output, and released (:mod:`conveyor.planning.meta`), so profiling holds
one unit's parameters and one micro-batch's activations at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.errors import ConfigError
from conveyor.partition import split_model
from conveyor.partition.annotations import stage_marks, stage_of
from conveyor.partition.execution import ExecutionSequence
from conveyor.partition.sequential import layers_of, split_sequential
from conveyor.planning.costs import Costs, UnitCost, mean_layers
from conveyor.planning.link import DEFAULT_BANDWIDTH, DEFAULT_LATENCY, measure_link_speed
from conveyor.planning.meta import RealUnits, is_meta, profiling_device, release
from conveyor.planning.timing import Clock, LossFn, measure_unit, own_loss
from conveyor.runtime import microbatch
from conveyor.weights import Weights

# Engine bookkeeping per F/B action (tensor wrapping, pytree walks, the send/receive
# calls themselves), measured on CPU/gloo as (measured step - simulated step) / actions
# of 1F1B on the benchmark model; ``benchmarks/plan_accuracy.py`` re-checks it.
ACTION_OVERHEAD = 60e-6

_ANNOTATED = (
    "the model has pipeline_stage annotations, which fix its split; remove them to let "
    "the planner choose the balance, or pass a schedule by name"
)


def units(model: nn.Module | Sequence[nn.Module], sample: Any = None) -> list[nn.Module]:
    """The model cut into the units ``balance=`` counts, one module each.

    Args:
        model: A module, a layer list or an execution sequence.
        sample: One micro-batch of input, for a model captured with torch.export.

    Returns:
        One module per unit, in model order.

    Raises:
        ConfigError: The model has ``pipeline_stage`` annotations (they fix the split;
            there is nothing to plan) and is not a layer list.
    """
    if isinstance(model, ExecutionSequence):
        if _annotated(model):
            raise ConfigError(_ANNOTATED)
        n = len(model.steps)
    elif isinstance(model, nn.Module) and not isinstance(model, (nn.Sequential, nn.ModuleList)):
        if _annotated(model):
            raise ConfigError(_ANNOTATED)
        from conveyor.partition.graph import layer_count

        n = layer_count(model, sample)
    else:
        # Layer lists: cut directly so annotations on layers do not get in the way.
        n = len(layers_of(model))
        return list(split_sequential(model, n, [1] * n))
    return split_model(model, n, [1] * n, sample)


def profile(
    model: nn.Module | Sequence[nn.Module],
    inputs: Any,
    targets: Any,
    loss_fn: LossFn | None,
    microbatches: int,
    *,
    repeats: int = 5,
    warmup: int = 2,
    measure_link: bool = True,
    device: torch.device | str | None = None,
    init_seed: int = 0,
    weights: Weights = None,
) -> Costs:
    """Measure every unit of ``model`` on the first of ``microbatches`` micro-batches.

    In a distributed world this is a collective: every rank profiles at the same time and
    all get the mean over ranks, and the link between ranks 0 and 1 is measured by
    ping-pong (with ``measure_link``); otherwise the link gets
    :data:`~conveyor.planning.link.DEFAULT_LATENCY` and
    :data:`~conveyor.planning.link.DEFAULT_BANDWIDTH`. Gradients already in ``.grad`` are
    left as they were.

    Args:
        model: A module, a layer list or an execution sequence.
        inputs: A whole batch, as for ``Pipeline.train_step``.
        targets: Its targets (None with ``loss_fn=None``).
        loss_fn: ``loss_fn(output, targets)``, charged to the last unit; None: the loss
            the model computes itself (read from its output, as ``Pipeline(loss_fn=None)``
            reads it).
        microbatches: Into how many micro-batches the batch is cut.
        repeats: Timed runs per unit; the median is kept.
        warmup: Untimed runs per unit before them.
        measure_link: Whether to measure the link (in a world of two or more ranks).
        device: Where a model on the meta device is timed (default: this process's GPU,
            else the CPU); a real model is timed where its parameters are.
        init_seed: For a meta model: the seed its units are initialized with, as
            ``Pipeline(init_seed=)``.
        weights: For a meta model: a checkpoint its units are read from instead, as
            ``Pipeline(weights=)``.

    Returns:
        The per-unit measurements and the link.

    Raises:
        ConfigError: ``repeats < 1`` or ``warmup < 0``, or the model cannot be cut into
            units (see :func:`units`).
    """
    distributed = dist.is_available() and dist.is_initialized()
    latency, bandwidth = DEFAULT_LATENCY, DEFAULT_BANDWIDTH
    if distributed and measure_link and dist.get_world_size() > 1:
        latency, bandwidth = measure_link_speed()
    meta = (device, init_seed, weights)
    layers = _profile_units(model, inputs, targets, loss_fn, microbatches, repeats, warmup, meta)
    if distributed:
        # Every rank profiles at once, as they compute at once in the pipeline: on shared
        # cores or memory bandwidth a unit is slower then than alone. All ranks take the
        # mean over ranks, so they agree on the numbers and plan the same.
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, layers)
        layers = mean_layers(gathered)
    size = microbatch.batch_size(inputs, "inputs")
    return Costs(
        layers, microbatches, -(-size // microbatches), latency, bandwidth, ACTION_OVERHEAD
    )


def _profile_units(
    model: nn.Module | Sequence[nn.Module],
    inputs: Any,
    targets: Any,
    loss_fn: LossFn | None,
    microbatches: int,
    repeats: int,
    warmup: int,
    meta: tuple[torch.device | str | None, int, Weights],
) -> tuple[UnitCost, ...]:
    if repeats < 1 or warmup < 0:
        raise ConfigError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    real: RealUnits | None = None
    if is_meta(model):
        where, init_seed, weights = meta
        device = profiling_device(where)
        real = RealUnits(model, device, init_seed, weights)
    else:
        device = next((p.device for p in _parameters(model)), torch.device("cpu"))
    clock = Clock(device)
    value = microbatch.to_device(microbatch.first(inputs, microbatches, "inputs"), device)
    parts = units(model, value)
    target = (
        None
        if targets is None
        else microbatch.to_device(microbatch.first(targets, microbatches, "targets"), device)
    )
    last_loss = loss_fn if loss_fn is not None else own_loss
    out: list[UnitCost] = []
    for i, unit in enumerate(parts):
        last = i == len(parts) - 1
        timed = real.real(unit) if real is not None else unit
        layer, value = measure_unit(
            i, timed, value, target, last_loss if last else None, repeats, warmup, clock
        )
        if real is not None:
            release(timed)  # before the next unit is made real
        del timed
        out.append(layer)
    return tuple(out)


def _annotated(model: nn.Module | Sequence[nn.Module]) -> bool:
    if isinstance(model, ExecutionSequence):
        return bool(stage_marks(model.__dict__["source"]))
    if isinstance(model, nn.Module):
        return any(stage_of(m) is not None for m in model.modules())
    return any(stage_of(m) is not None for layer in model for m in layer.modules())


def _parameters(model: nn.Module | Sequence[nn.Module]) -> list[nn.Parameter]:
    if isinstance(model, nn.Module):
        return list(model.parameters())
    return [p for layer in model for p in layer.parameters()]


__all__ = ["ACTION_OVERHEAD", "profile", "units"]
