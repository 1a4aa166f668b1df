"""Exact min-max split of a cost list into contiguous stages."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from conveyor.errors import ConfigError


def rows_per_rank(rows: int, ranks: int) -> int:
    """The rows each rank holds (the last ones fewer or none) when ``rows`` are split
    over ``ranks`` as ``torch.chunk`` splits them, as DTensor's and FSDP's ``Shard(0)``
    do: ``ceil(rows / ranks)``. The one rule for a vocabulary's rows per pipeline rank
    and for a sharded parameter's share."""
    return -(-rows // ranks)


def balance(
    costs: Sequence[float], stages: int, placement: Sequence[int] | None = None
) -> list[int]:
    """Layers per stage for contiguous stages minimising the largest stage cost.

    Exact dynamic programme over prefix sums, O(stages * n^2) — fine for the few hundred
    layers a model has. Every stage gets at least one layer, and where possible a layer
    that costs something (with parameter counts as costs: parameters): every stage when at
    least ``stages`` layers cost something, else, given ``placement`` (the rank of each
    stage), at least one stage of every rank, so that no rank is left with nothing to
    train. Among optimal splits the one with the most even layer counts comes first in the
    search, so zero-cost layers (ReLU, Flatten) spread rather than pile onto one stage.

    Args:
        costs: The cost of each layer, >= 0.
        stages: How many stages to make, >= 1.
        placement: The rank of each stage, or None.

    Returns:
        Layers per stage.

    Raises:
        ConfigError: ``stages`` < 1, fewer layers than stages, or a negative cost.
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
    found = [
        (max(_loads(costs, sizes)), sizes)
        for required in costly_stages(costs, stages, placement)
        if (sizes := _min_max(costs, stages, required)) is not None
    ]
    if found:
        return min(found, key=lambda f: f[0])[1]
    sizes = _min_max(costs, stages, frozenset())
    assert sizes is not None
    return sizes


def costly_stages(
    costs: Sequence[float], stages: int, placement: Sequence[int] | None
) -> list[frozenset[int]]:
    """Sets of stages that should each hold a layer costing something, best first.

    Args:
        costs: The cost of each layer.
        stages: How many stages to make.
        placement: The rank of each stage, or None.

    Returns:
        All stages if enough layers cost something; else, given ``placement``, one stage
        of every rank (each choice of which, up to 256 of them); else none.
    """
    costly = sum(1 for c in costs if c > 0)
    if costly >= stages:
        return [frozenset(range(stages))]
    if placement is None or costly < len(set(placement)):
        return []
    per_rank: dict[int, list[int]] = {}
    for s, rank in enumerate(placement):
        per_rank.setdefault(rank, []).append(s)
    choices = itertools.islice(itertools.product(*per_rank.values()), 256)
    return [frozenset(choice) for choice in choices]


def _loads(costs: Sequence[float], sizes: Sequence[int]) -> list[float]:
    """The cost of each stage of a split."""
    out, start = [], 0
    for size in sizes:
        out.append(float(sum(costs[start : start + size])))
        start += size
    return out


def _min_max(costs: Sequence[float], stages: int, required: frozenset[int]) -> list[int] | None:
    """The min-max split in which every stage of ``required`` costs something; None if
    there is none."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: smallest max-stage-cost for the first i layers in k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        needs = k - 1 in required
        for i in range(k, n - (stages - k) + 1):
            # Try the even cut first so ties keep layer counts even.
            for j in sorted(range(k - 1, i), key=lambda j: abs(j - (i - i / k))):
                if needs and prefix[i] - prefix[j] <= 0:
                    continue
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i] = value
                    cut[k][i] = j
    return _sizes(cut, stages, n) if best[stages][n] < inf else None


def balance_within(
    costs: Sequence[float],
    stages: int,
    memory: Sequence[float] | Sequence[Sequence[float]],
    limit: float,
) -> list[int]:
    """Like :func:`balance`, but every stage's memory must stay within ``limit``.

    A stage needs the sum over its layers' memory. Exact min-max over the splits that fit.

    Args:
        costs: The cost of each layer, >= 0.
        stages: How many stages to make, >= 1.
        memory: Bytes each layer needs, or one such list per stage (``memory[s][i]``: what
            layer i needs when it sits on stage s, e.g. activations times the
            micro-batches stage s holds at once).
        limit: The most bytes a stage may need.

    Returns:
        Layers per stage.

    Raises:
        ConfigError: The arguments are invalid (as for :func:`balance`, or ``memory`` of
            the wrong length), or no split fits (naming the smallest limit that would).
    """
    n = len(costs)
    balance(costs, stages)  # same argument checks and messages
    rows: list[list[float]]
    if all(isinstance(m, int | float) for m in memory):
        flat = [float(m) for m in memory]  # type: ignore[arg-type]
        rows = [flat] * stages
    else:
        rows = [[float(v) for v in row] for row in memory]  # type: ignore[union-attr]
    if len(rows) != stages or any(len(row) != n for row in rows):
        raise ConfigError(
            f"memory must give one number per layer ({n}), or one such list per stage ({stages})"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    mem_prefix = []
    for row in rows:
        acc = [0.0]
        for v in row:
            acc.append(acc[-1] + v)
        mem_prefix.append(acc)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        acc = mem_prefix[k - 1]
        for i in range(k, n - (stages - k) + 1):
            for j in sorted(range(k - 1, i), key=lambda j: abs(j - (i - i / k))):
                if best[k - 1][j] == inf:
                    continue
                if acc[i] - acc[j] > limit:
                    continue
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i] = value
                    cut[k][i] = j
    if best[stages][n] == inf:
        smallest = _smallest_limit(mem_prefix, stages, n)
        raise ConfigError(
            f"no split of {n} layers into {stages} stages fits {limit:.4g} bytes per stage; "
            f"the best split needs {smallest:.4g} bytes on its largest stage: raise the memory "
            f"limit, use more ranks, or hold fewer micro-batches at once"
        )
    return _sizes(cut, stages, n)


