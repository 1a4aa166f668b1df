"""Step time and memory per GPU of a layout on hardware nobody has to own:
:func:`estimate`.

Nothing runs on the hardware. The model is counted once on the meta device
(:mod:`~conveyor.planning.counting`); its parts are placed on stages the way Megatron and
torchtitan place them (decoder layers as evenly as the stages allow, the embeddings on the
first stage, the head and loss on the last); each stage's F, B and W take their operations'
time on the hardware (:mod:`~conveyor.planning.hardware`) plus its tensor-parallel and
expert all-to-all traffic (:mod:`~conveyor.planning.collectives`), and conveyor's simulator
runs the layout's schedule on those times. The step adds what follows the pipeline: the
data-parallel gradient reduction (FSDP's gather and reduce-scatter, hidden behind the first
forward and last backward as far as they last) and the optimizer step.

Memory per rank is the runtime's accounting on those numbers: parameters, gradients and
optimizer state by the rank's parameters and the layout's precision (mixed precision keeps
bf16 weights, fp32 gradients and fp32 master weights with the optimizer's states, as
Megatron does; FSDP keeps fp32 shards and gathers bf16 weights), activations as the
schedule's peak micro-batches in flight times what autograd saves per micro-batch of the
rank's parts, and buffers (the pipeline's send and receive, a recomputed layer's
activations, tensor parallelism's gathered sequence, FSDP's gathered weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conveyor.errors import ConfigError
from conveyor.planning import collectives
from conveyor.planning.counting import count_model
from conveyor.planning.hardware import Hardware, hardware
from conveyor.planning.layout import Layout
from conveyor.planning.model_count import ATTENTION, MATMUL, ModelCount, Op, Part
from conveyor.schedules import Schedule, get_schedule, zero_bubble_auto
from conveyor.simulate import peak_activations, simulate

GB = 1e9
MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations", "buffers")
"""The keys of :attr:`Estimate.memory_parts`' entries."""


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


def estimate(model: Any, *, hardware: str | Hardware, layout: Layout) -> Estimate:
    """Predict step time and memory per GPU of ``layout`` on ``hardware``.

    Args:
        model: A transformers config of a causal language model, or such a model built
            under :func:`conveyor.empty_weights`.
        hardware: A preset's name (``"a100-80g"``, ``"h100-sxm"``, ``"h200"``) or a
            :class:`~conveyor.planning.hardware.Hardware`.
        layout: The :class:`~conveyor.planning.layout.Layout`.

    Returns:
        The :class:`Estimate`.

    Raises:
        ConfigError: For an unknown hardware name, a model that cannot be counted, more
            stages than decoder layers + 2, or a schedule that cannot run the layout's
            micro-batches.
    """
    counted = count_model(model, layout.seq, layout.dtype)
    return predict(counted, _hardware(hardware), layout)


_hardware = hardware


def predict(counted: ModelCount, hw: Hardware, layout: Layout) -> Estimate:
    """:func:`estimate` on a model already counted at the layout's ``seq`` and ``dtype``."""
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
    balance = _balance(layers, stages)
    stage_parts = _stage_parts(counted, balance)
    times = _Times(counted, hw, layout)
    costs = [times.stage(parts) for parts in stage_parts]
    comm = times.p2p()
    schedule = _schedule(layout, costs, comm)
    sim = simulate(schedule, costs, comm)
    by_rank = _by_rank(schedule, stage_parts)
    memory = tuple(
        _memory(parts, counted, layout, peak)
        for parts, peak in zip(by_rank, peak_activations(schedule), strict=True)
    )
    sync = max(
        times.sync(parts, _rank_costs(schedule, costs, r)) for r, parts in enumerate(by_rank)
    )
    step = sim.makespan + sync
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
        bubble=sim.bubble,
        memory_gb=max(sum(m.values()) for m in memory),
        memory_parts=memory,
        layout=layout,
        hardware=hw,
        balance=tuple(balance),
        stage_times=tuple(costs),
        sync_s=sync,
    )


def _balance(layers: int, stages: int) -> list[int]:
    """Decoder layers per stage. The embeddings and the head count as one layer each (so
    the first and last stages hold one layer fewer, as in Megatron, torchtitan and Llama 3),
    and the units are split as evenly as can be, the extra ones on the middle stages."""
    base, extra = divmod(layers + 2, stages)
    sizes = [base] * stages
    order = sorted(range(stages), key=lambda s: (s in (0, stages - 1), abs(s - (stages - 1) / 2)))
    for s in order[:extra]:
        sizes[s] += 1
    sizes[0] -= 1
    sizes[-1] -= 1
    return sizes


