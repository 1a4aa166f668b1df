"""Every layout of a model on a cluster, predicted and ranked: :func:`rank_layouts`.

The layouts are every product ``pp * tp * cp * dp = gpus`` with tensor parallelism inside
a node (a power of two dividing the attention heads and the key/value heads), context
parallelism of 1, 2, 4 or 8 ranks (each sequence cut into ``2 * cp`` equal chunks),
expert parallelism over the data-parallel ranks (a divisor of both ``dp`` and the expert
count), FSDP gathered once per step, resharded after every use (schedules that do not
split the backward) or none, each pipeline schedule of :data:`SCHEDULES`, micro-batches of
1 to 8 sequences and recompute or not: what conveyor's runtime runs. The model is counted
once; schedules built once for every layout that runs them, and a simulation is shared by
the layouts that differ only in what it does not see (FSDP's tail, say)
(:func:`~conveyor.planning.cluster.predict_layout`). Layouts that fit the memory limit
come first, fastest (tokens per second per GPU) first; those over it follow, marked.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from conveyor.errors import ConfigError
from conveyor.planning.cluster import Estimate, layout_schedule, predict_layout
from conveyor.planning.costs import Costs
from conveyor.planning.counted import counted_costs
from conveyor.planning.counting import count_model
from conveyor.planning.devices import Hardware, hardware
from conveyor.planning.layout import Layout
from conveyor.planning.memory import w_share
from conveyor.planning.model_count import ModelCount
from conveyor.schedules import Schedule
from conveyor.simulate import SimResult

SCHEDULES: tuple[tuple[str, int], ...] = (
    ("1f1b", 1),
    ("interleaved-1f1b", 2),
    ("zb-h1", 1),
    ("zb-h2", 1),
    ("zbv", 2),
)
"""(schedule, chunks) tried for every pipeline of 2 ranks or more (one rank runs ``1f1b``)."""

MICROBATCH_SIZES = (1, 2, 4, 8)
CONTEXT_PARALLEL = (1, 2, 4, 8)


@dataclass(frozen=True)
class Ranked:
    """One layout, predicted: its :class:`~conveyor.planning.cluster.Estimate` and whether
    every rank fits the limit."""

    estimate: Estimate
    fits: bool

    @property
    def layout(self) -> Layout:
        """The layout."""
        return self.estimate.layout


def rank_layouts(
    model: Any,
    *,
    hardware: str | Hardware,
    gpus: int,
    seq: int,
    global_batch: int,
    memory_limit_gb: float | None = None,
    dtype: str = "bf16",
) -> list[Ranked]:
    """Every valid layout of ``model`` on ``gpus`` GPUs, ranked (see the module docstring).

    Args:
        model: A transformers config or a model built under :func:`conveyor.empty_weights`.
        hardware: A preset's name or a :class:`~conveyor.planning.devices.Hardware`.
        gpus: GPUs in the cluster.
        seq: Tokens per sequence.
        global_batch: Sequences per step.
        memory_limit_gb: The most memory a GPU may use; default: its HBM.
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``.

    Returns:
        The layouts: those that fit first, each group fastest first.

    Raises:
        ConfigError: For sizes below 1, or when no layout of ``gpus`` can take
            ``global_batch`` (e.g. fewer sequences than data-parallel replicas).
    """
    for name, value in (("gpus", gpus), ("seq", seq), ("global_batch", global_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    hw = _hardware(hardware)
    limit = hw.hbm_gb if memory_limit_gb is None else memory_limit_gb
    if not limit > 0:
        raise ConfigError(f"the memory limit must be a number of GB > 0, got {limit!r}")
    counted = count_model(model, seq, dtype)
    search = _Search(counted, hw)
    ranked = [
        Ranked(est, est.fits(limit))
        for layout in layouts(counted, hw, gpus, seq, global_batch, dtype)
        if (est := search.predict(layout)) is not None
    ]
    if not ranked:
        raise ConfigError(
            f"no layout of {gpus} GPUs can run a global batch of {global_batch} sequences of "
            f"this model; use a global batch that a divisor of {gpus} divides"
        )
    ranked.sort(key=lambda r: (not r.fits, -r.estimate.tokens_per_s_per_gpu))
    return ranked


_hardware = hardware


class _Search:
    """Predicts layouts of one count, sharing schedules and simulations among them."""

    def __init__(self, counted: ModelCount, hw: Hardware) -> None:
        self.counted, self.hw = counted, hw
        self.schedules: dict[tuple[str, int, int, int, float], Schedule | None] = {}
        self.sims: dict[object, SimResult] = {}
        self.costs: dict[tuple[object, ...], Costs] = {}

    def predict(self, layout: Layout) -> Estimate | None:
        # Within one search the units' costs depend on these alone (not on the schedule,
        # recompute or FSDP gathered once per step): costed once for the layouts alike.
        shape = (layout.pp, layout.tp, layout.cp, layout.dp, layout.ep, layout.microbatch_size)
        alike = (*shape, layout.microbatches, layout.fsdp == "reshard")
        try:
            if alike not in self.costs:
                self.costs[alike] = counted_costs(self.counted, self.hw, layout)
        except ConfigError:  # a tp or cp that splits no heads evenly
            return None
        costs = self.costs[alike]
        # zb-auto fitted to what the model holds from B until W (uniform costs: shared)
        share = round(w_share([list(costs.layers)]), 2) if layout.schedule == "zb-auto" else 1.0
        key = (layout.schedule, layout.pp, layout.microbatches, layout.chunks, share)
        if key not in self.schedules:
            try:
                self.schedules[key] = layout_schedule(layout, [], 0.0, share)
            except ConfigError:  # too few micro-batches for this schedule
                self.schedules[key] = None
        schedule = self.schedules[key]
        if schedule is None:
            return None
        try:
            return predict_layout(self.counted, self.hw, layout, schedule, self.sims, costs)
        except ConfigError:  # a tp or cp that splits no heads evenly
            return None


def layouts(
    counted: ModelCount, hw: Hardware, gpus: int, seq: int, global_batch: int, dtype: str
) -> Iterator[Layout]:
    """Every valid layout (see the module docstring)."""
    layers = len(counted.layers)
    experts = max((p.experts for p in counted.layers), default=0)
    for tp in _powers_of_two(min(hw.gpus_per_node, gpus)):
        for cp in CONTEXT_PARALLEL:
            if gpus % (tp * cp) or seq % (2 * cp):
                continue
            for pp in _divisors(gpus // (tp * cp)):
                if pp > layers + 2:
                    continue
                dp = gpus // (tp * cp * pp)
                for ep in _divisors(dp) if experts else (1,):
                    if experts and experts % ep:
                        continue
                    yield from _runs(pp, tp, cp, dp, ep, layers, seq, global_batch, dtype)


def _runs(
    pp: int, tp: int, cp: int, dp: int, ep: int, layers: int, seq: int, batch: int, dtype: str
) -> Iterator[Layout]:
    """The layouts of one mesh: FSDP, micro-batch size, schedule and recompute."""
    sharded = dp * cp > 1  # FSDP shards over the replicas and the cp ranks
    for mbs in MICROBATCH_SIZES:
        if batch % (dp * mbs):
            continue
        m = batch // (dp * mbs)
        for schedule, chunks in SCHEDULES if pp > 1 else (("1f1b", 1),):
            if pp * chunks > layers + 2 or m < pp:
                continue
            fsdps: tuple[bool | str, ...] = (False,)
            if sharded:
                fsdps = (False, True) if schedule.startswith("zb") else (False, True, "reshard")
            for fsdp in fsdps:
                for recompute in (False, True):
                    yield Layout(
                        pp, tp=tp, dp=dp, cp=cp, fsdp=fsdp, ep=ep, schedule=schedule,
                        chunks=chunks, microbatch_size=mbs, global_batch=batch, seq=seq,
                        recompute=recompute, dtype=dtype,
                    )  # fmt: skip


def _powers_of_two(top: int) -> list[int]:
    return [1 << i for i in range(top.bit_length()) if 1 << i <= top]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
