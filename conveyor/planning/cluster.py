"""Step time and memory per GPU of a layout on hardware nobody has to own: :func:`estimate`.

Nothing runs on the hardware. The model is counted once on the meta device
(:mod:`~conveyor.planning.counting`) and its parts become units that cost what their
operations take on the hardware (:mod:`~conveyor.planning.counted`); then the one
prediction (:mod:`~conveyor.planning.prediction`) runs: the units cut into the layout's
stages (its ``balance``, else by time), the schedule simulated, the gradient reduction
and optimizer step after it, and the memory of every rank
(:mod:`~conveyor.planning.memory`), exactly as the planner of ``schedule="auto"`` predicts
measured units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.errors import ConfigError
from conveyor.planning.costs import Costs
from conveyor.planning.counted import CountedSync, counted_costs, tp_buffer
from conveyor.planning.counting import count_model
from conveyor.planning.devices import Hardware, hardware
from conveyor.planning.layout import Layout
from conveyor.planning.memory import w_share
from conveyor.planning.model_count import ModelCount
from conveyor.planning.prediction import predict, time_balance
from conveyor.schedules import Schedule, get_schedule, zero_bubble_auto
from conveyor.schedules.simulation import W_MEMORY
from conveyor.simulate import SimResult

GB = 1e9


@dataclass(frozen=True)
class Estimate:
    """What a layout needs and does on the hardware, predicted.

    Attributes:
        step_s: Seconds per training step (one global batch).
        tokens_per_s_per_gpu: Tokens trained per second per GPU.
        tflops_per_gpu: TFLOP/s each GPU executes, counting a recomputed forward (the
            figure Megatron reports).
        mfu: Model FLOPs utilization: the model's FLOPs (3 x forward, without recompute)
            per second per GPU over the peak.
        bubble: The simulated pipeline's idle share (:attr:`conveyor.simulate.SimResult.bubble`).
        memory_gb: The largest memory of any rank, GB.
        memory_parts: Per pipeline rank, GB by kind (:data:`MEMORY_KINDS`).
        layout: The layout.
        hardware: The hardware.
        balance: Decoder layers per stage.
        stage_times: Per stage, (F, B, W) seconds of one micro-batch.
        sync_s: Seconds after the pipeline: gradient reduction and optimizer step.
    """

    step_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: float
    bubble: float
    memory_gb: float
    memory_parts: tuple[dict[str, float], ...]
    layout: Layout
    hardware: Hardware
    balance: tuple[int, ...]
    stage_times: tuple[tuple[float, float, float], ...]
    sync_s: float

    def fits(self, limit_gb: float | None = None) -> bool:
        """Whether every rank fits ``limit_gb`` (default: the GPU's memory)."""
        return self.memory_gb <= (self.hardware.hbm_gb if limit_gb is None else limit_gb)


MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations", "buffers")
"""The keys of :attr:`Estimate.memory_parts`' entries."""


def estimate(model: Any, *, hardware: str | Hardware, layout: Layout) -> Estimate:
    """Predict step time and memory per GPU of ``layout`` on ``hardware``.

    Args:
        model: A transformers config of a causal language model, or such a model built
            under :func:`conveyor.empty_weights`.
        hardware: A preset's name (``"a100-80g"``, ``"h100-sxm"``, ``"h200"``) or a
            :class:`~conveyor.planning.devices.Hardware`.
        layout: The :class:`~conveyor.planning.layout.Layout`.

    Returns:
        The :class:`Estimate`.

    Raises:
        ConfigError: For an unknown hardware name, a model that cannot be counted, more
            stages than decoder layers + 2, a ``balance`` that does not add up to the
            layers, or a schedule that cannot run the layout's micro-batches.
    """
    counted = count_model(model, layout.seq, layout.dtype, layout.attention)
    return predict_layout(counted, _hardware(hardware), layout)


_hardware = hardware


def predict_layout(
    counted: ModelCount,
    hw: Hardware,
    layout: Layout,
    schedule: Schedule | None = None,
    sims: dict[object, SimResult] | None = None,
    costs: Costs | None = None,
) -> Estimate:
    """:func:`estimate` on a model already counted at the layout's ``seq``, ``dtype`` and
    ``attention`` (``schedule``: the layout's, already built; ``sims``: simulations to
    share, :func:`~conveyor.planning.prediction.predict`; ``costs``: its units, already
    :func:`~conveyor.planning.counted.counted_costs`)."""
    _check(counted, layout)
    if costs is None:
        costs = counted_costs(counted, hw, layout)
    balance = unit_balance(layout, len(counted.layers), costs.times(True))
    if schedule is None:
        schedule = layout_schedule(
            layout, costs.costs(balance, True), costs.comm(balance), w_share(costs.parts(balance))
        )
    setting = layout.setting(tp_buffer(counted, layout))
    got = predict(schedule, costs, balance, setting, CountedSync(hw, layout), sims)
    step = got.step
    tokens = layout.global_batch * layout.seq
    whole, layers_only = counted.forward_flops
    forward = whole * layout.global_batch
    # Recompute runs the decoder layers' forward again (not the embeddings' or the head's).
    executed = 3 * forward + (layers_only * layout.global_batch if layout.recompute else 0.0)
    gpus = layout.gpus
    return Estimate(
        step_s=step,
        tokens_per_s_per_gpu=tokens / step / gpus,
        tflops_per_gpu=executed / step / gpus / 1e12,
        mfu=3 * forward / step / gpus / (hw.peak_tflops * 1e12),
        bubble=got.sim.bubble,
        memory_gb=max(got.peak) / GB,
        memory_parts=tuple({k: v / GB for k, v in m.items()} for m in got.memory),
        layout=layout,
        hardware=hw,
        balance=(balance[0] - 1, *balance[1:-1], balance[-1] - 1),
        stage_times=got.costs,
        sync_s=got.tail,
    )


def _check(counted: ModelCount, layout: Layout) -> None:
    if not counted.tp_divides_heads(layout.tp):
        splits = [t for t in range(1, counted.heads + 1) if counted.tp_divides_heads(t)]
        raise ConfigError(
            f"tp={layout.tp} cannot split the model's {counted.heads} attention heads "
            f"({counted.kv_heads} key/value heads) evenly; use a tp among "
            f"{', '.join(map(str, splits))}"
        )
    stages = layout.pp * layout.chunks
    layers = len(counted.layers)
    if stages > layers + 2:
        raise ConfigError(
            f"{layout.pp} pipeline ranks x {layout.chunks} chunks = {stages} stages, but the "
            f"model has {layers} decoder layers (and its embeddings and head); use at most "
            f"{layers + 2} stages"
        )


def unit_balance(layout: Layout, layers: int, times: Sequence[float]) -> list[int]:
    """Units per stage (the embeddings, each decoder layer and the head are one unit each)
    for the layout's ``balance``: the layers it gives with the embeddings on the first
    stage and the head on the last, a named split (:data:`~conveyor.planning.layout.SPLITS`),
    or the units' time balanced (``times``).

    Raises:
        ConfigError: A ``balance`` that does not add up to the model's layers, or leaves
            a middle stage without one.
    """
    stages = layout.pp * layout.chunks
    given = layout.balance
    if given is None:
        return time_balance(times, stages)
    if given == "even":
        base, extra = divmod(layers, stages)
        sizes = [base] * stages
        for s in sorted(range(stages), key=lambda s: abs(s - (stages - 1) / 2))[:extra]:
            sizes[s] += 1
    elif given == "ends":
        base, extra = divmod(layers + 2, stages)
        sizes = [base] * stages
        order = sorted(
            range(stages), key=lambda s: (s in (0, stages - 1), abs(s - (stages - 1) / 2))
        )
        for s in order[:extra]:
            sizes[s] += 1
        sizes[0] -= 1
        sizes[-1] -= 1
    else:
        assert not isinstance(given, str)  # Layout checked it is a named split or numbers
        sizes = list(given)
        if sum(sizes) != layers or (stages > 2 and min(sizes[1:-1]) < 1):
            raise ConfigError(
                f"Layout balance {sizes} must add up to the model's {layers} decoder layers "
                "and give every middle stage at least one"
            )
    units = list(sizes)
    units[0] += 1
    units[-1] += 1
    if min(units) < 1:
        raise ConfigError(f"the split {sizes} leaves a stage without a layer; use fewer stages")
    return units


def layout_schedule(
    layout: Layout,
    costs: list[tuple[float, float, float]],
    comm: float,
    w_memory: float = W_MEMORY,
) -> Schedule:
    """The layout's schedule (``zb-auto`` fitted to the stage costs and the share of a
    micro-batch's activations held from B until W)."""
    m = layout.microbatches
    if layout.schedule == "zb-auto":
        return zero_bubble_auto(
            layout.pp, m, costs, layout.microbatch_cap, comm, layout.chunks, w_memory=w_memory
        )
    return get_schedule(layout.schedule, layout.pp, m, layout.chunks)


__all__ = ["MEMORY_KINDS", "Estimate", "estimate", "layout_schedule", "predict_layout"]
