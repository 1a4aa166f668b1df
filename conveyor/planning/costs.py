"""What a model's units cost, the one interface both sources fill: :class:`UnitCost` per
unit, :class:`Costs` for the whole model with the link between ranks.

A unit is what ``balance=`` counts: a layer of a layer list, a node group of a captured
graph, or, for a model counted on the meta device, its embeddings, each decoder layer and
its head. Its cost is for one micro-batch on one rank. Two sources fill it in:

- measured on this machine (:func:`conveyor.planning.profiler.profile`: each unit timed
  on one real micro-batch);
- counted on the meta device against a :class:`~conveyor.planning.devices.Hardware`
  (:func:`conveyor.planning.counted.counted_costs`: each operation's FLOPs and bytes at
  the rates the hardware reaches).

Everything downstream (:mod:`~conveyor.planning.prediction`: the balance, the simulated
step, the memory per rank, what fits) reads only these numbers, whichever source gave
them.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.errors import ConfigError
from conveyor.partition.cuts import rows_per_rank

LAYER, PRE, POST = "layer", "pre", "post"
"""A unit's kind: a repeated block, or what comes before or after the blocks."""


@dataclass(frozen=True)
class UnitCost:
    """One unit on one micro-batch. Times in seconds, sizes in bytes.

    Attributes:
        name: A readable label, ``"unit i: ..."``.
        forward: F as split-backward schedules run it (linear weights deferred).
        forward_plain: F as other schedules run it.
        backward_input: B of a split backward.
        backward_weight: W of a split backward.
        backward: The whole backward.
        activations: What autograd saves in F for the backward (parameters excluded).
        parameters: The unit's parameter bytes, as the rank holds them.
        output: Bytes of what it passes to the next unit.
        params: Its parameters on this rank (elements); 0: ``parameters`` / 4.
        tensors: Its parameter tensors (an Adam step count each).
        expert_params: Of ``params``, those of expert collections (reduced among the
            replicas holding the same experts).
        kind: :data:`LAYER`, :data:`PRE` or :data:`POST` (what ``recompute="layer"``
            re-runs: the layers).
        input: Bytes of its input (what a recomputed layer keeps from F to B).
        attention: Seconds of F spent in attention kernels (what ``"selective"``
            recompute re-runs at B).
        attention_saved: Bytes of :attr:`activations` the attention kernels save (what
            ``"selective"`` recompute does not keep).
        w_inputs: Bytes W reads that F saved or B made: the inputs and output
            gradients of its matrix multiplies (the Zero Bubble paper's M_W); 0 where
            unknown. :func:`~conveyor.planning.memory.held_until_w` decides what is held.
        workspace: The most bytes of temporaries alive at once while its F or B runs,
            beyond what it keeps (the loss's logits in fp32 and their gradient, say).
    """

    name: str
    forward: float
    forward_plain: float
    backward_input: float
    backward_weight: float
    backward: float
    activations: float
    parameters: float
    output: float
    params: float = 0.0
    tensors: int = 0
    expert_params: float = 0.0
    kind: str = LAYER
    input: float = 0.0
    attention: float = 0.0
    attention_saved: float = 0.0
    w_inputs: float = 0.0
    workspace: float = 0.0

    @property
    def count(self) -> float:
        """Its parameters on this rank (elements)."""
        return self.params or self.parameters / 4

    def time(self, split: bool) -> float:
        """Seconds of one micro-batch through this unit: F + B + W when ``split``, else
        plain F + the whole backward."""
        if split:
            return self.forward + self.backward_input + self.backward_weight
        return self.forward_plain + self.backward