def _stage_parts(counted: ModelCount, balance: Sequence[int]) -> list[list[Part]]:
    parts: list[list[Part]] = []
    start = 0
    for size in balance:
        parts.append(list(counted.layers[start : start + size]))
        start += size
    parts[0].insert(0, counted.parts[0])
    parts[-1].append(counted.parts[-1])
    return parts


def _schedule(layout: Layout, costs: list[tuple[float, float, float]], comm: float) -> Schedule:
    m = layout.microbatches
    if layout.schedule == "zb-auto":
        return zero_bubble_auto(layout.pp, m, costs, layout.microbatch_cap, comm, layout.chunks)
    return get_schedule(layout.schedule, layout.pp, m, layout.chunks)


def _by_rank(schedule: Schedule, stage_parts: list[list[Part]]) -> list[list[Part]]:
    ranks: list[list[Part]] = [[] for _ in range(schedule.ranks)]
    for stage, rank in enumerate(schedule.placement):
        ranks[rank] += stage_parts[stage]
    return ranks


def _rank_costs(
    schedule: Schedule, costs: list[tuple[float, float, float]], rank: int
) -> tuple[float, float, float]:
    mine = [c for s, c in enumerate(costs) if schedule.placement[s] == rank]
    return (sum(c[0] for c in mine), sum(c[1] for c in mine), sum(c[2] for c in mine))


class _Times:
    """Seconds of each part's F, B and W under the layout, and of its communication."""

    def __init__(self, counted: ModelCount, hw: Hardware, layout: Layout) -> None:
        self.counted = counted
        self.hw = hw
        self.layout = layout
        self.cache: dict[int, tuple[float, float, float]] = {}

    def op(self, op: Op) -> float:
        k, t, hw = self.layout.microbatch_size, self.layout.tp, self.hw
        flops = op.flops * k / t
        moved = (op.bytes * k + op.fixed_bytes) / t
        if op.kind == MATMUL:
            seconds = hw.matmul_seconds(flops, moved)
        elif op.kind == ATTENTION:
            seconds = hw.attention_seconds(flops, moved, self.counted.seq, op.causal)
        else:
            seconds = max(flops / (hw.peak_tflops * 1e12), hw.memory_seconds(moved))
        return seconds * op.count

    def compute(self, ops: Sequence[Op]) -> float:
        return sum(self.op(o) for o in ops)

    def tp_reduce(self) -> float:
        """One all-reduce of a micro-batch's hidden states among the tensor-parallel ranks
        (with sequence parallelism: a gather and a reduce-scatter, the same bytes)."""
        nbytes = self.counted.hidden_bytes * self.counted.seq * self.layout.microbatch_size
        return collectives.all_reduce(self.hw, nbytes, self.layout.tp)

    def a2a(self, part: Part) -> float:
        """One all-to-all of a micro-batch's routed tokens among the expert-parallel ranks."""
        nbytes = part.routed_bytes * self.layout.microbatch_size / self.layout.tp
        return collectives.all_to_all(self.hw, nbytes, *self.layout.group("ep"))

    def part(self, part: Part) -> tuple[float, float, float]:
        f = self.compute(part.forward)
        b = self.compute(part.backward)
        w = self.compute(part.weight)
        if part.name == "layer":
            talk = 2 * self.tp_reduce() + (2 * self.a2a(part) if part.experts else 0.0)
            f, b = f + talk, b + talk
        elif self.layout.tp > 1:  # the embedding's sum in F, the loss's in B
            f, b = (f + self.tp_reduce(), b) if part.name == "pre" else (f, b + self.tp_reduce())
        return f, b, w

    def stage(self, parts: Sequence[Part]) -> tuple[float, float, float]:
        f = b = w = 0.0
        for part in parts:
            pf, pb, pw = self._part(part)
            f, b, w = f + pf, b + pb, w + pw
        if self.layout.recompute:
            b += sum(self._part(p)[0] for p in parts if p.name == "layer")
        return f, b, w

    def _part(self, part: Part) -> tuple[float, float, float]:
        key = id(part)  # layers alike are one object (counting); hashing it would cost more
        if key not in self.cache:
            self.cache[key] = self.part(part)
        return self.cache[key]

    def p2p(self) -> float:
        """One pipeline send of a micro-batch's hidden states (split by tp)."""
        layout = self.layout
        if layout.pp == 1:
            return 0.0
        nbytes = self.counted.hidden_bytes * layout.seq * layout.microbatch_size / layout.tp
        # A pipeline is pp * tp consecutive ranks: inside a node when every pipeline fits
        # one (all of them in one node, or nodes holding whole pipelines); otherwise some
        # boundary crosses the network, and every micro-batch passes every boundary.
        node = self.hw.gpus_per_node
        same = layout.gpus <= node or node % (layout.pp * layout.tp) == 0
        return collectives.p2p(self.hw, nbytes, same)

    def sync(self, parts: Sequence[Part], cost: tuple[float, float, float]) -> float:
        """Seconds after a rank's last backward: gradient reduction left exposed and the
        optimizer step."""
        layout, hw = self.layout, self.hw
        dense, experts = _params(parts, layout)
        replicas, stride = layout.group("dp")
        if layout.fsdp:  # one gather and one reduce-scatter per part (FSDP wraps each layer)
            weight_bytes = 2 if layout.dtype != "fp32" else 4
            sizes = [sum(_params([p], layout)) for p in parts]
            gather = sum(
                collectives.all_gather(hw, n * weight_bytes, replicas, stride) for n in sizes
            )
            scatter = sum(collectives.reduce_scatter(hw, n * 4, replicas, stride) for n in sizes)
            # Gathered once a step, before the rank's first forward, and reduced after its
            # last backward (conveyor's runtime and torchtitan's with a pipeline).
            exposed = max(0.0, gather - cost[0]) + max(0.0, scatter - cost[1] - cost[2])
        else:
            exposed = collectives.all_reduce(hw, dense * 4, replicas, stride)
            if experts:  # each expert's share among the replicas holding it: dp / ep ranks
                exposed += collectives.all_reduce(hw, experts * 4, *layout.group("edp"))
        shard = layout.dp if layout.fsdp else 1
        # AdamW reads gradient, master weight and two states, writes the three, and the
        # bf16 copy: 30 bytes a parameter (fp32: 28); SGD reads and writes weight and gradient.
        per_param = 8 if layout.optimizer == "sgd" else (30 if layout.dtype != "fp32" else 28)
        return exposed + hw.memory_seconds((dense + experts) * per_param / shard)


