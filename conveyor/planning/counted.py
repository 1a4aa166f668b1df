"""The counted source: a model counted on the meta device (:mod:`~conveyor.planning.counting`)
turned into :class:`~conveyor.planning.costs.Costs` for one layout on one
:class:`~conveyor.planning.devices.Hardware` (:func:`counted_costs`), and the links its
gradients and optimizer use (:class:`CountedSync`).

A part's F, B and W are its operations' times on the hardware
(:meth:`~conveyor.planning.devices.Hardware.op_seconds`) at the layout's micro-batch
size, split by tensor and context parallelism, plus what the layout sends inside them:

- tensor parallelism: a decoder layer's F and B each gather and reduce-scatter its
  hidden states twice (without sequence parallelism: all-reduce them, the same bytes);
  the embeddings' F and the loss's B once;
- expert parallelism: two all-to-alls of the routed tokens in F and in B;
- context parallelism: a ring of ``cp - 1`` steps per layer, each passing a block of keys
  and values (and in B their gradients too) while the attention of the block before
  runs; what a step sends beyond that compute is exposed;
- ``fsdp="reshard"``: each part's weights gathered for its F and again for its B, and
  its gradients reduce-scattered after B, each beside the part's compute.
"""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.planning import collectives
from conveyor.planning.costs import LAYER, PRE, Costs, UnitCost
from conveyor.planning.devices import Hardware
from conveyor.planning.layout import Layout
from conveyor.planning.model_count import ATTENTION, MATMUL, ModelCount, Op, Part


