"""What a profile is: per-unit measurements and the per-stage sums the planner needs.

:class:`LayerProfile` holds one unit's times and bytes, :class:`Profile` a whole model's at
one micro-batch size plus the link between ranks. Everything here is pure arithmetic on
those numbers; measuring them is :func:`conveyor.planning.profiler.profile`.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.errors import ConfigError
from conveyor.partition.cuts import rows_per_rank


@dataclass(frozen=True)
class LayerProfile:
    """One unit on one micro-batch. Times in seconds, sizes in bytes.

    Attributes:
        name: A readable label, ``"unit i: ..."``.
        forward: F as split-backward schedules run it (linear weights deferred).
        forward_plain: F as other schedules run it.
        backward_input: B of a split backward.
        backward_weight: W of a split backward.
        backward: The whole backward.
        activations: What autograd saves for the backward (parameters excluded).
        parameters: The unit's parameter bytes.
        output: Bytes of what it passes to the next unit.
    """

    name: str
    forward: float
    forward_plain: float
    backward_input: float
    backward_weight: float
    backward: float
    activations: int
    parameters: int
    output: int

    def time(self, split: bool) -> float:
        """Seconds of one micro-batch through this unit.

        Args:
            split: Whether the schedule splits the backward.

        Returns:
            F + B + W when ``split``, else plain F + the whole backward.
        """
        if split:
            return self.forward + self.backward_input + self.backward_weight
        return self.forward_plain + self.backward


@dataclass(frozen=True)
class Profile:
    """Per-unit measurements at one micro-batch size, and the link between ranks.

    Attributes:
        layers: One :class:`LayerProfile` per unit, in model order.
        microbatches: How many micro-batches the profiled batch was cut into.
        microbatch_size: Samples per micro-batch.
        latency: Seconds per transfer between ranks.
        bandwidth: Bytes per second between ranks.
    """

    layers: tuple[LayerProfile, ...]
    microbatches: int
    microbatch_size: int
    latency: float
    bandwidth: float

    def times(self, split: bool) -> list[float]:
        """Each unit's time for one micro-batch.

        Args:
            split: Whether the schedule splits the backward (see :meth:`LayerProfile.time`).

        Returns:
            Seconds per unit, in model order.
        """
        return [layer.time(split) for layer in self.layers]

    def costs(self, balance: Sequence[int], split: bool) -> list[tuple[float, float, float]]:
        """(F, B, W) per stage, as :func:`conveyor.simulate.simulate` takes them.

        Without ``split`` W is 0 and B is the whole backward, which the simulator charges
        as B + W anyway.

        Args:
            balance: Units per stage.
            split: Whether the schedule splits the backward.

        Returns:
            Seconds of (F, B, W) per stage.

        Raises:
            ConfigError: ``balance`` does not cover the profiled units.
        """
        out = []
        for part in _parts(self.layers, balance):
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
    ) -> Profile:
        """This profile scaled by what a real run measured.

        See :func:`conveyor.planning.calibration.calibrate_family`.

        Args:
            forward: Factor for F (split F when ``split``, else plain F).
            backward: Factor for B (the whole backward unless ``split``).
            weight: Factor for W (used only when ``split``).
            split: Which of the two sets of times to scale.
            latency: The link latency to use instead of the measured one.

        Returns:
            A new profile; this one is unchanged.
        """

        def scale(u: LayerProfile) -> LayerProfile:
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

        layers = tuple(scale(u) for u in self.layers)
        return dataclasses.replace(self, layers=layers, latency=latency)

    def sharded(self, shards: int) -> Profile:
        """This profile with each unit's parameter bytes (so its gradient's) cut up.

        Args:
            shards: Into how many pieces (FSDP replicas times tensor parallelism).

        Returns:
            A new profile, or this one when ``shards <= 1``.
        """
        if shards <= 1:
            return self
        layers = tuple(
            dataclasses.replace(u, parameters=rows_per_rank(u.parameters, shards))
            for u in self.layers
        )
        return dataclasses.replace(self, layers=layers)

    def comm(self, balance: Sequence[int]) -> float:
        """Seconds of the slowest transfer between stages (the simulator takes one number).

        Args:
            balance: Units per stage.

        Returns:
            latency + the largest boundary's bytes / bandwidth.

        Raises:
            ConfigError: ``balance`` does not cover the profiled units.
        """
        parts = _parts(self.layers, balance)
        boundaries = [part[-1].output for part in parts[:-1]]  # bytes sent per boundary
        return self.latency + max(boundaries, default=0) / self.bandwidth

    def parameter_bytes(self, balance: Sequence[int]) -> list[int]:
        """Parameter bytes per stage.

        Args:
            balance: Units per stage.

        Returns:
            Bytes per stage.

        Raises:
            ConfigError: ``balance`` does not cover the profiled units.
        """
        return [sum(u.parameters for u in part) for part in _parts(self.layers, balance)]

    def activation_bytes(self, balance: Sequence[int]) -> list[int]:
        """Bytes one micro-batch keeps alive on each stage between its F and backward.

        Args:
            balance: Units per stage.

        Returns:
            Bytes per stage.

        Raises:
            ConfigError: ``balance`` does not cover the profiled units.
        """
        return [sum(u.activations for u in part) for part in _parts(self.layers, balance)]


def mean_layers(per_rank: Sequence[Sequence[LayerProfile]]) -> tuple[LayerProfile, ...]:
    """Unit by unit, the mean times over several measurements of the same units.

    Args:
        per_rank: One sequence of unit profiles per rank, all of the same units.

    Returns:
        The first rank's profiles with every time replaced by the mean over ranks.

    Raises:
        ValueError: The ranks measured different numbers of units.
    """
    out = []
    for same in zip(*per_rank, strict=True):

        def mean(field: str, same: tuple[LayerProfile, ...] = same) -> float:
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


def _parts(layers: Sequence[LayerProfile], balance: Sequence[int]) -> list[list[LayerProfile]]:
    if sum(balance) != len(layers) or min(balance, default=0) < 1:
        raise ConfigError(
            f"balance {list(balance)} does not cover the {len(layers)} profiled units; give "
            f"counts >= 1 that add up to {len(layers)}"
        )
    out, start = [], 0
    for size in balance:
        out.append(list(layers[start : start + size]))
        start += size
    return out


__all__ = ["LayerProfile", "Profile", "mean_layers"]