def _params(parts: Sequence[Part], layout: Layout) -> tuple[float, float]:
    """A rank's (dense, expert) parameters: split by tp, and the experts by ep."""
    dense = sum(p.params - p.expert_params for p in parts) / layout.tp
    experts = sum(p.expert_params for p in parts) / layout.tp / layout.ep
    return dense, experts


def _memory(
    parts: Sequence[Part], counted: ModelCount, layout: Layout, peak: float
) -> dict[str, float]:
    """One rank's memory by kind, GB (see the module docstring)."""
    dense, experts = _params(parts, layout)
    params = dense + experts
    tensors = sum(p.param_tensors for p in parts)
    mixed = layout.dtype != "fp32"
    shard = layout.dp if layout.fsdp else 1
    adam = layout.optimizer != "sgd"
    if layout.fsdp:
        weights, grads = 4 * params / shard, 4 * params / shard
        states = (8 if adam else 0) * params / shard
    else:
        weights, grads = (2 if mixed else 4) * params, 4 * params
        states = ((8 if adam else 0) + (4 if mixed else 0)) * params
    if adam:
        states += 4 * tensors  # torch's Adam keeps a step count per parameter tensor
    k, t = layout.microbatch_size, layout.tp
    hidden = counted.hidden_bytes * layout.seq * k
    held = 0.0
    for part in parts:
        keeps_input = layout.recompute and part.name == "layer"
        held += hidden / t if keeps_input else part.saved_bytes * k / t
    activations = peak * held
    buffers = 2 * hidden / t if layout.pp > 1 else 0.0
    if t > 1:
        buffers += hidden  # sequence parallelism gathers the whole sequence for a matmul
    if layout.recompute:
        buffers += max((p.saved_bytes for p in parts if p.name == "layer"), default=0.0) * k / t
    if layout.fsdp:
        # The rank's weights stay gathered for the step, and their gradients unsharded
        # until its last backward, both in the compute dtype.
        buffers += 2 * (2 if mixed else 4) * params
    return {
        "parameters": weights / GB,
        "gradients": grads / GB,
        "optimizer": states / GB,
        "activations": activations / GB,
        "buffers": buffers / GB,
    }