class _Units:
    """Each part of a count as a :class:`UnitCost` under one layout (parts alike once)."""

    def __init__(self, counted: ModelCount, hw: Hardware, layout: Layout) -> None:
        self.counted, self.hw, self.layout = counted, hw, layout
        self.mixed = layout.dtype != "fp32"
        # tokens of one micro-batch on one rank, as a share of one sequence
        self.share = layout.microbatch_size / layout.cp
        self.made: dict[int, UnitCost] = {}

    def op(self, op: Op) -> float:
        t = self.layout.tp
        return self.hw.op_seconds(op, self.share, t, self.counted.seq // self.layout.cp)

    def seconds(self, ops: Sequence[Op], kind: str | None = None) -> float:
        return sum(self.op(o) for o in ops if kind is None or o.kind == kind)

    @property
    def hidden(self) -> float:
        """Bytes of one micro-batch's hidden states on one rank (split by sequence
        parallelism under tp, and by cp)."""
        layout = self.layout
        whole = self.counted.hidden_bytes * self.counted.seq * self.share
        return whole / layout.tp if layout.sequence_parallel else whole

    def tp_reduce(self) -> float:
        """A micro-batch's hidden states reduced among the tensor-parallel ranks (with
        sequence parallelism: gathered and reduce-scattered, the same bytes)."""
        nbytes = self.counted.hidden_bytes * self.counted.seq * self.share
        return collectives.all_reduce(self.hw, nbytes, *self.layout.group("tp"))

    def a2a(self, part: Part) -> float:
        nbytes = part.routed_bytes * self.share / self.layout.tp
        return collectives.all_to_all(self.hw, nbytes, *self.layout.group("ep"))

    def ring(self, attention_f: float, attention_b: float) -> tuple[float, float]:
        """Exposed seconds of context parallelism's ring in one layer's F and B."""
        cp, tp = self.layout.group("cp")
        if cp <= 1:
            return 0.0, 0.0
        counted = self.counted
        kv = 2 * counted.hidden_bytes * counted.kv_heads / max(1, counted.heads)
        block = kv * counted.seq * self.share / self.layout.tp  # this rank's keys and values
        same = cp * tp <= self.hw.gpus_per_node
        send = collectives.p2p(self.hw, block, same)
        back = collectives.p2p(self.hw, 2 * block, same)  # keys, values and their gradients
        steps = cp - 1
        return (
            steps * max(0.0, send - attention_f / cp),
            steps * max(0.0, back - attention_b / cp),
        )

    def params(self, part: Part) -> tuple[float, float]:
        """(dense, expert) parameters of ``part`` on one rank."""
        t, e = self.layout.tp, self.layout.ep
        return (part.params - part.expert_params) / t, part.expert_params / t / e

    def unit(self, part: Part) -> UnitCost:
        key = id(part)  # layers alike are one object (counting)
        if key not in self.made:
            self.made[key] = self._unit(part)
        return self.made[key]

    def _unit(self, part: Part) -> UnitCost:
        layout = self.layout
        f, b, w = (self.seconds(ops) for ops in (part.forward, part.backward, part.weight))
        attention_f = self.seconds(part.forward, ATTENTION)
        if part.name == LAYER:
            talk = 2 * self.tp_reduce() + (2 * self.a2a(part) if part.experts else 0.0)
            ring_f, ring_b = self.ring(attention_f, self.seconds(part.backward, ATTENTION))
            f, b = f + talk + ring_f, b + talk + ring_b
        elif layout.tp > 1:  # the embedding's sum in F, the loss's in B
            f, b = (f + self.tp_reduce(), b) if part.name == PRE else (f, b + self.tp_reduce())
        dense, experts = self.params(part)
        if layout.fsdp == "reshard":
            f, b = self._reshard(f, b, w, dense + experts)
        # Sequence parallelism splits every saved tensor by tp; without it those as wide
        # as the hidden states are whole on every tp rank.
        wide = 0.0 if layout.sequence_parallel else part.saved_hidden * (1 - 1 / layout.tp)
        saved = (part.saved_bytes / layout.tp + wide) * self.share
        width = 2 if self.mixed else 4
        w_reads = sum(
            (o.bytes - o.out) * o.count for o in part.weight if o.kind == MATMUL and o.grows
        )
        return UnitCost(
            name=part.name,
            forward=f,
            forward_plain=f,
            backward_input=b,
            backward_weight=w,
            backward=b + w,
            activations=saved,
            parameters=width * (dense + experts),
            output=self.hidden,
            params=dense + experts,
            tensors=part.param_tensors,
            expert_params=experts,
            kind=part.name,
            input=self.hidden if part.name != PRE else 0.0,
            attention=attention_f,
            attention_saved=sum(o.out * o.count for o in part.forward if o.kind == ATTENTION)
            * self.share
            / layout.tp,
            w_inputs=w_reads * self.share / layout.tp,
            workspace=part.workspace * self.share / layout.tp,
        )

    def _reshard(self, f: float, b: float, w: float, params: float) -> tuple[float, float]:
        """F and B with FSDP's per-use gathers and reduce-scatter, each beside the part's
        own compute as far as it lasts."""
        replicas, stride = self.layout.group("dp")
        width = 2 if self.mixed else 4
        gather = collectives.all_gather(self.hw, params * width, replicas, stride)
        scatter = collectives.reduce_scatter(self.hw, params * 4, replicas, stride)
        return f + max(0.0, gather - f), b + max(0.0, gather + scatter - b - w)

    def p2p_link(self) -> tuple[float, float]:
        """(latency, bandwidth) of a pipeline send: a pipeline is ``pp * cp * tp``
        consecutive ranks, inside a node when every pipeline fits one (all of them in one
        node, or nodes holding whole pipelines); otherwise some boundary crosses the
        network, and every micro-batch passes every boundary."""
        layout, node = self.layout, self.hw.gpus_per_node
        if layout.pp == 1:
            return 0.0, 1.0
        ranks = layout.pp * layout.cp * layout.tp
        same = layout.gpus <= node or node % ranks == 0
        latency = collectives.p2p(self.hw, 0.0, same)
        return latency, 1.0 / (collectives.p2p(self.hw, 1.0, same) - latency)


def counted_costs(counted: ModelCount, hw: Hardware, layout: Layout) -> Costs:
    """The units of ``counted`` (its embeddings, each decoder layer, its head with the
    loss) under ``layout`` on ``hw``; see the module docstring."""
    units = _Units(counted, hw, layout)
    latency, bandwidth = units.p2p_link()
    return Costs(
        tuple(units.unit(p) for p in counted.parts),
        layout.microbatches,
        layout.microbatch_size,
        latency,
        bandwidth,
        hw.action_overhead,
        blocking=not layout.p2p_overlap,
    )


def tp_buffer(counted: ModelCount, layout: Layout) -> float:
    """Bytes tensor parallelism adds to every rank: a micro-batch's whole sequence,
    gathered for a multiply (sequence parallelism)."""
    if layout.tp == 1:
        return 0.0
    return counted.hidden_bytes * counted.seq * layout.microbatch_size / layout.cp


class CountedSync:
    """What a rank does for its gradients and its optimizer, on ``hw``'s links
    (:class:`~conveyor.planning.prediction.Sync`)."""

    def __init__(self, hw: Hardware, layout: Layout) -> None:
        self.hw, self.layout = hw, layout
        self.width = 2 if layout.dtype != "fp32" else 4

    def _group(self, axis: str) -> tuple[int, int]:
        """The replicas a gradient is reduced over: ``dp`` (or ``edp``) times ``cp``."""
        size, stride = self.layout.group(axis)
        cp, cp_stride = self.layout.group("cp")
        if size == 1:
            return cp, cp_stride
        return size * cp, stride

    def reduce(self, units: Sequence[UnitCost]) -> float:
        """fp32 gradients: reduce-scattered per part with FSDP (none with ``"reshard"``,
        whose scatters run in B), reduce-scattered with the distributed optimizer, else
        all-reduced; experts among the replicas that hold them."""
        hw, layout = self.hw, self.layout
        if layout.fsdp == "reshard":
            return 0.0
        dense = sum(u.count - u.expert_params for u in units)
        experts = sum(u.expert_params for u in units)
        group, egroup = self._group("dp"), self._group("edp")
        if layout.fsdp:
            return sum(collectives.reduce_scatter(hw, 4 * u.count, *group) for u in units)
        if layout.distributed_optimizer:
            total = collectives.reduce_scatter(hw, 4 * dense, *group)
            return total + (collectives.reduce_scatter(hw, 4 * experts, *egroup) if experts else 0)
        total = collectives.all_reduce(hw, 4 * dense, *group)
        return total + (collectives.all_reduce(hw, 4 * experts, *egroup) if experts else 0.0)

    def gather(self, units: Sequence[UnitCost]) -> float:
        """``fsdp=True``: the stage's weights gathered, part by part, once per step."""
        if self.layout.fsdp is not True:
            return 0.0
        group = self._group("dp")
        return sum(collectives.all_gather(self.hw, self.width * u.count, *group) for u in units)

    def update(self, units: Sequence[UnitCost]) -> float:
        """The optimizer step, memory-bound: AdamW reads gradient, master weight and two
        states, writes the three, and the bf16 copy: 30 bytes a parameter (fp32: 28);
        SGD reads and writes weight and gradient. With the distributed optimizer, each
        rank steps its shard and the updated bf16 weights are all-gathered after
        (beside the next step's first forward when reductions overlap the backward)."""
        layout, hw = self.layout, self.hw
        params = sum(u.count for u in units)
        shard = layout.dp * layout.cp if layout.fsdp or layout.distributed_optimizer else 1
        sgd = layout.optimizer == "sgd"
        per_param = 8 if sgd else (30 if layout.dtype != "fp32" else 28)
        seconds = hw.memory_seconds(params * per_param / shard)
        if layout.distributed_optimizer and layout.dp_overlap != "backward":
            seconds += collectives.all_gather(hw, self.width * params, *self._group("dp"))
        return seconds


__all__ = ["CountedSync", "counted_costs", "tp_buffer"]
