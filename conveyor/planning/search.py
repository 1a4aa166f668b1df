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
(:class:`~conveyor.planning.predictor.Predictor`). Layouts that fit the memory limit
come first, fastest (tokens per second per GPU) first; those over it follow, marked.
"""

from __future__ import annotations

import bisect
import gc
import heapq
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from conveyor.errors import ConfigError
from conveyor.planning.cluster import Estimate
from conveyor.planning.counting import count_model
from conveyor.planning.devices import Hardware, hardware
from conveyor.planning.layout import Layout
from conveyor.planning.model_count import ModelCount
from conveyor.planning.predictor import Predictor

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
    top: int | None = None,
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
        top: Only the first ``top`` of that ranking, the same layouts in the same order
            with the same predictions, found by branch and bound: a layout is predicted
            only while its lower bounds (:mod:`~conveyor.planning.bounds`) can still
            beat the ``top`` best predicted so far. None: every layout.

    Returns:
        The layouts: those that fit first, each group fastest first.

    Raises:
        ConfigError: For sizes below 1, or when no layout of ``gpus`` can take
            ``global_batch`` (e.g. fewer sequences than data-parallel replicas).
    """
    sizes = [("gpus", gpus), ("seq", seq), ("global_batch", global_batch)]
    for name, value in [*sizes, *([("top", top)] if top is not None else [])]:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    hw = _hardware(hardware)
    limit = hw.hbm_gb if memory_limit_gb is None else memory_limit_gb
    if not limit > 0:
        raise ConfigError(f"the memory limit must be a number of GB > 0, got {limit!r}")
    with _collector_paused():
        counted = count_model(model, seq, dtype)
        predictor = Predictor(counted, hw)
        every = layouts(counted, hw, gpus, seq, global_batch, dtype)
        if top is None:
            ranked = [
                Ranked(est, est.fits(limit))
                for layout in every
                if (est := predictor.predict(layout)) is not None
            ]
        else:
            ranked = best_layouts(predictor, list(every), limit, top)
    if not ranked:
        raise ConfigError(
            f"no layout of {gpus} GPUs can run a global batch of {global_batch} sequences of "
            f"this model; use a global batch that a divisor of {gpus} divides"
        )
    ranked.sort(key=lambda r: (not r.fits, -r.estimate.tokens_per_s_per_gpu))
    return ranked


_hardware = hardware


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, as it was after. A search
    keeps millions of small objects alive (schedules' actions, simulated events) that
    hold no reference cycles; the collector's full passes over them took a third of a
    large search (405B on 16,384 GPUs: 7 of 20 s). Their memory is freed by reference
    counting all the same; what cycles the count's trace leaves, the collector frees
    once it runs again."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def best_layouts(
    predictor: Predictor, candidates: list[Layout], limit: float, top: int
) -> list[Ranked]:
    """The first ``top`` of the ranking of ``candidates`` (those that fit ``limit`` GB
    first, each group fastest first, ties in the order given), predicting only the
    layouts whose lower bounds can still place them there: a bound never exceeds the
    prediction, so every layout left out ranks below the ``top`` returned.

    Best first: the layouts wait in a heap by their bound (as tokens per second per GPU,
    then their index); the one on top gets its next, tighter bound
    (:meth:`~conveyor.planning.predictor.Predictor.rung`) and goes back, or, with none
    left, is predicted. Once the one on top ranks below the ``top`` best predicted, so
    does every other."""
    found: list[tuple[float, int, Ranked]] = []  # (-tokens/s/GPU, index, ranked)
    best: dict[bool, list[tuple[float, int]]] = {True: [], False: []}  # found's, sorted
    over: list[tuple[float, int, int, Layout]] = []  # heap entries known to be over

    def fastest(layout: Layout, step: float) -> float:  # as Estimate.tokens_per_s_per_gpu
        return layout.global_batch * layout.seq / step / layout.gpus

    def predicted(key: float, i: int, rung: int, layout: Layout, fits: bool) -> None:
        if fits and (gb := predictor.memory_gb(layout)) is not None and gb > limit:
            over.append((key, i, rung, layout))  # over: simulated only if needed
            return
        est = predictor.predict(layout)
        if est is not None:
            ranked = Ranked(est, est.fits(limit))
            found.append((-est.tokens_per_s_per_gpu, i, ranked))
            bisect.insort(best[ranked.fits], (-est.tokens_per_s_per_gpu, i))

    def ranked_among(
        fits: bool, wanted: int, heap: list[tuple[float, int, int, Layout]]
    ) -> list[Ranked]:
        heapq.heapify(heap)
        while heap:
            key, i, rung, layout = heapq.heappop(heap)
            if len(best[fits]) >= wanted and (key, i) > best[fits][wanted - 1]:
                break  # this one and every one after it ranks below the best `wanted`
            bound = predictor.rung(layout, rung)
            if bound is None:
                predicted(key, i, rung, layout, fits)
                continue
            step, memory = bound
            if step > 0:
                key = max(key, -fastest(layout, step))
            if fits and memory > limit:  # cannot fit: one of the layouts over the limit
                over.append((key, i, rung + 1, layout))
            else:
                heapq.heappush(heap, (key, i, rung + 1, layout))
        return [r for *_, r in sorted(found, key=lambda f: f[:2]) if r.fits is fits][:wanted]

    every = [
        (-fastest(lay, work), i, 0, lay)
        for i, lay in enumerate(candidates)
        if (work := predictor.work(lay)) is not None
    ]
    fitting = ranked_among(True, top, every)
    if len(fitting) == top:
        return fitting
    # Every layout came up: those over the limit, by their bounds or predicted, are left.
    return fitting + ranked_among(False, top - len(fitting), list(over))


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
