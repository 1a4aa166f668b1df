"""Timings of real runs: per-action records and what the simulator can learn from them.

Pure Python (no torch import).
"""

from __future__ import annotations

from collections.abc import Iterable

Timing = tuple[int, str, int, int, float, float]
"""(rank, kind, stage, microbatch, start, end) of one action, seconds from the step start."""


def measured_costs(timings: Iterable[Timing], stages: int) -> list[tuple[float, float, float]]:
    """Per stage, the mean duration of its F, B and W actions in ``timings`` (0 if none).

    The result is the per-stage cost list :func:`conveyor.simulate.simulate` takes, so a
    real run can be replayed in simulated time.
    """
    sums = [[0.0, 0.0, 0.0] for _ in range(stages)]
    counts = [[0, 0, 0] for _ in range(stages)]
    for _, kind, stage, _, start, end in timings:
        k = "FBW".index(kind)
        sums[stage][k] += end - start
        counts[stage][k] += 1
    return [
        (s[0] / max(c[0], 1), s[1] / max(c[1], 1), s[2] / max(c[2], 1))
        for s, c in zip(sums, counts, strict=True)
    ]
