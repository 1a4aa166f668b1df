"""Exact min-max split of a cost list into contiguous stages."""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.errors import ConfigError


def balance(costs: Sequence[float], stages: int) -> list[int]:
    """Layers per stage for contiguous stages minimising the largest stage cost.

    Exact dynamic programme over prefix sums, O(stages * n^2) — fine for the few hundred
    layers a model has. Every stage gets at least one layer. Among optimal splits the one
    with the most even layer counts comes first in the search, so zero-cost layers (ReLU,
    Flatten) spread rather than pile onto one stage.
    """
    n = len(costs)
    if stages < 1:
        raise ConfigError(f"stages must be >= 1, got {stages}")
    if n < stages:
        raise ConfigError(
            f"cannot split {n} layers into {stages} stages; use at most {n} stages "
            f"or split the model into more layers"
        )
    if any(c < 0 for c in costs):
        raise ConfigError("layer costs must be >= 0")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest max-stage-cost for the first i layers in k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            # Try the even cut first so ties keep layer counts even.
            for j in sorted(range(k - 1, i), key=lambda j: abs(j - (i - i / k))):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i] = value
                    cut[k][i] = j
    sizes: list[int] = []
    i = n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]