@dataclass(frozen=True)
class Costs:
    """Every unit's cost at one micro-batch size, and the link between ranks.

    Attributes:
        layers: One :class:`UnitCost` per unit, in model order.
        microbatches: How many micro-batches the batch is cut into.
        microbatch_size: Samples per micro-batch.
        latency: Seconds per transfer between pipeline ranks.
        bandwidth: Bytes per second between pipeline ranks.
        overhead: Seconds the runtime adds to every F and B (its own bookkeeping).
        blocking: Whether a rank waits for its sends before it computes on (Megatron-LM's
            point-to-point calls); conveyor's runtime sends beside its compute.
    """

    layers: tuple[UnitCost, ...]
    microbatches: int
    microbatch_size: int
    latency: float
    bandwidth: float
    overhead: float = 0.0
    blocking: bool = False

    def times(self, split: bool) -> list[float]:
        """Each unit's time for one micro-batch (see :meth:`UnitCost.time`)."""
        return [layer.time(split) for layer in self.layers]

    def parts(self, balance: Sequence[int]) -> list[list[UnitCost]]:
        """The units of each stage.

        Raises:
            ConfigError: ``balance`` does not cover the units.
        """
        if sum(balance) != len(self.layers) or min(balance, default=0) < 1:
            raise ConfigError(
                f"balance {list(balance)} does not cover the {len(self.layers)} profiled "
                f"units; give counts >= 1 that add up to {len(self.layers)}"
            )
        out, start = [], 0
        for size in balance:
            out.append(list(self.layers[start : start + size]))
            start += size
        return out

    def costs(self, balance: Sequence[int], split: bool) -> list[tuple[float, float, float]]:
        """(F, B, W) per stage, as :func:`conveyor.simulate.simulate` takes them.

        Without ``split`` W is 0 and B is the whole backward, which the simulator charges
        as B + W anyway.
        """
        out = []
        for part in self.parts(balance):
            if split:
                out.append(
                    (
                        sum(u.forward for u in part),
                        sum(u.backward_input for u in part),
                        sum(u.backward_weight for u in part),
                    )
                )
            else:
                out.append((sum(u.forward_plain for u in part), sum(u.backward for u in part), 0.0))
        return out

    def calibrated(
        self, forward: float, backward: float, weight: float, split: bool, latency: float
    ) -> Costs:
        """These costs scaled by what a real run measured
        (:func:`conveyor.planning.calibration.calibrate_family`): ``forward`` scales F,
        ``backward`` B (the whole backward unless ``split``), ``weight`` W; ``latency``
        replaces the link's."""

        def scale(u: UnitCost) -> UnitCost:
            if split:
                return dataclasses.replace(
                    u,
                    forward=u.forward * forward,
                    backward_input=u.backward_input * backward,
                    backward_weight=u.backward_weight * weight,
                )
            return dataclasses.replace(
                u, forward_plain=u.forward_plain * forward, backward=u.backward * backward
            )

        return dataclasses.replace(
            self, layers=tuple(scale(u) for u in self.layers), latency=latency
        )

    def sharded(self, shards: int) -> Costs:
        """These costs with each unit's parameters cut into ``shards`` pieces (FSDP replicas
        times tensor parallelism), or themselves when ``shards <= 1``."""
        if shards <= 1:
            return self

        def cut(u: UnitCost) -> UnitCost:
            return dataclasses.replace(
                u,
                parameters=rows_per_rank(int(u.parameters), shards),
                params=u.count / shards,
                expert_params=u.expert_params / shards,
            )

        return dataclasses.replace(self, layers=tuple(cut(u) for u in self.layers))

    def comm(self, balance: Sequence[int]) -> float:
        """Seconds of the slowest transfer between stages (the simulator takes one number):
        latency + the largest boundary's bytes / bandwidth."""
        boundaries = [part[-1].output for part in self.parts(balance)[:-1]]
        return self.latency + max(boundaries, default=0) / self.bandwidth

    def parameter_bytes(self, balance: Sequence[int]) -> list[float]:
        """Parameter bytes per stage, as the ranks hold them."""
        return [sum(u.parameters for u in part) for part in self.parts(balance)]

    def activation_bytes(self, balance: Sequence[int]) -> list[float]:
        """Bytes one micro-batch keeps alive on each stage between its F and backward."""
        return [sum(u.activations for u in part) for part in self.parts(balance)]


def mean_layers(per_rank: Sequence[Sequence[UnitCost]]) -> tuple[UnitCost, ...]:
    """Unit by unit, the mean times over several measurements of the same units: the
    first rank's units with every time replaced by the mean over ranks.

    Raises:
        ValueError: The ranks measured different numbers of units.
    """
    out = []
    for same in zip(*per_rank, strict=True):

        def mean(field: str, same: tuple[UnitCost, ...] = same) -> float:
            return statistics.fmean(getattr(u, field) for u in same)

        out.append(
            dataclasses.replace(
                same[0],
                forward=mean("forward"),
                forward_plain=mean("forward_plain"),
                backward_input=mean("backward_input"),
                backward_weight=mean("backward_weight"),
                backward=mean("backward"),
            )
        )
    return tuple(out)


__all__ = ["LAYER", "POST", "PRE", "Costs", "UnitCost", "mean_layers"]