def _smallest_limit(mem_prefix: list[list[float]], stages: int, n: int) -> float:
    """The smallest largest-stage memory over all contiguous splits (min-max of memory)."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        acc = mem_prefix[k - 1]
        for i in range(k, n - (stages - k) + 1):
            best[k][i] = min(max(best[k - 1][j], acc[i] - acc[j]) for j in range(k - 1, i))
    return best[stages][n]


def _sizes(cut: list[list[int]], stages: int, n: int) -> list[int]:
    """Layers per stage, read back from the dynamic programme's best cut points."""
    sizes: list[int] = []
    i = n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def balance_cuts(
    costs: Sequence[float],
    stages: int,
    penalty: Sequence[float],
    crossing: Sequence[float],
    tolerance: float = 0.25,
    placement: Sequence[int] | None = None,
) -> list[int]:
    """Layers per stage that cut where cutting is cheap, at a bounded cost in balance.

    ``penalty[k]`` and ``crossing[k]`` describe a cut after layer k (``n - 1`` entries).
    Among the splits whose largest stage cost is within ``1 + tolerance`` of the best
    possible (:func:`balance`), this returns the one with the smallest total penalty, then
    the fewest bytes crossing, then the smallest largest stage, then the most even layer
    counts; like :func:`balance`, stages get layers that cost something where possible.
    Exact dynamic programme, like :func:`balance`.

    Args:
        costs: The cost of each layer, >= 0.
        stages: How many stages to make, >= 1.
        penalty: Per cut point, the modules a cut there goes through.
        crossing: Per cut point, the bytes (or values) a cut there sends.
        tolerance: How much worse than the best largest stage cost a split may be.
        placement: The rank of each stage, or None.

    Returns:
        Layers per stage.

    Raises:
        ConfigError: ``penalty`` or ``crossing`` is not one entry per cut point, or the
            arguments are invalid for :func:`balance`.
    """
    n = len(costs)
    if len(penalty) != max(n - 1, 0) or len(crossing) != max(n - 1, 0):
        raise ConfigError(f"penalty and crossing need one entry per cut point ({n - 1})")
    best_sizes = balance(costs, stages, placement)  # checks the arguments
    found = [
        sizes
        for required in costly_stages(costs, stages, placement)
        if (sizes := _cuts(costs, stages, penalty, crossing, tolerance, best_sizes, required))
    ]
    return found[0] if found else best_sizes


def _cuts(
    costs: Sequence[float],
    stages: int,
    penalty: Sequence[float],
    crossing: Sequence[float],
    tolerance: float,
    best_sizes: list[int],
    required: frozenset[int],
) -> list[int] | None:
    """:func:`balance_cuts` with every stage of ``required`` costing something."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    starts = [0]
    for size in best_sizes:
        starts.append(starts[-1] + size)
    optimum = max(prefix[b] - prefix[a] for a, b in itertools.pairwise(starts))
    limit = optimum * (1.0 + tolerance) + 1e-9 * max(1.0, optimum)
    Score = tuple[float, float, float, int]
    worst: Score = (math.inf, math.inf, math.inf, 0)
    # best[k][i]: the best score of the first i layers in k stages; the cut before them.
    best: list[list[Score]] = [[worst] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0, 0.0, 0)
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(i - 1, k - 2, -1):
                load = prefix[i] - prefix[j]
                if load > limit:
                    break  # longer stages only cost more
                if k - 1 in required and load <= 0:
                    continue
                before = best[k - 1][j]
                if before[0] == math.inf:
                    continue
                # The cut before this stage (after layer j - 1) is paid here.
                pen = penalty[j - 1] if j > 0 else 0.0
                sent = crossing[j - 1] if j > 0 else 0.0
                score = (
                    before[0] + pen,
                    before[1] + sent,
                    max(before[2], load),
                    before[3] + (i - j) ** 2,
                )
                if score < best[k][i]:
                    best[k][i] = score
                    cut[k][i] = j
    if best[stages][n][0] == math.inf:
        return None
    return _sizes(cut, stages, n)
