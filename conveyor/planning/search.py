"""Every layout of a model on a cluster, predicted and ranked: :func:`rank_layouts`.

The layouts are every product ``pp * tp * dp = gpus`` with tensor parallelism inside a
node (a power of two dividing the attention heads and the key/value heads), expert
parallelism over the data-parallel ranks (a divisor of both ``dp`` and the expert count),
FSDP or not, each pipeline schedule of :data:`SCHEDULES`, micro-batches of 1 to 8
sequences and recompute or not; the model is counted once and every layout is simulated
(:func:`~conveyor.planning.cluster.predict_layout`). Layouts that fit the memory limit come
first, fastest (tokens per second per GPU) first; those over it follow, marked.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from conveyor.errors import ConfigError
from conveyor.planning.cluster import Estimate, predict_layout
from conveyor.planning.counting import count_model
from conveyor.planning.devices import Hardware, hardware
from conveyor.planning.layout import Layout
from conveyor.planning.model_count import ModelCount

SCHEDULES: tuple[tuple[str, int], ...] = (
    ("1f1b", 1),
    ("interleaved-1f1b", 2),
    ("zb-h1", 1),
    ("zb-h2", 1),
    ("zbv", 2),
)
"""(schedule, chunks) tried for every pipeline of 2 ranks or more (one rank runs ``1f1b``)."""

MICROBATCH_SIZES = (1, 2, 4, 8)


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
    ranked = [
        Ranked(est, est.fits(limit))
        for layout in layouts(counted, hw, gpus, seq, global_batch, dtype)
        if (est := _predict(counted, hw, layout)) is not None
    ]
    if not ranked:
        raise ConfigError(
            f"no layout of {gpus} GPUs can run a global batch of {global_batch} sequences of "
            f"this model; use a global batch that a divisor of {gpus} divides"
        )
    ranked.sort(key=lambda r: (not r.fits, -r.estimate.tokens_per_s_per_gpu))
    return ranked


_hardware = hardware


def _predict(counted: ModelCount, hw: Hardware, layout: Layout) -> Estimate | None:
    try:
        return predict_layout(counted, hw, layout)
    except ConfigError:  # a tp splitting no heads evenly; a schedule these micro-batches fail
        return None


def layouts(
    counted: ModelCount, hw: Hardware, gpus: int, seq: int, global_batch: int, dtype: str
) -> Iterator[Layout]:
    """Every valid layout (see the module docstring)."""
    layers = len(counted.layers)
    experts = max((p.experts for p in counted.layers), default=0)
    for tp in _powers_of_two(min(hw.gpus_per_node, gpus)):
        if gpus % tp:  # a tp that cannot split the heads: predict refuses it
            continue
        for pp in _divisors(gpus // tp):
            if pp > layers + 2:
                continue
            dp = gpus // (tp * pp)
            for ep in _divisors(dp) if experts else (1,):
                if experts and experts % ep:
                    continue
                for fsdp in (False, True) if dp > 1 else (False,):
                    for mbs in MICROBATCH_SIZES:
                        if global_batch % (dp * mbs):
                            continue
                        m = global_batch // (dp * mbs)
                        for schedule, chunks in SCHEDULES if pp > 1 else (("1f1b", 1),):
                            if pp * chunks > layers + 2 or m < pp:
                                continue
                            for recompute in (False, True):
                                yield Layout(
                                    pp,
                                    tp=tp,
                                    dp=dp,
                                    fsdp=fsdp,
                                    ep=ep,
                                    schedule=schedule,
                                    chunks=chunks,
                                    microbatch_size=mbs,
                                    global_batch=global_batch,
                                    seq=seq,
                                    recompute=recompute,
                                    dtype=dtype,
                                )


def _powers_of_two(top: int) -> list[int]:
    return [1 << i for i in range(top.bit_length()) if 1 << i <= top]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
